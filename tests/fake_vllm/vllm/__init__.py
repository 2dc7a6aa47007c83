"""A stand-in for vLLM for tests that must run without it: the surface drafter-datagen's worker uses (`LLM`,
`SamplingParams`, `engine.arg_utils.EngineArgs`, `__version__`), generating with transformers one prompt at a time
(a full forward per token: tiny models only). Greedy picks the argmax; sampling draws from softmax(logits / T) cut
to top_k / top_p with the request's seed. Logprobs are vLLM's shape: per token a dict {id: Logprob} of the top k
plus the sampled token when it is outside them.

Test knobs (environment): FAKE_VLLM_RECORD=path appends the engine settings and every request as JSON lines;
FAKE_VLLM_CRASH_AT=n kills the process at its n-th generate call; FAKE_VLLM_FAIL_START=message makes LLM() raise;
FAKE_VLLM_OLD=1 drops `logprobs_mode` (engine/arg_utils.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
from transformers import AutoModelForCausalLM

from vllm.engine.arg_utils import EngineArgs

__version__ = "0.0.fake"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: list = field(default_factory=list)
    detokenize: bool = True
    logprobs: Optional[int] = None
    seed: Optional[int] = None

    def __post_init__(self):
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")


def _record(kind: str, value) -> None:
    if os.environ.get("FAKE_VLLM_RECORD"):
        with open(os.environ["FAKE_VLLM_RECORD"], "a") as out:
            out.write(json.dumps({kind: value, "pid": os.getpid()}) + "\n")


class LLM:
    def __init__(self, **kwargs):
        self.args = EngineArgs(**kwargs)  # an unknown setting raises TypeError, as vLLM's does
        _record("engine", kwargs)
        print("fake vLLM: a log line on stdout, as vLLM writes them", flush=True)
        if os.environ.get("FAKE_VLLM_FAIL_START"):
            raise ValueError(os.environ["FAKE_VLLM_FAIL_START"])
        torch.set_num_threads(1)  # tiny models: more threads only contend (30x slower on a busy 2-core machine)
        self.model = AutoModelForCausalLM.from_pretrained(self.args.model, dtype=torch.float32).eval()
        self.calls = 0

    def generate(self, prompts, params, use_tqdm=True):
        self.calls += 1
        if self.calls == int(os.environ.get("FAKE_VLLM_CRASH_AT", 0)):
            os._exit(1)
        params = params if isinstance(params, list) else [params] * len(prompts)
        _record("request", {"prompts": [p["prompt_token_ids"] for p in prompts],
                            "params": [dataclasses.asdict(p) for p in params]})
        return [self._one(prompt["prompt_token_ids"], p) for prompt, p in zip(prompts, params)]

    @torch.inference_mode()
    def _one(self, prompt: list, p: SamplingParams):
        if p.logprobs and p.logprobs > self.args.max_logprobs:
            raise ValueError(f"Requested sample logprobs of {p.logprobs}, which is greater than max allowed: "
                             f"{self.args.max_logprobs}")
        generator = torch.Generator().manual_seed(p.seed if p.seed is not None else self.args.seed)
        ids, tokens, logprobs, reason = list(prompt), [], [], "length"
        for _ in range(p.max_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax()) if p.temperature == 0 else _sample(logits, p, generator)
            if p.logprobs:
                top = logits.topk(p.logprobs).indices.tolist()
                logprobs.append({t: SimpleNamespace(logprob=float(logits[t]), rank=int((logits > logits[t]).sum()) + 1)
                                 for t in [token, *top]})
            ids.append(token)
            tokens.append(token)
            if token in p.stop_token_ids:
                reason = "stop"
                break
        completion = SimpleNamespace(token_ids=tokens, logprobs=logprobs or None, finish_reason=reason)
        return SimpleNamespace(outputs=[completion])


def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    scaled = logits / p.temperature
    if p.top_k > 0:
        scaled[scaled < scaled.topk(p.top_k).values[-1]] = float("-inf")
    probs = scaled.softmax(-1)
    ordered, order = probs.sort(descending=True)
    outside = ordered.cumsum(-1) - ordered >= p.top_p  # tokens after the nucleus is full
    probs[order[outside]] = 0
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
