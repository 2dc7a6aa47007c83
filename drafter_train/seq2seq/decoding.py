"""Plain and speculative decoding of one seq2seq request, and the headline numbers over many.

Both decoders are decoding/'s own (`generate_autoregressive`, `generate_speculative`: the same verify rules, the same
counters) run on the target's decoder bound to the request's encoder output (target.py):

    encoder_outputs <- target's encoder(source)                   (once per request, in both decoders)
    drafter         <- drafter.for_source(source, encoder_outputs) (its own encoder pass unless it shares the target's)
    tokens          <- generate_speculative(BoundSeq2Seq(target), drafter, [decoder start], ...)

The timed request includes every encoder pass, so speedup compares whole requests; the drafter's own encoder pass is
also added to its drafting seconds (drafter_ms_per_step), where a drafter's cost is read.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
from transformers import PreTrainedModel

from drafter_train.decoding.autoregressive import DecodeResult, generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.stats import DecodeStats
from drafter_train.decoding.verify import Verifier, make_verifier
from drafter_train.seq2seq.drafters import Seq2SeqDrafter
from drafter_train.seq2seq.target import BoundSeq2Seq, Source, bind, decoder_prompt, encode, eos_ids


@torch.inference_mode()
def generate_seq2seq_autoregressive(target: PreTrainedModel, source: Source, max_new_tokens: int,
                                    params: SamplingParams = SamplingParams(),
                                    generator: Optional[torch.Generator] = None) -> DecodeResult:
    """Plain decoding of one request: one encoder pass, then one decoder pass per token. Stops after EOS (kept)."""
    return generate_autoregressive(bind(target, source), decoder_prompt(target, source), max_new_tokens, params,
                                   eos_ids(target), generator)


@torch.inference_mode()
def generate_seq2seq_speculative(target: PreTrainedModel, drafter: Seq2SeqDrafter, source: Source, draft_len: int,
                                 verifier: Verifier, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                                 generator: Optional[torch.Generator] = None) -> DecodeResult:
    """Speculative decoding of one request (module doc); EOS and max_new_tokens as in plain decoding."""
    encoding = encode(target, source)
    began = time.perf_counter()
    session = drafter.for_source(source, encoding)
    drafter_encode = time.perf_counter() - began
    result = generate_speculative(BoundSeq2Seq(target, encoding, source.attention_mask), session,
                                  decoder_prompt(target, source), draft_len, verifier, max_new_tokens, params,
                                  eos_ids(target), generator)
    result.stats.draft_seconds += drafter_encode
    result.stats.drafter_call_seconds += drafter_encode
    return result


def _timed(fn) -> tuple[DecodeResult, float]:
    began = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - began


def evaluate_seq2seq(target: PreTrainedModel, drafter: Seq2SeqDrafter, sources: Sequence[Source], draft_len: int,
                     max_new_tokens: int, verify: str = "greedy", params: SamplingParams = SamplingParams(),
                     seed: int = 0) -> dict:
    """Plain and speculative decoding of every request side by side, interleaved (which goes first alternates), with
    the same seed per request: DecodeStats' tau, acceptance and per-position acceptance, the speedup over plain
    decoding in this same run, and the share of requests whose outputs are token-identical (1.0 under greedy)."""
    verifier, spec, plain = make_verifier(verify, params), DecodeStats(draft_len=draft_len), DecodeStats()
    times, matches = {"spec": 0.0, "plain": 0.0}, 0
    for i, source in enumerate(sources):
        runs = {
            "spec": lambda: generate_seq2seq_speculative(target, drafter, source, draft_len, verifier, max_new_tokens,
                                                         params, torch.Generator().manual_seed(seed + i)),
            "plain": lambda: generate_seq2seq_autoregressive(target, source, max_new_tokens, params,
                                                             torch.Generator().manual_seed(seed + i)),
        }
        done = {name: _timed(runs[name]) for name in (("spec", "plain") if i % 2 else ("plain", "spec"))}
        for name, stats in (("spec", spec), ("plain", plain)):
            stats.merge(done[name][0].stats)
            times[name] += done[name][1]
        matches += done["spec"][0].tokens == done["plain"][0].tokens
    spec_tps, plain_tps = spec.tokens_generated / times["spec"], plain.tokens_generated / times["plain"]
    return {**spec.summary(), "draft_len": draft_len, "verify": verify, "num_requests": len(sources),
            "spec_tokens_per_s": spec_tps, "ar_tokens_per_s": plain_tps, "speedup": spec_tps / plain_tps,
            "greedy_match": matches / len(sources) if params.greedy else None,
            "encoder_shared": drafter.shares_encoder}
