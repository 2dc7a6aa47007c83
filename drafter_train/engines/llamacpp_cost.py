"""What one speculative step costs inside llama-server, measured through llama-server itself (issue 31 §6); and
llama-bench's pass curve beside it. `python -m benchmarks.llamacpp_cost` measures them alone.

Why not llama-bench's curve alone: `llama-bench -p n -n 0` times a target pass over n tokens that computes logits for
the last token only and nothing else. A verify step in llama-server also
- computes logits (the 49152 x 576 lm_head of SmolLM2) at every one of its n positions and keeps them for sampling;
- runs the drafter's `process()` on the verify batch, untimed in llama-server's drafting statistics (`dur`): for
  EAGLE-3 the copy of three target layers' hidden states, its `fc` encoder over every row and one decoder pass over
  them; for a draft model (draft-simple) a draft-model pass over the whole batch again (the server rolls the draft
  context back and re-evaluates, its TAG_SPEC_AVOID_DRAFT_REEVAL);
- and the server's per-step bookkeeping (batch building, KV-cache rollback, the other llama_process calls).

The measurement: llama-server with synthetic acceptance 0 (`--spec-synth-rates 0,...`, llama.cpp's own benchmarking
switch: every draft is rejected, so every step is one verify pass over d + 1 tokens that makes exactly one token,
whatever the prompt) at a fixed draft length, on calibration prompts that are not the runs being predicted (the dev
split by default). A step's verify cost is the generation time less the drafting time the server logged for it, less
its plain steps at the plain server's per-token cost, divided by the drafting steps (the few drafts cut short near
the end of a request count at their share). Three verify kinds, by what runs on the verify batch:
- `ngram`: the target alone (every n-gram mode: their process() is empty), measured with ngram-simple on a prompt
  that repeats a chunk (so its lookup drafts a full run every step);
- `eagle3`: the target plus EAGLE-3's process() (the EAGLE-3 row and the product, whose n-gram cache drafts are
  verified with EAGLE-3's process() running too);
- `ar`: the target plus the draft model's re-evaluation (draft-simple);
- `dflash`: the target plus DFlash's process() (draft-dflash: the target layers' hidden states copied into its
  context for the next block).
A verify kind whose cost depends on the drafter file (every kind but `ngram`) is measured per drafter where a table
serves several of one kind (a stock 0.5B draft model and a trained one): its cost key is `kind:label`
(`cost_key`), and the calibration runs once per key with that drafter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Optional, Sequence

from drafter_train.engines import llamacpp_server as engine

PRECISIONS = ("f32", "f16", "q8_0")  # the target precisions the engine table and the checks export and time
KINDS = ("ngram", "eagle3", "ar", "dflash")
# llama-server's --spec-type that calibrates each kind
SPEC_TYPES = {"ngram": "ngram-simple", "eagle3": "draft-eagle3", "ar": "draft-simple", "dflash": "draft-dflash"}
# drafts per step measured for the n-gram kind (a verify pass over 1 + d tokens): the free modes draft long runs
# (ngram-simple 12 to 48 tokens, ngram-mod up to 64)
NGRAM_DRAFTS = (2, 8, 24, 48)
CACHE_DRAFTS = 8  # the most the static n-gram cache (ngram-cache) drafts in one step
NGRAM_MATCH = 1  # ngram-simple's n-gram length while calibrating: any match drafts (its drafts are rejected anyway)
NGRAM_PROMPTS = 2  # the n-gram kind's long steps: fewer calibration prompts
REPEAT_PERIOD = 64  # the calibration prompt of the ngram kind repeats a chunk of this many tokens (> every draft)
# its chunk is topped up with ids from here on: past the special tokens of the vocabularies seen, inside the smallest
# (stories260K's 512; ids past a vocabulary make llama-server answer 400)
FILLER_START = 256


def verify_kind(spec_type: Optional[str]) -> Optional[str]:
    """Which verify cost a llama.cpp run's steps pay: None for plain decoding."""
    if not spec_type:
        return None
    types = spec_type.split(",")
    if "draft-eagle3" in types:
        return "eagle3"
    if "draft-simple" in types:
        return "ar"
    if "draft-dflash" in types:
        return "dflash"
    if any(t.startswith("draft-") for t in types):
        raise ValueError(f"llamacpp_cost: no verify-cost kind for --spec-type {spec_type}")
    return "ngram"


def drafts_for(decoders: Sequence[dict], ngram_drafts: Sequence[int] = NGRAM_DRAFTS) -> dict[str, tuple[int, ...]]:
    """The draft lengths to calibrate per cost key (cost_key: the verify kind, or kind:label) for llama.cpp decoders
    (benchmarks/engines.py's dicts): each drafting decoder's draft length, the n-gram cache's longest draft where it
    runs ahead of a drafter (the product), and `ngram_drafts` for the free n-gram modes. Sizes between are
    interpolated (calibrate.cost_at)."""
    out: dict[str, set] = {}
    for d in decoders:
        kind = cost_key(d)
        if kind == "ngram":
            out.setdefault(kind, set()).update(ngram_drafts)
        elif kind is not None:
            out.setdefault(kind, set()).add(d["draft_len"])
            if "ngram" in d["spec_type"]:
                out[kind].add(CACHE_DRAFTS)
    return {kind: tuple(sorted(sizes)) for kind, sizes in out.items()}


def cost_key(decoder: dict) -> Optional[str]:
    """The verify-cost curve a llama.cpp decoder's steps follow: its verify kind, or `kind:label` for a drafter row
    with a label (each drafter file calibrated apart)."""
    kind = verify_kind(decoder["spec_type"])
    return f"{kind}:{decoder['label']}" if kind not in (None, "ngram") and decoder.get("label") else kind


def _kind(key: str) -> str:
    return key.split(":", 1)[0]


def calibration_command(bin_dir: Path, target: Path, kind: Optional[str], drafts: int, drafter: Optional[Path],
                        threads: int, port: int, f32_cache: bool, repack: bool = True) -> list[str]:
    """llama-server for one calibration run: plain (kind None), or the kind's speculation at `drafts` drafts per step
    with every draft rejected (synthetic acceptance 0)."""
    if kind is None:
        return engine.server_command(bin_dir, target, None, None, 0, threads, port, f32_cache, repack=repack)
    spec_type = SPEC_TYPES[kind]
    command = engine.server_command(bin_dir, target, None if kind == "ngram" else drafter, spec_type, drafts,
                                    threads, port, f32_cache, repack=repack)
    if kind == "ngram":
        command += ["--spec-ngram-simple-size-n", str(NGRAM_MATCH), "--spec-ngram-simple-size-m", str(drafts)]
    return command + ["--spec-synth-rates", ",".join(["0"] * drafts)]


def repeating_prompt(prompt: list[int], period: int = REPEAT_PERIOD, repeats: int = 3) -> list[int]:
    """The prompt followed by `repeats` copies of a chunk of `period` distinct tokens (the prompt's own, topped up
    with ids from FILLER_START on): the target continues the repetition, so an n-gram lookup finds a draft of up to
    period - 1 tokens at every step (distinct tokens: no shorter match inside the chunk)."""
    distinct = list(dict.fromkeys(prompt))
    chunk = (distinct + [t for t in range(FILLER_START, FILLER_START + 2 * period) if t not in set(distinct)])[:period]
    return prompt + chunk * repeats


def step_cost(served: dict, plain_ms: float, drafts: int) -> tuple[float, int]:
    """(ms of one verify step over drafts + 1 tokens, drafting steps) of a synthetic-acceptance run at draft length
    `drafts`: the generation ms less the drafting ms the server logged, less its plain steps (no draft found, or no
    room left) at `plain_ms`, over its drafting steps. Drafts cut shorter near the end of a request count at their
    share: the step cost is taken as linear in the drafted tokens between plain_ms and the full draft's. The first
    token of each request comes from the prompt pass and costs no step."""
    drafted = [d for _, d in served["steps"] if d > 0]
    if not drafted:
        raise RuntimeError("llamacpp_cost: the calibration run drafted nothing")
    passes = served["generated"] - served["requests"]
    plain_steps = passes - sum(a + 1 for a, d in served["steps"] if d > 0)
    verify_ms = served["gen_ms"] - served["draft_ms"] - plain_steps * plain_ms
    return plain_ms + (verify_ms - len(drafted) * plain_ms) * drafts / sum(drafted), len(drafted)


def plain_step_ms(served: dict) -> float:
    """ms of one plain decode step (the first token of each request is free)."""
    return served["gen_ms"] / max(served["generated"] - served["requests"], 1)


def server_curves(bin_dir: Path, target: Path, drafters: dict, prompts: list[list[int]], max_new_tokens: int,
                  threads: int, f32_cache: bool, log: Path, drafts: dict, repack: bool = True) -> dict:
    """One precision: the plain server's per-token ms (ms_1) and, per cost key of `drafts` ({kind or kind:label: draft
    lengths}) with its drafter file (drafters: {"eagle3": path, "ar:0.5B": path ...}; ngram needs none), the verify
    step's ms by pass size and relative to ms_1."""
    def served(key, d, prompt_set, n_new):
        command = calibration_command(bin_dir, target, key and _kind(key), d, drafters.get(key), threads,
                                      engine.free_port(), f32_cache, repack)
        return engine.decode_prompts(command, log, prompt_set, n_new, ignore_eos=True)

    plain = plain_step_ms(served(None, 0, prompts, max_new_tokens))
    out = {"ms_1": plain, "kinds": {}}
    for key in sorted(drafts, key=lambda k: (KINDS.index(_kind(k)), k)):
        if _kind(key) != "ngram" and drafters.get(key) is None:
            raise ValueError(f"llamacpp_cost: no drafter file for the {key} calibration")
        ms, steps, drafting = {1: plain}, {}, {}
        for d in drafts[key]:
            prompt_set = [repeating_prompt(p) for p in prompts[:NGRAM_PROMPTS]] if key == "ngram" else prompts
            # room for full drafts: a draft is cut to the tokens still to make
            try:
                run = served(key, d, prompt_set, max(max_new_tokens, 2 * d + 8))
                ms[d + 1], steps[d + 1] = step_cost(run, plain, d)
                drafting[d + 1] = run["draft_ms"] / steps[d + 1]  # the drafter's own passes, per drafting step
            except RuntimeError as error:  # the kind's rows fall back to llama-bench's curve
                print(f"{error} ({key}, {d} drafts)", file=sys.stderr)
        if len(ms) > 1:
            out["kinds"][key] = {"ms": ms, "relative": {n: v / plain for n, v in ms.items()}, "steps": steps,
                                 "draft_ms": drafting}
    return out


def median_server_curves(rounds: Sequence[dict]) -> dict:
    """Per kind and size, the median over rounds, and relative to the median plain step."""
    ms_1 = median(r["ms_1"] for r in rounds)
    kinds = {}
    for kind in {k for r in rounds for k in r["kinds"]}:
        measured = [r["kinds"][kind]["ms"] for r in rounds if kind in r["kinds"]]
        sizes = sorted({n for m in measured for n in m})
        ms = {n: median(m[n] for m in measured if n in m) for n in sizes}
        ms[1] = ms_1
        kinds[kind] = {"ms": ms, "relative": {n: v / ms_1 for n, v in ms.items()}}
    return {"ms_1": ms_1, "kinds": kinds}


def calibration_prompts(target: str, prompts: Optional[str], num_prompts: int,
                        categories: Optional[list[str]] = None) -> list[list[int]]:
    """Token ids of the calibration prompts (the target's tokenizer alone, no model loaded)."""
    return prompt_set(target, prompts, num_prompts, categories)[0]


def prompt_set(target: str, prompts: Optional[str], num_prompts: int, categories: Optional[list[str]] = None,
               per_category: Optional[int] = None) -> tuple[list[list[int]], list]:
    """(token ids, each prompt's category) of the first `num_prompts` prompts (of `categories`, when given), or of the
    first `per_category` prompts of each category in the file's order (the target's tokenizer alone)."""
    from drafter_train.config import TargetConfig
    from drafter_train.data.prompts import prompt_ids
    from drafter_train.targets import load_target_tokenizer

    cfg = TargetConfig(path=target)
    if not per_category:
        return prompt_ids(load_target_tokenizer(cfg), cfg, prompts, num_prompts, categories)
    ids, found = prompt_ids(load_target_tokenizer(cfg), cfg, prompts, 10 ** 9, categories)
    taken: dict = {}
    keep = [i for i, c in enumerate(found) if taken.setdefault(c, []).append(i) or len(taken[c]) <= per_category]
    return [ids[i] for i in keep], [found[i] for i in keep]


def bench_curve(bin_dir: Path, gguf: Path, sizes: list[int], depth: int, repeats: int, threads: int,
                repack: bool = True) -> dict[int, float]:
    """llama-bench: median ms of one pass over n tokens after `depth` cached tokens (its pp tests at that depth).
    llama-bench takes no f32 KV cache, so its caches are f16 at every precision (the server's are f32 at f32)."""
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", ",".join(map(str, sizes)), "-n", "0",
               "-d", str(depth), "-r", str(repeats), "-t", str(threads), "--repack", str(int(repack)), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return {test["n_prompt"]: median(test["samples_ns"]) / 1e6 for test in json.loads(done.stdout)}
