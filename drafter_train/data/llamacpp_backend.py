"""datagen.backend=llamacpp: the target's continuations from llama-server, the engine that serves the target's GGUF
file as it is (so the drafter learns what the served, quantised model writes).

- The server runs with ``datagen.llamacpp.parallel`` slots and continuous batching; this process sends one
  ``/completion`` request per prompt (token ids in, token ids out: ``return_tokens``), as many at a time as there are
  slots. Prompts are tokenised here exactly as backend=hf does (chat template included).
- ``parallel=null`` (the default) chooses the slot count by measurement (SlotChoice): the server gets
  ``max_parallel`` slots, and the first prompts run at 1, 2, 4 ... requests at a time, WAVES rounds of each, while
  the tokens/s in all keeps rising; the rest run at the fastest count. Those prompts' answers are kept like any
  others (greedy answers do not depend on the count beyond batch numerics, which the journal below covers). On a
  2-core AVX-512 EPYC the 1.5B measured 27.7, 31.1, 32.7 and 33.4 tok/s in all at 1, 2, 4 and 8 slots (8 chosen):
  batching overlaps the prompts' prefill, so even there slots pay a little.
- Greedy at temperature 0; otherwise sampling at ``temperature`` with ``top_k`` (0 = off) and ``top_p`` only
  (``samplers`` pinned, min_p and penalties off), each prompt seeded from ``datagen.seed`` and its index.
- A response stops after the first EOS (kept) or ``max_new_tokens``. llama-server stops on the GGUF's own
  end-of-generation set; a response that stops on a token outside ``eos_token_ids``, or runs past one of them, is
  refused in one line: the two sets differ and the data would not end where training expects.
- ``store_topk`` is refused (config.py): llama-server's ``n_probs`` are probabilities after its sampling settings,
  not the raw logits the other backends store.
- Parallel slots are not batch-invariant (which prompts share a step changes the float sums), so a resumed shard
  must not regenerate what a killed run already had: every finished response is appended to
  ``llamacpp-records.jsonl`` in the output folder (one JSON line, flushed and fsync'd), and reused on resume. A line
  cut by a kill does not parse and is regenerated, so a record is used whole or not at all.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from drafter_train.config import DatagenJobConfig, TargetConfig
from drafter_train.data.generation import Continuation, cut_at_eos
from drafter_train.data.sources import TrainPrompt
from drafter_train.data.vllm_backend import BackendError, prompt_seed
from drafter_train.errors import ConfigError
from drafter_train.llamacpp import llamacpp_dir
from drafter_train.llamacpp_http import free_port, post, running_server
from drafter_train.gguf_file import check_gguf, vocabulary_ids
from drafter_train.targets import EMBEDDED_PREFIX, embedded_gguf, load_tokenizer

JOURNAL = "llamacpp-records.jsonl"  # finished responses, one JSON line each (module doc)
WAVES = 2  # each slot count tried decodes this many times its count of prompts (module doc)
LOG_NAME = "llama-server.log"


def served_gguf(target: TargetConfig) -> Path:
    """The GGUF file llama-server loads: an embedded or named target's own file, or target.path as a .gguf file (or a
    folder plus target.gguf_file)."""
    if target.path.startswith(EMBEDDED_PREFIX):
        return embedded_gguf(target.path, target.cache_dir)
    path = Path(target.path).expanduser()
    if target.gguf_file:
        path = path / target.gguf_file
    if path.suffix != ".gguf" or not path.is_file():
        raise ConfigError(f"target.path: datagen.backend=llamacpp serves a GGUF file; {target.path!r} is not one "
                          "(use a .gguf file, target.gguf_file, or a named target)")
    return path.absolute()


# Token texts llama.cpp puts in its end-of-generation set whatever the GGUF header declares (src/llama-vocab.cpp of
# the vendored source: its EOG texts, and the FIM pad / repo / file-separator tokens it finds by text). A Qwen2.5
# GGUF declares only <|im_end|> (151645) as EOS, yet llama-server also stops on <|endoftext|> (151643) and on
# <|fim_pad|>, <|repo_name|>, <|file_sep|> (and '</s>' 128247: its load log warns "control-looking token: 128247
# '</s>'" and makes it one). The server's own list (EOG_LINE) is checked against this one when the server prints it;
# at its default verbosity (3) the vendored llama-server does not, so the check then has nothing to compare.
LLAMACPP_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>",
                      "<EOT>", "<|end_of_text|>", "<eos>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>",
                      "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>")
EOG_LINE = re.compile(r"print_info: EOG token\s*= (\d+)")


def gguf_eos_ids(gguf: Path, tokenizer) -> list[int]:
    """The ids llama-server ends a generation on: the GGUF header's eos, end-of-turn and end-of-message ids (read
    from the header alone: transformers' GGUF config loader reads every tensor, seconds for a 1.5B), the tokenizer's
    EOS, and the tokens of the GGUF's own vocabulary llama.cpp marks end-of-generation by their text
    (LLAMACPP_EOG_TEXTS; not the tokenizer's vocabulary, to which transformers may add an <|endoftext|>)."""
    metadata = check_gguf(gguf, "target.path").metadata
    ids = {metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")}
    by_text = set(vocabulary_ids(gguf, LLAMACPP_EOG_TEXTS).values())
    return sorted({int(i) for i in ids if i is not None} | ({tokenizer.eos_token_id} - {None}) | by_text)


def check_server_eog(log_text: str, eos: Sequence[int]) -> None:
    """The end-of-generation ids llama-server printed as it loaded the model against ours: a one-line BackendError
    where they differ (no printed list, as from an older server: nothing to check)."""
    served = sorted({int(i) for i in EOG_LINE.findall(log_text)})
    if served and served != sorted(eos):
        raise BackendError(f"llama-server ends generations on tokens {served}, datagen on eos_token_ids "
                           f"{sorted(eos)}: the data would not end where the served model does")


def request_body(cfg: DatagenJobConfig, prompt: TrainPrompt) -> dict:
    """The /completion request of one prompt (module doc: what matches backend=hf)."""
    dg = cfg.datagen
    body = {"prompt": list(prompt.prompt_ids), "n_predict": dg.max_new_tokens, "return_tokens": True,
            "cache_prompt": False, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"]}
    if dg.temperature > 0:
        body.update(temperature=dg.temperature, top_k=dg.top_k, top_p=dg.top_p, min_p=0.0,
                    samplers=["top_k", "top_p", "temperature"], seed=prompt_seed(dg.seed, prompt.index))
    return body


def to_continuation(reply: dict, eos: Sequence[int], max_new_tokens: int) -> Continuation:
    """One server reply -> the response backend=hf would store, or a one-line error where the stop tokens differ."""
    tokens = [int(t) for t in reply.get("tokens", [])]
    response = cut_at_eos(tokens, set(eos))
    if len(response) < len(tokens):
        raise BackendError(f"llama-server went on past EOS token {response[-1]} (one of eos_token_ids {list(eos)}): "
                           "its end-of-generation tokens differ from the target's")
    if reply.get("stop_type") == "eos" and (not tokens or tokens[-1] not in eos):
        raise BackendError(f"llama-server stopped on token {tokens[-1] if tokens else None}, which is not in "
                           f"eos_token_ids {list(eos)}: its end-of-generation tokens differ from the target's")
    if len(response) > max_new_tokens:
        raise BackendError(f"llama-server returned {len(response)} tokens for n_predict={max_new_tokens}")
    return Continuation(response)


class SlotChoice:
    """How many requests run at once: fixed, or chosen by measurement (module doc). plan() says how many of the
    waiting prompts the next batch takes and at how many slots; record() takes what that batch made."""

    def __init__(self, most: int, fixed: Optional[int] = None):
        self.chosen = fixed
        levels, n = [], 1
        while n < most:
            levels.append(n)
            n *= 2
        self.levels = levels + [most]
        self.tried: list[dict] = []  # each measured count: slots, prompts, tokens, seconds, tokens_per_s

    def best(self) -> Optional[int]:
        return max(self.tried, key=lambda t: t["tokens_per_s"])["slots"] if self.tried else None

    def plan(self, waiting: int) -> tuple[int, int]:
        """(slots, prompts) of the next batch: a measurement while the choice is open and enough prompts wait."""
        if self.chosen is not None:
            return self.chosen, waiting
        slots = self.levels[len(self.tried)]
        if waiting < WAVES * slots:  # too few left to measure this count: the rest at the best so far
            return self.best() or slots, waiting
        return slots, WAVES * slots

    def record(self, slots: int, prompts: int, tokens: int, seconds: float) -> None:
        if self.chosen is not None or prompts != WAVES * slots or slots != self.levels[len(self.tried)]:
            return  # not a measurement
        rate = tokens / max(seconds, 1e-9)
        better = not self.tried or rate > max(t["tokens_per_s"] for t in self.tried)
        self.tried.append({"slots": slots, "prompts": prompts, "tokens": tokens, "seconds": round(seconds, 3),
                           "tokens_per_s": round(rate, 2)})
        if not better or len(self.tried) == len(self.levels):  # stopped rising, or every count tried
            self.chosen = self.best()


class LlamaCppBackend:
    """The backend interface of generation.HFBackend, served by llama-server."""

    batch_size: Optional[int] = None  # a whole shard per call: the server's slots batch

    def __init__(self, cfg: DatagenJobConfig):
        self.cfg, settings = cfg, cfg.datagen.llamacpp
        self.gguf = served_gguf(cfg.target)
        self.tokenizer = load_tokenizer(str(self.gguf))
        self.eos_token_ids = gguf_eos_ids(self.gguf, self.tokenizer)
        self.root = llamacpp_dir(settings.llamacpp)
        self.server = self.root / "build" / "bin" / "llama-server"
        if not self.server.is_file():
            raise ConfigError(f"datagen.llamacpp.llamacpp: no llama-server in {self.root / 'build' / 'bin'}; build "
                              "llama.cpp with scripts/setup_llamacpp.sh or set $DRAFTER_TRAIN_LLAMACPP")
        self.output = Path(cfg.datagen.output_dir).expanduser()
        self.journal = self.output / JOURNAL
        self.done, self.unreadable = self._read_journal()
        self.resumed = 0
        self.slots = SlotChoice(settings.max_parallel, settings.parallel)
        self._server = None
        self._lock = threading.Lock()

    def run_info(self) -> dict:
        settings = self.cfg.datagen.llamacpp
        chosen = {"parallel": self.slots.chosen, "parallel_by": "datagen.llamacpp.parallel"}
        if settings.parallel is None:
            chosen.update(parallel_by="measurement", max_parallel=settings.max_parallel, slot_counts=self.slots.tried)
        return {"backend": "llamacpp", "llamacpp": {"gguf": self.gguf.name, **chosen,
                                                     "threads": settings.threads or os.cpu_count()}}

    def generate(self, prompts: Sequence[TrainPrompt]) -> tuple[list[Continuation], float]:
        """Continuations in prompt order (journaled ones reused), and the seconds the new requests took."""
        missing = [p for p in prompts if p.index not in self.done]
        self.resumed += len(prompts) - len(missing)
        start = time.perf_counter()
        while missing:
            url = self._url()
            slots, take = self.slots.plan(len(missing))
            batch, missing = missing[:take], missing[take:]
            began = time.perf_counter()
            with ThreadPoolExecutor(slots) as pool:
                list(pool.map(lambda p: self._complete(url, p), batch))
            self.slots.record(slots, len(batch), sum(len(self.done[p.index]) for p in batch),
                              time.perf_counter() - began)
        return [Continuation(list(self.done[p.index])) for p in prompts], time.perf_counter() - start

    def __enter__(self) -> "LlamaCppBackend":
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.__exit__(None, None, None)

    # ------------------------------------------------------------------------------------------------------------

    def _complete(self, url: str, prompt: TrainPrompt) -> None:
        wait = self.cfg.datagen.llamacpp.request_s
        try:
            reply = post(f"{url}/completion", request_body(self.cfg, prompt), timeout=wait)
        except TimeoutError:  # one line, not urllib's traceback: what to change, and that nothing is lost
            raise BackendError(f"llama-server gave no answer to prompt {prompt.index} within {wait:.0f} s "
                               "(datagen.llamacpp.request_s): the answers so far are journaled, a rerun resumes; "
                               "a busy machine may need more") from None
        continuation = to_continuation(reply, self.eos_token_ids, self.cfg.datagen.max_new_tokens)
        line = json.dumps({"prompt_index": prompt.index, "response_ids": continuation.response_ids}) + "\n"
        with self._lock:  # one whole line at a time, durable before it counts
            with open(self.journal, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.done[prompt.index] = continuation.response_ids

    def _url(self) -> str:
        if self._server is None:
            dg, settings = self.cfg.datagen, self.cfg.datagen.llamacpp
            threads = str(settings.threads or os.cpu_count())
            slots = settings.parallel or settings.max_parallel
            context = slots * (dg.max_prompt_tokens + dg.max_new_tokens + 8)
            command = [str(self.server), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(free_port()),
                       "-t", threads, "-tb", threads, "-np", str(slots), "-c", str(context),
                       "--cont-batching", "--no-warmup"]
            self.output.mkdir(parents=True, exist_ok=True)
            self._server = running_server(command, self.output / LOG_NAME, settings.startup_s)
            try:
                self._url_value = self._server.__enter__()
            except RuntimeError as err:
                self._server = None
                raise BackendError(f"datagen.backend=llamacpp: {err}") from None
            check_server_eog((self.output / LOG_NAME).read_text(errors="replace"), self.eos_token_ids)
        return self._url_value

    def _read_journal(self) -> tuple[dict[int, list[int]], int]:
        """Responses a previous run finished (whole lines only), and how many lines were cut or unreadable."""
        done, unreadable = {}, 0
        if not self.journal.is_file():
            return done, unreadable
        for line in self.journal.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
                done[int(record["prompt_index"])] = [int(t) for t in record["response_ids"]]
            except (ValueError, KeyError, TypeError):
                unreadable += 1
        return done, unreadable
