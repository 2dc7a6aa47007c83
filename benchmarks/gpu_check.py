"""The GPU device check: one prepared command that runs, on one lent GPU, what this project had never run on one.

    python -m benchmarks.gpu_check                          # on the GPU machine (about 4 minutes on an H100)
    python -m benchmarks.gpu_check --device cpu --tiny      # the same path at tiny size, here (tests/test_gpu_check.py)

Stages, each written to benchmarks/results/gpu.json as soon as it ends (and copied to $OUT/gpu.json when the
device tool's OUT is set), so a run cut off keeps what it measured. A failing stage records its error and the next
one runs; each stage has a time budget (SIGALRM), and the whole run a deadline:

1. machine: the GPU (name, memory, H100 or H200), torch, CUDA and transformers versions;
2. tests: the device-dependent tests (tests/test_devices.py: the target on accelerate's device, eager and sdpa
   logits in fp32 and in bf16, bf16 autocast over fp32 master weights through drafter-train, experiment=gpu_smoke
   at tiny size) run by pytest on this device, pass or fail by name;
3. target: a Llama-3.1-8B-shaped target (benchmarks.gpu_plan.LLAMA_31_8B) built from its config at random in bf16
   directly on the device, sdpa attention: no weights travel, and the cost of a pass does not depend on them;
4. verify_curve: one pass over n new tokens after a 512-token cached prefix, n = 1 ... 64, timed through the
   decoder's calibration (drafter_train.calibrate.verify_cost_curve: CachedLM, host clock after a synchronize) and
   through a bare torch loop (DynamicCache, CUDA events): ms, the cost relative to n = 1, and our per-pass overhead;
5. drafter: the EAGLE-3 drafter drafter-train builds for that target, its ms per proposal at draft lengths 3-7
   (the decoder's own DecodeStats, in real speculative decoding of random prompts);
6. predictions: the calibration model's speedup (calibrate.predicted_speedup) from the measured curve and drafter
   cost, at tau = 2, 3, 4 and draft lengths 3-7, with the tau that breaks even;
7. train: drafter-train's `experiment=gpu_smoke` (EAGLE-3, bf16 target with sdpa, bf16 autocast, offline
   features) for --steps steps on that target at the recipe's sequence length, on data written here with a
   tokenizer built in-process (random ids below the target's vocabulary, sequences filling train.max_seq_len):
   tokens/s, s/step, peak torch.cuda.max_memory_allocated; then its one checkpoint evaluation (greedy speculative
   == plain decoding, with timing). The target is the in-memory one of stage 3 (drafter-train's load_target is
   handed it), so 16 GB of random weights are neither written nor read back;
8. plan: what `python -m benchmarks.gpu_plan --gpus 1 --draft-vocab-size 8192` predicts for that run (its DDP row,
   at the run's batch and length), next to the measured peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

NAME = "gpu"
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]  # the 1..64 powers of two, plus 3 and 5-7 for draft lengths 2-6
SHOWN = [1, 2, 4, 8, 16, 32, 64]
DRAFT_LENS = [3, 4, 5, 6, 7]
TAUS = [2.0, 3.0, 4.0]
TOLERANCE_NOTE = ("sdpa against eager in bf16 (tests/test_devices.py): relative error ||a - b|| / ||b|| of the "
                  "logits against fp32 eager below 1e-1 for both kernels and between them, sdpa's at most twice "
                  "eager's (the tiny target's large init amplifies bf16 rounding: ~5e-2 on a CPU)")


class StageTimeout(Exception):
    """A stage ran past its time budget."""


# ----------------------------------------------------------------------------------------------------------------
# Sizes


def sizes(tiny: bool) -> dict:
    """The run's shape: the 8B recipe, or the same path at tiny size for the CPU."""
    if tiny:
        return dict(prefix=32, repeats=2, decode_tokens=8, decode_prompt=24, draft_vocab=64, seq_len=64,
                    records=4, steps=4, eval_prompts=1, eval_tokens=8, words=200, plan_lengths=[16, 24, 32])
    return dict(prefix=512, repeats=20, decode_tokens=32, decode_prompt=512, draft_vocab=8192, seq_len=2048,
                records=16, steps=30, eval_prompts=4, eval_tokens=64, words=32000, plan_lengths=[16, 32, 64])


def target_config(tiny: bool):
    from transformers import LlamaConfig

    from benchmarks.gpu_plan import LLAMA_31_8B

    shape = dict(LLAMA_31_8B)
    if tiny:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    # ids 0-2 are the in-process tokenizer's <unk>, <s>, </s>
    return LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers, as benchmarks.gpu_plan takes them."""
    return [2, num_layers // 2, num_layers - 3]


# ----------------------------------------------------------------------------------------------------------------
# The record: gpu.json, rewritten after every stage


class Record:
    """gpu.json: every finished stage's figures in data.stages, the verify curve as the table; copied to $OUT."""

    def __init__(self, results_dir: Path, out: Optional[str], argv: Sequence[str], machine: dict):
        self.results_dir, self.out, self.argv, self.machine = results_dir, out, list(argv), machine
        self.stages: dict[str, dict] = {}

    def add(self, stage: str, result: dict) -> None:
        self.stages[stage] = result
        self.write()

    def write(self) -> None:
        from benchmarks.common import command_line, write_result

        curve = self.stages.get("verify_curve", {})
        rows = [[n, curve["ours_ms"].get(str(n)), curve["bare_ms"].get(str(n)), curve["ours_relative"].get(str(n)),
                 curve["bare_relative"].get(str(n))] for n in SHOWN if str(n) in curve.get("ours_ms", {})]
        path = write_result(
            NAME, title="The GPU check: verify cost, training and losslessness on one GPU",
            question=("What does one target pass over n new tokens cost on a GPU after a 512-token cached prefix, "
                      "for a Llama-3.1-8B-shaped target in bf16, and does the GPU recipe (experiment=gpu_smoke) "
                      "train, fit its memory plan and decode losslessly there?"),
            command=command_line("gpu_check", self.argv), split="none: random token ids (random weights)",
            baseline="the same target's pass over 1 token (relative cost); plain greedy decoding (evaluation)",
            columns=["n", "calibration ms", "bare torch ms", "relative (calibration)", "relative (bare)"],
            rows=rows, machine=self.machine, results_dir=self.results_dir, data={"gpu_check": self.stages})
        if self.out:
            Path(self.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(self.out) / path.name)


def describe_gpu(device) -> dict:
    """The machine with its GPU: benchmarks.common.describe_machine plus the accelerator and the library versions."""
    import torch
    import transformers

    from benchmarks.common import describe_machine

    info = {**describe_machine(), "device": device.type, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    gpu_kind=next((k for k in ("H200", "H100", "A100") if k in props.name), props.name),
                    multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    return info


# ----------------------------------------------------------------------------------------------------------------
# Stages


@contextlib.contextmanager
def budget(seconds: float):
    """Raise StageTimeout in this (main) thread after `seconds`."""
    def expire(*_):
        raise StageTimeout(f"over its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_stage(record: Record, name: str, seconds: float, deadline: float, fn: Callable[[], dict]) -> Optional[dict]:
    """fn's figures, recorded with the stage's wall time; an error or a timeout is recorded instead, and None
    returned, so the next stage still runs."""
    left = deadline - time.monotonic()
    if left < 5:
        record.add(name, {"error": "skipped: the run's deadline had passed"})
        return None
    start = time.monotonic()
    print(f"gpu_check: {name} (budget {min(seconds, left):.0f} s)", flush=True)
    try:
        with budget(min(seconds, left)):
            result = fn()
    except Exception as err:  # noqa: BLE001 (a stage's failure is a finding: record it, run the next)
        traceback.print_exc()
        record.add(name, {"error": f"{type(err).__name__}: {err}"[:2000], "seconds": time.monotonic() - start})
        return None
    result["seconds"] = round(time.monotonic() - start, 2)
    record.add(name, result)
    print(f"gpu_check: {name} done in {result['seconds']:.1f} s", flush=True)
    return result


def device_tests(pytest_args: Sequence[str], seconds: float, work: Path) -> dict:
    """pytest on the device-dependent tests in a child process on this device: each test's outcome by name."""
    junit = work / "junit.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # no:xdist: a few tests in one process, not a worker per core each setting up the device
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"--junitxml={junit}", *pytest_args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=seconds)
    tests = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = next(((child.tag, (child.get("message") or "").splitlines()[:1]) for child in case
                        if child.tag in ("failure", "error", "skipped")), ("passed", []))
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tests[name] = {"outcome": outcome[0], "message": (outcome[1] or [""])[0][:300]}
    return {"returncode": proc.returncode, "tests": tests, "tolerance": TOLERANCE_NOTE,
            "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def build_target(config, device):
    """The target at random in bf16 with sdpa, built on `device` (no weights travel): eval mode, frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


class Timer:
    """ms of device work: CUDA events around it on a GPU (METHOD.md), else the host clock."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda \
            else None

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            self.events[0].record()
            fn()
            self.events[1].record()
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1])
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)


def bare_curve(target, prefix, sizes_: Sequence[int], repeats: int) -> dict[int, float]:
    """Median ms of one plain HF forward over n new tokens after the cached `prefix`, cropped back after each:
    the floor our decoder's bookkeeping adds to. Interleaved over sizes after one untimed round."""
    import statistics

    import torch
    from transformers import DynamicCache

    timer, times = Timer(target.device), {n: [] for n in sizes_}
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        ids = torch.tensor([list(prefix)], device=target.device)
        target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        new = ids[:, : max(sizes_)]
        for r in range(repeats + 1):
            for n in sizes_:
                ms = timer(lambda: target(input_ids=new[:, :n], past_key_values=cache, use_cache=True,
                                          logits_to_keep=n))
                cache.crop(-n)
                if r:
                    times[n].append(ms)
    return {n: statistics.median(values) for n, values in times.items()}


def verify_curve(target, prefix: list[int], repeats: int) -> dict:
    from drafter_train.calibrate import relative_costs, verify_cost_curve

    ours = verify_cost_curve(target, prefix, SIZES, [], repeats)["plain"]
    bare = bare_curve(target, prefix, SIZES, repeats)
    return {"prefix": len(prefix), "repeats": repeats, "dtype": str(target.dtype).removeprefix("torch."),
            "ours_ms": {str(n): ms for n, ms in ours.items()}, "bare_ms": {str(n): ms for n, ms in bare.items()},
            "ours_relative": {str(n): c for n, c in relative_costs(ours).items()},
            "bare_relative": {str(n): c for n, c in relative_costs(bare).items()},
            "overhead_ms": {str(n): ours[n] - bare[n] for n in SIZES}}


def drafter_cost(target, layers: list[int], draft_vocab: int, prompts: list[list[int]], max_new_tokens: int,
                 eos: list[int]) -> dict:
    """The EAGLE-3 drafter's ms per proposal at each draft length, from real speculative decoding (untrained: the
    acceptance means nothing, the cost does)."""
    import torch

    from benchmarks.gpu_plan import eagle3_drafter
    from drafter_train.config import EvalConfig
    from drafter_train.drafters.registry import make_drafter
    from drafter_train.evaluation import calibration_decoder

    model = eagle3_drafter(target, draft_vocab, layers).to(target.dtype).eval().requires_grad_(False)
    decode = calibration_decoder(target, make_drafter(model, "default"), prompts, eos,
                                 EvalConfig(max_new_tokens=max_new_tokens))
    by_len = {}
    for k in DRAFT_LENS:
        stats = decode(EvalConfig(max_new_tokens=max_new_tokens, draft_len=k))
        by_len[str(k)] = {"ms_per_proposal": 1000 * stats.draft_seconds / max(stats.proposals, 1),
                          "proposals": stats.proposals, "accepted": stats.accepted}
    params = sum(p.numel() for p in model.parameters())
    del model, decode
    if target.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"draft_vocab": draft_vocab, "layers": layers, "parameters": params, "by_draft_len": by_len}


def predictions(curve: dict, drafter: Optional[dict]) -> dict:
    """calibrate.predicted_speedup from the measured curve (ours) and drafter cost, for tau x draft length."""
    from drafter_train.calibrate import break_even_tau, cost_at, predicted_speedup

    relative = {int(n): c for n, c in curve["ours_relative"].items()}
    ar_ms = curve["ours_ms"]["1"]
    rows = []
    for k in DRAFT_LENS:
        draft_ms = (drafter or {}).get("by_draft_len", {}).get(str(k), {}).get("ms_per_proposal", 0.0)
        verify, draft = cost_at(relative, k + 1), draft_ms / ar_ms
        rows.append({"draft_len": k, "verify_cost": verify, "draft_cost": draft,
                     "break_even_tau": break_even_tau(verify, draft),
                     **{f"tau={t:g}": predicted_speedup(t, verify, draft) for t in TAUS}})
    return {"rows": rows, "drafter_cost_measured": drafter is not None}


# ---- training ------------------------------------------------------------------------------------------------------


def word_tokenizer(words: int):
    """A word-level tokenizer built in-process (w0 ... w{words-1} after <unk>, <s>, </s>): nothing travels, and
    every id is below any target vocabulary at least this large."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(words))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


def write_training_inputs(work: Path, config, tokenizer, shape: dict) -> tuple[Path, Path]:
    """A target folder (config and tokenizer: the weights stay in memory) and a drafter-datagen folder of random
    records each filling train.max_seq_len (64 prompt tokens, the rest response), plus held-out eval prompts."""
    import torch

    from drafter_train.data.store import FORMAT, DatagenStore, tokenizer_fingerprint

    target_dir, data_dir = work / "target", work / "data"
    config.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    gen = torch.Generator().manual_seed(0)
    words = lambda n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()  # noqa: E731
    prompt_len = min(64, shape["seq_len"] // 4)
    records = [{"prompt_index": i, "prompt": "", "prompt_ids": words(prompt_len),
                "response_ids": words(shape["seq_len"] - prompt_len), "reference_ids": []}
               for i in range(shape["records"])]
    store = DatagenStore.open(str(data_dir))
    evals = [" ".join(f"w{i}" for i in words(shape["seq_len"] // 4)) for _ in range(shape["eval_prompts"])]
    store.start({"format": FORMAT, "target": {"path": str(target_dir)}, "counts": {"shards_total": 1},
                 "run": {"tokenizer_sha256": tokenizer_fingerprint(tokenizer)}}, evals)
    store.write_shard(0, records, store_topk=0)
    store.finish()
    return target_dir, data_dir


class StepWatch:
    """Per optimizer step: seconds (after a synchronize) and the peak allocated bytes since the step before."""

    def __init__(self, device):
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.torch, self.device, self.times, self.peaks = torch, device, [time.perf_counter()], []
        self.handle = register_optimizer_step_post_hook(self._step)

    def _step(self, *_):
        from drafter_train.devices import synchronize

        synchronize(self.device)
        self.times.append(time.perf_counter())
        if self.device.type == "cuda":
            self.peaks.append(self.torch.cuda.max_memory_allocated(self.device))
            self.torch.cuda.reset_peak_memory_stats(self.device)


def train_smoke(target, tokenizer, work: Path, shape: dict, layers: list[int]) -> dict:
    """drafter-train experiment=gpu_smoke on the in-memory target, as the recipe runs it."""
    import statistics

    import torch

    import drafter_train.recipes.train as recipe
    from drafter_train.recipes.cli import compose_config

    target_dir, data_dir = write_training_inputs(work, target.config, tokenizer, shape)
    cfg = compose_config("train", [
        "experiment=gpu_smoke", f"target.path={target_dir}", "target.chat_template=false",
        "target.cpu_kernels=default", f"train.data_dir={data_dir}", f"train.output_root={work / 'runs'}",
        f"drafter.draft_vocab_size={shape['draft_vocab']}", f"drafter.target_layers=[{','.join(map(str, layers))}]",
        f"train.max_seq_len={shape['seq_len']}", f"train.max_steps={shape['steps']}",
        f"train.save_every={shape['steps']}", "train.log_every=5", "train.eval_at_start=false", "eval.prompts=null",
        f"eval.num_prompts={shape['eval_prompts']}", f"eval.max_new_tokens={shape['eval_tokens']}"])
    assert (cfg.target.dtype, cfg.target.attn_implementation) == ("bfloat16", "sdpa"), "gpu_smoke changed"
    # The target of stage 3 stands in for loading the same config's weights from disk.
    original, recipe.load_target = recipe.load_target, lambda target_cfg: (target, tokenizer)
    if target.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target.device)
    watch = StepWatch(target.device)
    try:
        metrics = recipe.train(cfg)
    finally:
        recipe.load_target = original
        watch.handle.remove()
    steps = [b - a for a, b in zip(watch.times[1:], watch.times[2:])]  # from step 2: no first-step set-up
    run_dir = work / "runs" / cfg.train.run_name
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tokens_per_s = [row["train/tokens_per_s"] for row in logged if "train/tokens_per_s" in row]
    eval_keys = ("tau", "acceptance_rate", "speedup", "greedy_match", "greedy_mismatch_margins", "tokens_per_s",
                 "ar_tokens_per_s", "num_prompts", "out_of_draft_vocab")
    return {"steps": shape["steps"], "batch_size": cfg.train.batch_size, "seq_len": cfg.train.max_seq_len,
            "records": shape["records"], "draft_vocab": shape["draft_vocab"],
            "s_per_step": statistics.median(steps) if steps else None,
            "tokens_per_s_logged": tokens_per_s, "tokens_per_s": tokens_per_s[-1] if tokens_per_s else None,
            "peak_allocated_gib_first_step": watch.peaks[0] / 2 ** 30 if watch.peaks else None,
            # steps 2..N: training alone (step 1 also holds the feature extraction and the optimizer's first step)
            "peak_allocated_gib": max(watch.peaks[1:]) / 2 ** 30 if len(watch.peaks) > 1 else None,
            "evaluation": {k: metrics.get(k) for k in eval_keys}, "eval_keys": list(eval_keys),
            "run_dir": str(run_dir), "target_dir": str(target_dir), "data_dir": str(data_dir)}


def lossless_fp32(target, tokenizer, trained: dict, shape: dict) -> dict:
    """The same checkpoint evaluated again with the target cast to float32 (TF32 off): the decoder's exactness,
    apart from bf16 numerics. In bf16 a pass over k tokens and a pass over 1 token use different GEMM shapes, so
    their logits differ by a few bf16 steps and greedy outputs part at near-ties; in fp32 they must not."""
    import torch

    import drafter_train.recipes.evaluate as recipe
    from drafter_train.recipes.cli import compose_config

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    target.float()
    cfg = compose_config("eval", [
        f"target.path={trained['target_dir']}", "target.dtype=float32", "target.chat_template=false",
        "target.cpu_kernels=default", "drafter=path", f"drafter.path={trained['run_dir']}/best/drafter",
        f"eval.prompts={trained['data_dir']}/eval_prompts.jsonl", f"eval.num_prompts={shape['eval_prompts']}",
        f"eval.max_new_tokens={shape['eval_tokens']}", f"eval.output={trained['run_dir']}/eval_fp32.json"])
    original, recipe.load_target = recipe.load_target, lambda target_cfg: (target, tokenizer)
    try:
        metrics = recipe.run_eval_job(cfg)
    finally:
        recipe.load_target = original
    return {"dtype": "float32", "tf32": False, **{k: metrics.get(k) for k in trained["eval_keys"]}}


def plan(config, shape: dict, layers: list[int], batch_size: int, device) -> dict:
    """benchmarks.gpu_plan's DDP row for this run (1 GPU, its batch and length, its draft vocabulary), its
    activations measured as gpu_plan measures them but on this device (the CPU takes minutes at these widths)."""
    import torch

    from benchmarks.gpu_plan import GIB, at_length, eagle3_loss_activations, memory_plan, model_sizes

    sizes_ = model_sizes(config, shape["draft_vocab"], layers)
    per_sequence = at_length(lambda t: eagle3_loss_activations(config, shape["draft_vocab"], layers, t, device),
                             shape["plan_lengths"], shape["seq_len"])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row = memory_plan(sizes_, "ddp", 1, per_sequence * batch_size)
    return {"command": f"python -m benchmarks.gpu_plan --gpus 1 --draft-vocab-size {shape['draft_vocab']} "
                       f"--batch-size {batch_size} --seq-len {shape['seq_len']}",
            "activations_measured_on": device.type, "ddp_gib": {k: v / GIB for k, v in row.items()}}


# ----------------------------------------------------------------------------------------------------------------
# The run


REPO = Path(__file__).resolve().parent.parent


def parse_args(argv):
    from benchmarks.common import RESULTS_DIR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the device check) or cpu (the tiny path, here)")
    parser.add_argument("--tiny", action="store_true", help="tiny target and run: the same path in seconds")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="also copy gpu.json here (default $OUT)")
    parser.add_argument("--deadline", type=float, default=270.0, help="seconds for the whole run")
    parser.add_argument("--steps", type=int, help="training steps (default 30; tiny 4)")
    parser.add_argument("--tests", nargs="*", help="pytest arguments (default tests/test_devices.py; tiny: its "
                                                   "quickest test, which needs no model)")
    parser.add_argument("--skip", nargs="*", default=[], help="stages to leave out")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # Before any HF import: huggingface_hub reads HF_HUB_OFFLINE once, at import time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "1"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    deadline, device = time.monotonic() + args.deadline, torch.device(args.device)
    shape = sizes(args.tiny)
    if args.steps:
        shape["steps"] = args.steps
    record = Record(args.results_dir, args.out, argv, describe_gpu(device))
    record.add("machine", {"machine": record.machine, "tiny": args.tiny})
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    tests = args.tests if args.tests is not None else (
        ["tests/test_devices.py", "-k", "scan_finds"] if args.tiny else ["tests/test_devices.py"])
    if "tests" not in args.skip:
        run_stage(record, "tests", 120, deadline, lambda: device_tests(tests, max(10.0, min(
            115.0, deadline - time.monotonic() - 5)), work))

    config, tokenizer = target_config(args.tiny), word_tokenizer(shape["words"])
    layers = feature_layers(config.num_hidden_layers)
    held: dict = {}

    def make_target() -> dict:
        start = time.perf_counter()
        held["target"] = build_target(config, device)
        return {"parameters": sum(p.numel() for p in held["target"].parameters()), "dtype": "bfloat16",
                "attn_implementation": held["target"].config._attn_implementation,
                "build_s": time.perf_counter() - start, "config": {k: getattr(config, k) for k in (
                    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size")},
                "allocated_gib": torch.cuda.memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None}

    run_stage(record, "target", 90, deadline, make_target)
    if "target" not in held:
        return finish(record, work)
    target = held["target"]
    gen = torch.Generator().manual_seed(1)
    randoms = lambda n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()  # noqa: E731
    curve = run_stage(record, "verify_curve", 90, deadline, lambda: verify_curve(target, randoms(shape["prefix"]),
                                                                                 shape["repeats"]))
    drafter = None
    if "drafter" not in args.skip:
        drafter = run_stage(record, "drafter", 60, deadline, lambda: drafter_cost(
            target, layers, shape["draft_vocab"], [randoms(shape["decode_prompt"])], shape["decode_tokens"], [2]))
    if curve is not None:
        run_stage(record, "predictions", 10, deadline, lambda: predictions(curve, drafter))
    trained = None
    if "train" not in args.skip:
        trained = run_stage(record, "train", 200, deadline, lambda: train_smoke(target, tokenizer, work, shape,
                                                                               layers))
    if "plan" not in args.skip:
        run_stage(record, "plan", 90, deadline, lambda: plan(config, shape, layers, (trained or {}).get(
            "batch_size", 2), device))
    if trained is not None and "lossless" not in args.skip:  # last: it casts the target to float32 in place
        run_stage(record, "lossless_fp32", 60, deadline, lambda: lossless_fp32(target, tokenizer, trained, shape))
    return finish(record, work)


def finish(record: Record, work: Path) -> int:
    shutil.rmtree(work, ignore_errors=True)
    failed = [name for name, stage in record.stages.items() if "error" in stage]
    tests = record.stages.get("tests", {}).get("tests", {})
    failed += [name for name, test in tests.items() if test["outcome"] in ("failure", "error")]
    print(summary(record.stages), flush=True)
    print(f"gpu_check: {'failed: ' + ', '.join(failed) if failed else 'every stage ran'}", flush=True)
    return 1 if failed else 0


def summary(stages: dict) -> str:
    """The short table printed last (the device tool returns the output's end)."""
    lines = [f"{name}: " + (stage.get("error") or f"{stage.get('seconds', 0):.1f} s") for name, stage in stages.items()]
    curve = stages.get("verify_curve")
    if curve and "ours_ms" in curve:
        lines.append("n " + " ".join(f"{n:>7}" for n in SHOWN))
        for key in ("ours_ms", "bare_ms", "ours_relative"):
            lines.append(f"{key} " + " ".join(f"{curve[key][str(n)]:7.2f}" for n in SHOWN))
    train = stages.get("train")
    if train and "error" not in train:
        lines.append(f"train: {train['tokens_per_s']} tok/s, {train['s_per_step']} s/step, peak "
                     f"{train['peak_allocated_gib']} GiB; eval {train['evaluation']}")
    plan_ = stages.get("plan")
    if plan_ and "error" not in plan_:
        lines.append(f"plan ddp total {plan_['ddp_gib']['total']:.2f} GiB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
