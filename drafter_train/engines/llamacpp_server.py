"""llama.cpp as an engine: llama-server on GGUF files (a given target GGUF, or `export.format=gguf` exports), greedy,
the same prompt token ids as our evaluator, with the drafter and without.

- Prompts go in as token ids (`/completion` with a list prompt), outputs come back as token ids (`return_tokens`), so
  the engine's speculative output is compared token by token with its own plain output, and nothing depends on
  llama.cpp's tokenizer agreeing with ours.
- Acceptance per position: the server logs every verify step at debug verbosity ("add accepted tokens"); from
  those steps P(draft i accepted | drafts before it accepted) is counted exactly as our evaluator counts it (a step
  that drafted fewer than i + 1 tokens does not reach position i).
- Tokens/s: the server's own generation timings (predicted_n / predicted_ms, prompt processing excluded), one
  request at a time after a warm-up request.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

# The server's lifecycle and requests live in the package (the llama.cpp datagen backend uses them too).
from drafter_train.llamacpp_http import complete, free_port, running_server  # noqa: F401 (engine.free_port)

from drafter_train.engines.base import Served
from drafter_train.errors import ConfigError
from drafter_train.llamacpp import SETUP

# llama-server's debug line for every verify step (also the last one of a request, unlike its "accepted a/d" line)
STEP = re.compile(r"add accepted tokens: sampled=-?\d+, ids\.size=(\d+), n_draft=(\d+)")
# the drafter that made the next step's draft (printed for non-empty drafts only; with several --spec-type modes the
# first that drafts wins): a product's steps are attributed to its lookup or its drafter by it
IMPL = re.compile(r"called impl (\S+), hist size")
# llama-server's running totals per drafter (printed after every request): calls and ms of begin, draft, accept
DRAFT_STATS = re.compile(r"statistics\s+(\S+): #calls\(b,g,a\) =\s*\d+\s+(\d+)\s+\d+.*?"
                         r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")


def server_command(bin_dir: Path, target: Path, drafter: Optional[Path], spec_type: Optional[str], draft_len: int,
                   threads: int, port: int, f32_cache: bool, lookup_cache: Optional[Path] = None,
                   repack: bool = True) -> list[str]:
    """llama-server for one user (-np 1), debug log (the per-step acceptance lines), optionally float32 KV caches
    (the default f16 caches round differently from our float32 decoder).

    spec_type: llama.cpp's --spec-type, a comma list (n-gram types are always tried before a draft model, whatever
    the order); None: plain decoding. An n-gram type needs no drafter file; lookup_cache: a static n-gram cache
    (llama-lookup-create) for the ngram-cache type. repack=False: --no-repack, the weights as the file stores them
    (llama.cpp's CPU backend otherwise repacks some types, e.g. Q4_K on AVX2, into interleaved rows whose kernels run
    a batch of 2-3 tokens as that many 1-token passes: ggml-cpu/repack.cpp, forward_mul_mat_one_chunk)."""
    command = [str(bin_dir / "llama-server"), "-m", str(target), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-c", "2048", "-np", "1", "-lv", "5"]
    if f32_cache:
        command += ["-ctk", "f32", "-ctv", "f32"]
    if not repack:
        command.append("--no-repack")
    if spec_type:
        command += ["--spec-type", spec_type, "--spec-draft-n-max", str(draft_len), "--spec-draft-n-min", "0"]
    if lookup_cache is not None:
        command += ["--lookup-cache-static", str(lookup_cache)]
    if drafter is not None:
        command += ["-md", str(drafter), "-td", str(threads)]
        if f32_cache:
            command += ["-ctkd", "f32", "-ctvd", "f32"]
    return command


def decode_prompts(command: list[str], log: Path, prompts: list[list[int]], max_new_tokens: int,
                   ignore_eos: bool = False) -> dict:
    """All prompts one at a time on one server (after a warm-up request): outputs, timings, and the verify steps
    (accepted, drafted) the server logged for them, in all and per request (`per_prompt`: each request's tokens,
    generation ms and steps, from the log lines written while it ran). The server's generation time (gen_ms) starts
    at each request's first token, which the prompt pass made: `requests` tokens of `generated` cost no decode step."""
    with running_server(command, log) as url:
        complete(url, prompts[0], 8)  # warm-up, not counted
        warm = log.read_text(errors="replace")
        replies, per_prompt, seen = [], [], len(warm)
        for ids in prompts:
            replies.append(complete(url, ids, max_new_tokens, ignore_eos))
            text = log.read_text(errors="replace")
            per_prompt.append(_request_record(replies[-1], logged_steps(text[seen:])[0]))
            seen = len(text)
        logged = log.read_text(errors="replace")[len(warm):]
        steps, impls = logged_steps(logged)
    generated = sum(r["timings"].get("predicted_n", 0) for r in replies)
    seconds = sum(r["timings"].get("predicted_ms", 0.0) for r in replies) / 1000
    return {"tokens": [r["tokens"] for r in replies], "steps": steps, "step_impls": impls,
            "tokens_per_s": generated / max(seconds, 1e-9), "generated": generated, "gen_ms": 1000 * seconds,
            "requests": len(replies), "draft_ms": drafting_ms(warm + logged) - drafting_ms(warm),
            "per_prompt": per_prompt,
            "draft_n": sum(r["timings"].get("draft_n", 0) for r in replies),
            "draft_n_accepted": sum(r["timings"].get("draft_n_accepted", 0) for r in replies)}


def near_tie_logprobs(command: list[str], log: Path, cases: list[dict], n_probs: int) -> list[dict]:
    """For each case {prompt, reference, position, verify_sizes (optional)} (a plain output and the position where
    another decoder's output first parts from it), on one plain server: the reference decoded again to that position,
    1 token a step (`stepwise`: tokens and each position's top log-probabilities); the same position's
    log-probabilities from one pass over the prompt and the reference's tokens before it (`batched`: the engine's
    multi-token arithmetic); and, per size m in verify_sizes, from a pass over the prefix's last m tokens alone, the
    rest served from the cache (`verify`: [{batch, logprobs}], batch = the tokens the server evaluated): the shape of
    a verify step whose last row computes the position. A request's first position comes from its prompt pass, each
    later one from a 1-token decode step."""
    out = []
    with running_server(command, log) as url:
        for case in cases:
            k = case["position"]
            prefix = case["prompt"] + case["reference"][:k]
            stepwise = complete(url, case["prompt"], k + 1, n_probs=n_probs)
            batched = complete(url, prefix, 1, n_probs=n_probs)["logprobs"]
            verify = []
            for m in case.get("verify_sizes", ()):
                if m >= len(prefix):
                    continue
                complete(url, prefix[:-m], 0, cache_prompt=True)  # the cache holds all but the last m tokens
                reply = complete(url, prefix, 1, n_probs=n_probs, cache_prompt=True)
                verify.append({"batch": reply["timings"].get("prompt_n"),
                               "logprobs": reply["logprobs"][0] if reply["logprobs"] else {}})
            out.append(dict(case, stepwise_tokens=stepwise["tokens"], stepwise=stepwise["logprobs"],
                            batched=batched[0] if batched else {}, verify=verify))
    return out


def logged_steps(log_text: str) -> tuple[list[tuple[int, int]], list[str]]:
    """The verify steps (accepted, drafted) in `log_text`, in order, and the drafter that drafted each (the last
    "called impl" line before a step that drafted; "" for a step without a draft)."""
    steps, impls, impl = [], [], ""
    for match in re.finditer(f"{STEP.pattern}|{IMPL.pattern}", log_text):
        if match.group(3) is not None:  # a "called impl" line
            impl = match.group(3)
            continue
        size, drafted = int(match.group(1)), int(match.group(2))
        steps.append((size - 1, drafted))
        impls.append(impl if drafted > 0 else "")
        impl = ""
    return steps, impls


def _request_record(reply: dict, steps: list[tuple[int, int]]) -> dict:
    """One request's own figures: tokens made (the first by the prompt pass), generation ms, its verify steps."""
    return {"tokens": reply["timings"].get("predicted_n", len(reply["tokens"])),
            "gen_ms": reply["timings"].get("predicted_ms", 0.0), "steps": steps}


def drafting_ms(log_text: str) -> float:
    """Milliseconds all drafters spent (begin + draft + accept, also calls that proposed nothing) by the end of
    `log_text`: the last running total each drafter printed, summed."""
    last = {}
    for name, _calls, begin, draft, accept in DRAFT_STATS.findall(log_text):
        last[name] = float(begin) + float(draft) + float(accept)
    return sum(last.values())


def server_bin(root: Path, field: str, tools: tuple = ("llama-server",)) -> Path:
    """build/bin of the llama.cpp folder; refused in one line (naming the set-up script) when a tool is not built."""
    bin_dir = root / "build" / "bin"
    for name in tools:
        if not (bin_dir / name).is_file():
            raise ConfigError(f"{field}: no {name} in {bin_dir} (build it with {SETUP}, or set "
                              "$DRAFTER_TRAIN_LLAMACPP to the folder it built)")
    return bin_dir


class LlamaServer:
    """The Engine interface over llama-server: one server per decode() call (plain: the target alone; speculative:
    with the drafter file and --spec-type), each prompt one request after a warm-up request."""

    name = "llama.cpp"

    def __init__(self, bin_dir: Path, target: Path, drafter: Optional[Path], spec_type: Optional[str],
                 draft_len: int, threads: int, log_dir: Path, f32_cache: bool,
                 lookup_cache: Optional[Path] = None):
        self.bin_dir, self.target, self.drafter, self.spec_type = bin_dir, target, drafter, spec_type
        self.draft_len, self.threads, self.f32_cache, self.lookup_cache = draft_len, threads, f32_cache, lookup_cache
        self.log_dir = log_dir
        self.last: dict = {}  # the last decode's raw record (draft_n, gen_ms ...)

    def command(self, speculative: bool) -> list[str]:
        return server_command(self.bin_dir, self.target, self.drafter if speculative else None,
                              self.spec_type if speculative else None, self.draft_len, self.threads, free_port(),
                              self.f32_cache, self.lookup_cache if speculative else None)

    def plain_command(self) -> list[str]:
        """The plain server's command: the near-tie replay of an output difference runs on it."""
        return self.command(speculative=False)

    def decode(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool) -> Served:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / ("llamacpp_spec.log" if speculative else "llamacpp_plain.log")
        self.last = decode_prompts(self.command(speculative), log, prompts, max_new_tokens)
        return Served(tokens=self.last["tokens"], tokens_per_s=self.last["tokens_per_s"], steps=self.last["steps"],
                      draft_ms=self.last["draft_ms"], free_tokens=self.last["requests"])

    def close(self) -> None:
        """Each decode() stops its own server."""
