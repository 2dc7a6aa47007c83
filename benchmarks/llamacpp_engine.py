"""The llama.cpp side of benchmarks/engine_check.py (--engine llamacpp): llama-server on `drafter-export
export.format=gguf` files, greedy, the same prompt token ids as our evaluator, once with the drafter and once without.

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
from drafter_train.llamacpp_server import complete, free_port, running_server  # noqa: F401 (engine.free_port)

# llama-server's debug line for every verify step (also the last one of a request, unlike its "accepted a/d" line)
STEP = re.compile(r"add accepted tokens: sampled=-?\d+, ids\.size=(\d+), n_draft=(\d+)")
# llama-server's running totals per drafter (printed after every request): calls and ms of begin, draft, accept
DRAFT_STATS = re.compile(r"statistics\s+(\S+): #calls\(b,g,a\) =\s*\d+\s+(\d+)\s+\d+.*?"
                         r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")


def server_command(bin_dir: Path, target: Path, drafter: Optional[Path], spec_type: Optional[str], draft_len: int,
                   threads: int, port: int, f32_cache: bool, lookup_cache: Optional[Path] = None) -> list[str]:
    """llama-server for one user (-np 1), debug log (the per-step acceptance lines), optionally float32 KV caches
    (the default f16 caches round differently from our float32 decoder).

    spec_type: llama.cpp's --spec-type, a comma list (n-gram types are always tried before a draft model, whatever
    the order); None: plain decoding. An n-gram type needs no drafter file; lookup_cache: a static n-gram cache
    (llama-lookup-create) for the ngram-cache type."""
    command = [str(bin_dir / "llama-server"), "-m", str(target), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-c", "2048", "-np", "1", "-lv", "5"]
    if f32_cache:
        command += ["-ctk", "f32", "-ctv", "f32"]
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
    (accepted, drafted) the server logged for them. The server's generation time (gen_ms) starts at each request's
    first token, which the prompt pass made: `requests` tokens of `generated` cost no decode step."""
    with running_server(command, log) as url:
        complete(url, prompts[0], 8)  # warm-up, not counted
        warm = log.read_text(errors="replace")
        replies = [complete(url, ids, max_new_tokens, ignore_eos) for ids in prompts]
        logged = log.read_text(errors="replace")[len(warm):]
        steps = [(int(size) - 1, int(drafted)) for size, drafted in STEP.findall(logged)]
    generated = sum(r["timings"].get("predicted_n", 0) for r in replies)
    seconds = sum(r["timings"].get("predicted_ms", 0.0) for r in replies) / 1000
    return {"tokens": [r["tokens"] for r in replies], "steps": steps, "tokens_per_s": generated / max(seconds, 1e-9),
            "generated": generated, "gen_ms": 1000 * seconds, "requests": len(replies), "draft_ms": drafting_ms(warm + logged) - drafting_ms(warm),
            "draft_n": sum(r["timings"].get("draft_n", 0) for r in replies),
            "draft_n_accepted": sum(r["timings"].get("draft_n_accepted", 0) for r in replies)}


def drafting_ms(log_text: str) -> float:
    """Milliseconds all drafters spent (begin + draft + accept, also calls that proposed nothing) by the end of
    `log_text`: the last running total each drafter printed, summed."""
    last = {}
    for name, _calls, begin, draft, accept in DRAFT_STATS.findall(log_text):
        last[name] = float(begin) + float(draft) + float(accept)
    return sum(last.values())


def acceptance_from_steps(steps: list[tuple[int, int]], draft_len: int) -> dict:
    """Verify steps (accepted, drafted) -> conditional per-position acceptance and the mean acceptance length
    (1 + accepted drafts per drafting step), as engine_check compares them."""
    drafting = [(a, d) for a, d in steps if d > 0]
    reached = [sum(1 for a, d in drafting if d > i and a >= i) for i in range(draft_len)]
    accepted = [sum(1 for a, d in drafting if a > i) for i in range(draft_len)]
    return {"per_position_acceptance": [a / r if r else 0.0 for a, r in zip(accepted, reached)],
            "mean_acceptance_length": 1 + sum(a for a, _ in drafting) / max(len(drafting), 1),
            "drafting_steps": len(drafting), "accepted_per_position": accepted, "reached_per_position": reached}


def output_mismatches(spec: list[list[int]], plain: list[list[int]]) -> list[dict]:
    """Prompts whose speculative output differs from plain: the prompt index and the first differing position.
    Greedy speculative decoding is lossless in exact arithmetic; in the engine a batched verify pass and a
    one-token pass round differently, so a near-tie can flip (reported, not hidden)."""
    found = []
    for index, (a, b) in enumerate(zip(spec, plain)):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            found.append({"prompt": index, "first_difference": first, "spec_len": len(a), "plain_len": len(b)})
    return found
