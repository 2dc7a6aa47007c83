"""The engine settings the fake vLLM knows (FAKE_VLLM_OLD=1: a vLLM from before `logprobs_mode`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

_FIELDS = [
    ("model", str, ""), ("dtype", str, "auto"), ("seed", int, 0), ("max_model_len", Optional[int], None),
    ("tensor_parallel_size", int, 1), ("enforce_eager", bool, False), ("skip_tokenizer_init", bool, False),
    ("max_num_seqs", Optional[int], None), ("max_num_batched_tokens", Optional[int], None),
    ("gpu_memory_utilization", float, 0.9), ("max_logprobs", int, 20), ("logprobs_mode", str, "raw_logprobs"),
]
if os.environ.get("FAKE_VLLM_OLD"):
    _FIELDS = [f for f in _FIELDS if f[0] != "logprobs_mode"]

EngineArgs = dataclasses.make_dataclass("EngineArgs", [(n, t, dataclasses.field(default=d)) for n, t, d in _FIELDS])
