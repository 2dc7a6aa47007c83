"""datagen.backend=vllm: the target's continuations from a vLLM engine, run in a worker process.

One code path for every install: the engine always runs in a subprocess (vllm_worker.py, a standalone script that
imports only vLLM), started with the interpreter named by ``datagen.vllm_python``:

- unset: this interpreter, which is right when vLLM is installed next to drafter_train (GPU users:
  ``pip install drafter-train[vllm]``);
- the python of a separate environment, for when vLLM's pinned torch / transformers clash with drafter_train's (the
  CPU environment built by scripts/setup_vllm.sh).

This process keeps everything else (shards, resume, the eval split, the settings check, the progress bar). It
tokenises the prompts exactly as backend=hf does (chat template included), sends their token ids a shard at a time
and receives response ids (and top-k logits). vLLM batches the shard on its own: ``datagen.vllm.max_num_seqs`` caps
the prompts in flight; ``datagen.batch_size`` is not used.

What matches backend=hf:

- greedy at temperature 0; otherwise sampling at ``temperature`` with ``top_k`` (0 = off) and ``top_p``, applied to
  the temperature-scaled logits as transformers does, and nothing else (no repetition penalty, min_p ...);
- a response stops after the first of the same EOS ids (kept) or after ``max_new_tokens`` tokens;
- ``store_topk``: the k largest RAW logits per response token, before temperature / top-k / top-p (vLLM's
  ``logprobs_mode="raw_logits"``): what backend=hf stores from generate's ``output_logits`` (generation.py).

What does not: float kernels differ, so greedy outputs can part where the target's top two logits nearly tie
(measured in docs/benchmarks.md). Sampled outputs follow the same distribution but another random stream: each prompt
gets its own seed from ``datagen.seed`` and its index, so a resumed run redraws what an uninterrupted run would
have, to the extent that vLLM's numerics do not depend on how requests are batched (exact only with vLLM's
``VLLM_BATCH_INVARIANT=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

from transformers import AutoConfig, GenerationConfig

from drafter_train.config import DatagenConfig, DatagenJobConfig, TargetConfig
from drafter_train.data.generation import Continuation, cut_at_eos
from drafter_train.data.sources import TrainPrompt
from drafter_train.errors import ConfigError, DrafterTrainError
from drafter_train.targets import eos_token_ids
from drafter_train.targets import EMBEDDED_PREFIX, embedded_folder, load_tokenizer

WORKER = Path(__file__).with_name("vllm_worker.py")
LOG_NAME = "vllm-worker.log"  # the worker's stderr (vLLM's own log), in datagen.output_dir
VLLM_DEFAULT_MAX_LOGPROBS = 20


class BackendError(DrafterTrainError, RuntimeError):
    """The vLLM worker failed; the message says why in one line and where its full log is."""


def engine_args(cfg: DatagenJobConfig, model: str) -> dict:
    """`vllm.LLM` keyword arguments: the target, its dtype, the context the data needs, datagen.vllm.*."""
    dg, settings = cfg.datagen, cfg.datagen.vllm
    args = dict(
        model=model,
        dtype=cfg.target.dtype,
        seed=dg.seed,
        max_model_len=settings.max_model_len or dg.max_prompt_tokens + dg.max_new_tokens,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=settings.enforce_eager,
        # Token ids go in and out: the engine needs no tokenizer (EOS ids come with every request).
        skip_tokenizer_init=True,
    )
    for name in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"):
        if getattr(settings, name) is not None:
            args[name] = getattr(settings, name)
    if dg.store_topk:
        # Raw logits before temperature / top-k / top-p, as backend=hf stores; vLLM caps logprobs per token at
        # max_logprobs (20 unless raised).
        args.update(logprobs_mode="raw_logits", max_logprobs=max(dg.store_topk, VLLM_DEFAULT_MAX_LOGPROBS))
    for key in sorted(set(settings.engine_args) & set(args)):
        raise ConfigError(
            f"datagen.vllm.engine_args.{key}: drafter-datagen sets {key}={args[key]!r} itself "
            "(from target.*, datagen.* and datagen.vllm.*); remove it from engine_args"
        )
    return {**args, **settings.engine_args}


def sampling_params(dg: DatagenConfig, eos: Sequence[int]) -> dict:
    """`vllm.SamplingParams` fields for backend=hf's generation (generation.generation_kwargs); vLLM's defaults are
    neutral (no penalties, min_p 0, min_tokens 0), as generation.py pins transformers' to be."""
    params = dict(max_tokens=dg.max_new_tokens, stop_token_ids=list(eos), detokenize=False, temperature=0.0)
    if dg.temperature > 0:
        # "top_k off" is 0 in transformers and -1 in vLLM (newer vLLM also takes 0).
        params.update(temperature=dg.temperature, top_k=dg.top_k or -1, top_p=dg.top_p)
    if dg.store_topk:
        params["logprobs"] = dg.store_topk
    return params


def prompt_seed(seed: int, index: int, sample: int = 0) -> int:
    """The sampling seed of training prompt ``index`` (its answer ``sample`` of datagen.samples_per_prompt; the
    first keeps the seed folders made before the option have): independent of its shard, batch and other prompts."""
    key = f"{seed}:{index}" + (f":{sample}" if sample else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def to_continuation(output: dict, eos: set[int], store_topk: int) -> Continuation:
    """One worker answer -> the columns backend=hf writes."""
    response = cut_at_eos(output["token_ids"], eos)  # vLLM already stops at EOS (and keeps it)
    if not store_topk:
        return Continuation(response)
    ids, logits = output["topk_ids"][: len(response)], output["topk_logits"][: len(response)]
    if len(ids) != len(response) or any(len(row) != store_topk for row in ids):
        raise BackendError(f"datagen.store_topk: vLLM returned logprobs for {len(ids)}/{len(response)} tokens, "
                           f"not {store_topk} per token")
    return Continuation(response, ids, logits)


class VllmBackend:
    """The backend interface of generation.HFBackend, served by a vLLM worker process."""

    batch_size: Optional[int] = None  # a whole shard per request: vLLM forms its own batches

    def __init__(self, cfg: DatagenJobConfig):
        self.cfg, dg = cfg, cfg.datagen
        self.python = dg.vllm_python or sys.executable
        self.version = _installed_vllm(self.python)  # fails here, before anything is loaded, without vLLM
        model = _model_folder(cfg.target)
        self.engine = engine_args(cfg, model)
        self.tokenizer = load_tokenizer(model)
        self.eos_token_ids = eos_token_ids(_configs(model), self.tokenizer)
        self.sampling = sampling_params(dg, self.eos_token_ids)
        self.log_path = Path(dg.output_dir).expanduser() / LOG_NAME
        self.process: Optional[subprocess.Popen] = None

    def run_info(self) -> dict:
        return {"backend": "vllm", "vllm": {"version": self.version, "python": self.python, "engine": self.engine}}

    def generate(self, prompts: Sequence[TrainPrompt]) -> tuple[list[Continuation], float]:
        """Continuations in prompt order, and the seconds the worker's generate call took (engine start excluded)."""
        if self.process is None:
            self._start()
        dg = self.cfg.datagen
        seeds = [prompt_seed(dg.seed, p.index, p.sample) for p in prompts] if dg.temperature > 0 else None
        self._send({"prompts": [p.prompt_ids for p in prompts], "sampling": self.sampling, "seeds": seeds})
        answer = self._receive("while generating")
        eos = set(self.eos_token_ids)
        return [to_continuation(out, eos, dg.store_topk) for out in answer["outputs"]], answer["seconds"]

    def __enter__(self) -> "VllmBackend":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # End of requests: the worker shuts its engine down and exits. On an error (or Ctrl-C) it is stopped.
        if self.process is not None and exc_type is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        self._stop_group()

    # ------------------------------------------------------------------------------------------------------------

    def _start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as log:
            # Its own session: the worker and vLLM's engine processes form one group, stopped together.
            self.process = subprocess.Popen(
                [self.python, str(WORKER), json.dumps(self.engine)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
            )
        self._receive("while starting")

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: _receive reports how it ended

    def _receive(self, when: str) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise BackendError(f"the vLLM worker ({self.python}) exited with code {code} {when}: "
                               f"{_last_line(self.log_path)} (full log: {self.log_path})")
        answer = json.loads(line)
        if "error" in answer:
            self._stop_group()
            error = ConfigError if answer["error"].startswith("datagen.") else BackendError
            raise error(f"{answer['error']} (full log: {self.log_path})")
        return answer

    def _stop_group(self) -> None:
        """Stop what is left of the worker's process group (engine processes a killed worker may leave)."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()
            except BrokenPipeError:
                pass


def _installed_vllm(python: str) -> str:
    """vLLM's version in the environment of ``python`` (package metadata: a second, not an engine start)."""
    try:
        done = subprocess.run([python, str(WORKER), "--version"], capture_output=True, text=True, timeout=120)
    except OSError as err:
        raise ConfigError(f"datagen.vllm_python: cannot run {python}: {err.strerror or err}") from None
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise ConfigError(f"datagen.vllm_python: {python} could not run the vLLM worker: "
                          f"{_last_of(done.stderr)}") from None
    if "error" in answer:
        raise ConfigError(
            f"datagen.vllm_python: {answer['error']}; install it (pip install drafter-train[vllm]) or name a python "
            "that has it (scripts/setup_vllm.sh builds one)"
        )
    return answer["vllm"]


def _model_folder(target: TargetConfig) -> str:
    """What vLLM loads: a HF folder (the embedded target's dequantised one) or a hub id; not a GGUF file."""
    if target.path.startswith(EMBEDDED_PREFIX):
        return str(embedded_folder(target.path, target.cache_dir))
    if target.gguf_file or target.path.endswith(".gguf"):
        raise ConfigError("target.path: datagen.backend=vllm loads HF model folders or hub ids, not GGUF files; "
                          "use datagen.backend=hf or a dequantised folder")
    local = Path(target.path).expanduser()
    return str(local.resolve()) if local.exists() else target.path


def _configs(model: str) -> SimpleNamespace:
    """The model's config and generation config (where EOS ids are declared), without loading weights."""
    try:
        generation = GenerationConfig.from_pretrained(model)
    except OSError:  # no generation_config.json
        generation = None
    return SimpleNamespace(config=AutoConfig.from_pretrained(model), generation_config=generation)


def _last_line(path: Path) -> str:
    try:
        return _last_of(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return "no log"


def _last_of(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"

