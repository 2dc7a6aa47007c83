"""datagen.backend=hf: the target's continuations of a batch of prompts, one left-padded `model.generate` call per
batch, in this process (``HFBackend``; the vLLM backend, data/vllm_backend.py, stores the same columns).

What is stored per response token with ``store_topk = k > 0``: ``topk_ids[t]`` and ``topk_logits[t]`` are the k
largest entries (descending) of the target's RAW next-token logits at the step that produced response token t,
i.e. the LM head's output for the position just before token t (``generate(output_logits=True)``), in float32.
They are taken before temperature, top-k or top-p are applied, so a consumer can apply any temperature itself; with
greedy decoding ``topk_ids[t][0]`` is response token t. Cost: generate keeps every step's [B, V] logits until it
returns (batch_size * max_new_tokens * V * 4 bytes, ~400 MB for 16 x 128 steps x 49k vocab).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_train.config import DatagenConfig
from drafter_train.cpu_kernels import stock_kernels
from drafter_train.data.sources import TrainPrompt

# Logits processors that a target's own generation_config may switch on; datagen pins them off so the data is
# the target's plain greedy / sampled distribution (unset fields would otherwise come from generation_config.json).
_NEUTRAL = dict(num_beams=1, num_return_sequences=1, repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)


@dataclass
class Continuation:
    response_ids: list[int]  # ends with the EOS token if one was generated
    topk_ids: Optional[list[list[int]]] = None  # [T][k], see the module doc
    topk_logits: Optional[list[list[float]]] = None  # [T][k]


class HFBackend:
    """What drafter-datagen asks of a backend: `tokenizer`, `eos_token_ids`, `batch_size` (prompts per `generate`
    call; None = a whole shard), `generate(prompts) -> (continuations, seconds)`, `run_info()` (for datagen.json) and
    use as a context manager (a worker process lives inside it)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: DatagenConfig,
                 eos_token_ids: Sequence[int], pad_id: int):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.eos_token_ids, self.pad_id = list(eos_token_ids), pad_id
        self.batch_size: Optional[int] = cfg.batch_size

    def generate(self, prompts: Sequence[TrainPrompt]) -> tuple[list[Continuation], float]:
        start = time.perf_counter()
        outputs = generate_batch(self.model, [p.prompt_ids for p in prompts], self.cfg, self.eos_token_ids, self.pad_id)
        return outputs, time.perf_counter() - start

    def run_info(self) -> dict:
        return {"backend": "hf", "torch_threads": torch.get_num_threads()}

    def __enter__(self) -> "HFBackend":
        return self

    def __exit__(self, *exc) -> None:
        pass


class ReferenceBackend:
    """datagen.generate=false: the source's own answers are the records' responses, so nothing generates. The
    target's tokenizer and EOS ids (from its configs) are all the records need; its weights are never loaded."""

    batch_size: Optional[int] = None

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int]):
        self.tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)

    def generate(self, prompts: Sequence[TrainPrompt]) -> tuple[list[Continuation], float]:
        raise RuntimeError("datagen.generate=false: the reference backend generates nothing")

    def run_info(self) -> dict:
        return {"backend": "none (datagen.generate=false: the source's answers)"}

    def __enter__(self) -> "ReferenceBackend":
        return self

    def __exit__(self, *exc) -> None:
        pass


def generation_kwargs(cfg: DatagenConfig) -> dict:
    """`generate` settings: greedy at temperature 0, else sampling with temperature / top_k / top_p."""
    kwargs = dict(_NEUTRAL, max_new_tokens=cfg.max_new_tokens)
    if cfg.temperature == 0:
        return dict(kwargs, do_sample=False)
    # top_k=0 must be passed explicitly: left unset, generate would apply its default top_k=50.
    return dict(kwargs, do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, L], prompts right-aligned so every row's next token is at column L."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), mask.to(device)


@torch.inference_mode()
@stock_kernels()  # training data: the same bits whatever `auto` timed (cpu_kernels.py)
def generate_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    cfg: DatagenConfig,
    eos_token_ids: Sequence[int],
    pad_id: int,
) -> list[Continuation]:
    """Continue every prompt (one batched call); responses are cut after their first EOS, padding removed."""
    input_ids, mask = left_pad(prompts, pad_id, model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        eos_token_id=list(eos_token_ids),
        pad_token_id=pad_id,
        output_logits=cfg.store_topk > 0,
        return_dict_in_generate=True,
        **generation_kwargs(cfg),
    )
    new_tokens = out.sequences[:, input_ids.shape[1] :].tolist()  # [B, steps]
    responses = [cut_at_eos(row, set(eos_token_ids)) for row in new_tokens]
    if cfg.store_topk == 0:
        return [Continuation(r) for r in responses]
    topk_ids, topk_logits = _topk(out.logits, cfg.store_topk)
    return [
        Continuation(r, topk_ids[row, : len(r)].tolist(), topk_logits[row, : len(r)].tolist())
        for row, r in enumerate(responses)
    ]


def cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first EOS: after it, generate only writes padding."""
    for pos, token in enumerate(tokens):
        if token in eos:
            return tokens[: pos + 1]
    return tokens


def _topk(step_logits: Sequence[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step raw logits (tuple of [B, V]) -> ids int32 [B, steps, k] and logits float32 [B, steps, k]."""
    k = min(k, step_logits[0].shape[-1])
    # Top-k step by step: stacking the full [B, steps, V] logits first would double generate's peak memory.
    per_step = [torch.topk(logits.float(), k, dim=-1) for logits in step_logits]
    values = torch.stack([top.values for top in per_step], dim=1)
    ids = torch.stack([top.indices for top in per_step], dim=1)
    return ids.to(torch.int32), values
