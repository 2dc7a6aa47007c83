"""Plain autoregressive decoding with a KV cache: the reference for speedup and for losslessness."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import PreTrainedModel

from drafter_train.decoding.cached_lm import CachedLM, as_tensor
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.stats import DecodeStats


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens only (no prompt); ends with EOS if one was generated
    stats: DecodeStats


@torch.inference_mode()
def generate_autoregressive(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
    generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    """One target forward per token. Stops after an EOS token (kept) or `max_new_tokens` tokens."""
    lm = CachedLM(model)
    eos = set(eos_token_ids)
    logits = lm.forward(as_tensor(prompt_ids, lm.device), num_logits=1)[-1]
    tokens: list[int] = []
    while True:
        token, _ = choose_token(logits, params, generator)
        tokens.append(int(token))
        if tokens[-1] in eos or len(tokens) >= max_new_tokens:
            break
        logits = lm.forward(token.view(1), num_logits=1)[-1]
    stats = DecodeStats(tokens_generated=len(tokens), target_forward_passes=len(tokens))
    return DecodeResult(tokens=tokens, stats=stats)
