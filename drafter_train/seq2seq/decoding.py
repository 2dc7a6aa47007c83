"""Plain and speculative decoding of one seq2seq request, and the headline numbers over many.

Both decoders are decoding/'s own (`generate_autoregressive`, `generate_speculative`: the same verify rules, the same
counters) run on the target's decoder bound to the request's encoder output (target.py):

    encoder_outputs <- target's encoder(source)                   (once per request, in both decoders)
    drafter         <- drafter.for_source(source, encoder_outputs) (its own encoder pass unless it shares the target's)
    tokens          <- generate_speculative(BoundSeq2Seq(target), drafter, [decoder start], ...)

Draft trees (`generate_seq2seq_tree_speculative`, `evaluate_seq2seq(tree=...)`) run decoding/'s tree loop the same
way, one target pass per tree, where the target's decoder takes tree positions (target.py `check_trees`; refused in
one line before decoding otherwise).

The timed request includes every encoder pass, so speedup compares whole requests; the drafter's own encoder pass is
also added to its drafting seconds (drafter_ms_per_step), where a drafter's cost is read.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
from transformers import PreTrainedModel

from drafter_train.cpu_kernels import apply_kernel_state
from drafter_train.decoding.autoregressive import DecodeResult, generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative, tree_stats
from drafter_train.decoding.tree import TreeSpec
from drafter_train.decoding.stats import DecodeStats
from drafter_train.decoding.verify import TreeVerifier, Verifier, make_tree_verifier, make_verifier
from drafter_train.evaluation import Tally, baseline_fields, baseline_states, time_interleaved
from drafter_train.seq2seq.drafters import Seq2SeqDrafter
from drafter_train.seq2seq.target import BoundSeq2Seq, Source, bind, decoder_prompt, encode, eos_ids


@torch.inference_mode()
def generate_seq2seq_autoregressive(target: PreTrainedModel, source: Source, max_new_tokens: int,
                                    params: SamplingParams = SamplingParams(),
                                    generator: Optional[torch.Generator] = None) -> DecodeResult:
    """Plain decoding of one request: one encoder pass, then one decoder pass per token. Stops after EOS (kept)."""
    return generate_autoregressive(bind(target, source), decoder_prompt(target, source), max_new_tokens, params,
                                   eos_ids(target), generator)


def _speculate(loop, target: PreTrainedModel, drafter: Seq2SeqDrafter, source: Source, shape, verifier,
               max_new_tokens: int, params: SamplingParams, generator: Optional[torch.Generator]) -> DecodeResult:
    """One request through decoding/'s speculative `loop` (chains: shape = draft_len; trees: a TreeSpec) on the
    bound decoder (module doc)."""
    encoding = encode(target, source)
    began = time.perf_counter()
    session = drafter.for_source(source, encoding)
    drafter_encode = time.perf_counter() - began
    result = loop(BoundSeq2Seq(target, encoding, source.attention_mask), session, decoder_prompt(target, source),
                  shape, verifier, max_new_tokens, params, eos_ids(target), generator)
    result.stats.draft_seconds += drafter_encode
    result.stats.drafter_call_seconds += drafter_encode
    return result


@torch.inference_mode()
def generate_seq2seq_speculative(target: PreTrainedModel, drafter: Seq2SeqDrafter, source: Source, draft_len: int,
                                 verifier: Verifier, max_new_tokens: int, params: SamplingParams = SamplingParams(),
                                 generator: Optional[torch.Generator] = None) -> DecodeResult:
    """Speculative decoding of one request (module doc); EOS and max_new_tokens as in plain decoding."""
    return _speculate(generate_speculative, target, drafter, source, draft_len, verifier, max_new_tokens, params,
                      generator)


@torch.inference_mode()
def generate_seq2seq_tree_speculative(target: PreTrainedModel, drafter: Seq2SeqDrafter, source: Source,
                                      spec: TreeSpec, verifier: TreeVerifier, max_new_tokens: int,
                                      params: SamplingParams = SamplingParams(),
                                      generator: Optional[torch.Generator] = None) -> DecodeResult:
    """Speculative decoding of one request with a draft tree per target pass (decoding/'s tree loop); a target or
    drafter that cannot take the tree is refused in one line first."""
    drafter.check_tree(spec, target)
    return _speculate(generate_tree_speculative, target, drafter, source, spec, verifier, max_new_tokens, params,
                      generator)


def evaluate_seq2seq(target: PreTrainedModel, drafter: Seq2SeqDrafter, sources: Sequence[Source], draft_len: int,
                     max_new_tokens: int, verify: str = "greedy", params: SamplingParams = SamplingParams(),
                     seed: int = 0, baseline_kernels: str = "all", kernels: Optional[str] = None,
                     warmup: int = 1, tree: Optional[TreeSpec] = None) -> dict:
    """Plain and speculative decoding of every request side by side, with the same seed per request, timed as
    evaluation.evaluate_decoding times them (its own functions): plain decoding on every CPU kernel setting
    (`baseline_kernels`: all | same, as eval.baseline_kernels), the speculative run on the target's own (`kernels`,
    None: read off the target), interleaved request by request, after `warmup` untimed runs of each. Returns
    DecodeStats' tau, acceptance and per-position acceptance, evaluate_decoding's speed fields (speedup over the
    fastest plain decoding, speedup_same_kernels, baseline: which setting was the divisor and every setting timed),
    and the share of requests whose outputs are token-identical to plain decoding on the same kernels (1.0 under
    greedy). `tree`: a draft tree per target pass instead of a chain of draft_len (refused first where the target
    or drafter cannot take it)."""
    if tree is not None:
        drafter.check_tree(tree, target)
    verifier = make_verifier(verify, params) if tree is None else make_tree_verifier(verify, params)
    kernels, states = baseline_states(target, baseline_kernels, kernels)
    settings = tuple(states)

    def ready_ar(source: Source, i: int, setting: str):
        apply_kernel_state(target, states[setting])
        gen = torch.Generator().manual_seed(seed + i)
        return lambda: generate_seq2seq_autoregressive(target, source, max_new_tokens, params, gen)

    def ready_spec(source: Source, i: int):
        apply_kernel_state(target, states[kernels])
        gen = torch.Generator().manual_seed(seed + i)
        if tree is not None:
            return lambda: generate_seq2seq_tree_speculative(target, drafter, source, tree, verifier, max_new_tokens,
                                                             params, gen)
        return lambda: generate_seq2seq_speculative(target, drafter, source, draft_len, verifier, max_new_tokens,
                                                    params, gen)

    total, matches = Tally(DecodeStats(draft_len=draft_len) if tree is None else tree_stats(tree)), 0
    try:
        for _ in range(warmup):
            for setting in settings:
                ready_ar(sources[0], 0, setting)()
            ready_spec(sources[0], 0)()
        for i, source in enumerate(sources):
            spec, ar = time_interleaved(i, settings, lambda: ready_spec(source, i),
                                        lambda k: ready_ar(source, i, k), target.device)
            total.add(spec, ar)
            matches += spec[0].tokens == ar[kernels][0].tokens
    finally:
        apply_kernel_state(target, states[kernels])
    return {**total.spec.summary(), "draft_len": draft_len if tree is None else tree.depth, "verify": verify,
            "tree": None if tree is None else tree.describe(), "num_requests": len(sources),
            **baseline_fields(total, kernels, settings),
            "greedy_match": matches / len(sources) if params.greedy else None,
            "encoder_shared": drafter.shares_encoder}
