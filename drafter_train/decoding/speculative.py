"""Draft-then-verify decoding (Leviathan et al. 2023; Chen et al. 2023) with KV caches on both models.

Invariant between steps: `seq` = prompt + generated tokens; the target's cache holds seq[:-1] (the last token is fed
with the next drafts), the drafter's cache holds some prefix of seq. One step:

    drafts d_1..d_k  <- drafter.propose(seq)                     (k AR forwards, or one NAR pass)
    logits [k+1, V]  <- target(seq[-1], d_1..d_k)                (ONE target pass)
    n, t             <- verify(drafts, logits)                    (keep d_1..d_n, then t = correction or bonus)
    seq              <- seq + d_1..d_n + t;  crop both caches to the valid prefix (no prefix recomputation)

A self-speculative drafter (layerskip) drafts on the target's own cache (`share_target`) and cuts it back to seq[:-1]
before returning. Drafters that read the target's hidden states (EAGLE-3) get the features of every position a
target pass verified and kept from that same pass (features.py's tap): no extra target forward.

`generate_tree_speculative` verifies a draft TREE per step (decoding/tree.py), still in ONE target pass:

    tree (N nodes)   <- build_tree(drafter, seq)                  (EAGLE-2 topk tree, or i.i.d. sampled sequences;
                                                                   prompt lookup's chain first where it matches)
    logits [N+1, V]  <- target(seq[-1], tree; ancestor mask, positions = prefix length + depth)
    path, t          <- verify(tree, logits)                      (the accepted root-to-node path, then t)
    seq              <- seq + tokens[path] + t;  both caches keep prefix + root + path (its rows moved down)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional, Sequence

import torch
from transformers import PreTrainedModel

from drafter_train.decoding.autoregressive import DecodeResult
from drafter_train.decoding.cached_lm import CachedLM, as_tensor
from drafter_train.decoding.draft_exit import DraftExit
from drafter_train.decoding.drafter import Drafter, Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.stats import DecodeStats
from drafter_train.decoding.tree import DraftTree, TreeSpec, build_tree, lookup_tree, verify_inputs
from drafter_train.decoding.verify import TreeVerifier, Verifier
from drafter_train.devices import synchronize
from drafter_train.features import tap_for
from drafter_train.targets import check_full_cache


def _clock(device: torch.device) -> float:
    """Wall-clock seconds, after the device's queued work (GPU kernels run asynchronously)."""
    synchronize(device)
    return time.perf_counter()


def _kept(features: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    """The first n positions of the last target pass's features [1, T, F] -> [n, F] (None: no tap)."""
    return None if features is None else features[0, :n]


def _stop_index(new_tokens: list[int], eos: set[int]) -> Optional[int]:
    """Length to keep if an EOS is among `new_tokens` (EOS included), else None."""
    for i, token in enumerate(new_tokens):
        if token in eos:
            return i + 1
    return None


def _start(drafter: Drafter, lm: CachedLM) -> None:
    """A new sequence: the drafter forgets the last one, and a drafter that drafts on the target's own KV cache
    (layer skipping) is handed it; such a drafter leaves the cache holding seq[:-1] whenever it returns."""
    drafter.reset()
    if hasattr(drafter, "share_target"):
        drafter.share_target(lm)


@contextmanager
def _own_exit_threshold(drafter: Drafter, draft_exit: Optional[DraftExit]):
    """Draft exit sets the run's γ on the drafter step by step; afterwards the drafter's own γ is back, so a drafter
    reused in a run without draft exit does not keep the last run's (a searched layerskip folder keeps its own)."""
    own = getattr(drafter, "exit_below", None) if draft_exit is not None else None
    try:
        yield
    finally:
        if own is not None:
            drafter.exit_below = own


def _prefill(lm: CachedLM, drafter: Drafter, tap, prompt_ids, params: SamplingParams,
             generator: Optional[torch.Generator]) -> tuple[torch.Tensor, list[int]]:
    """The target's pass over the prompt yields the first token, as in the AR baseline: (seq, generated tokens)."""
    prompt = as_tensor(prompt_ids, lm.device)
    first, _ = choose_token(lm.forward(prompt, 1)[-1], params, generator)
    drafter.commit(prompt.numel(), _kept(tap.features, prompt.numel()))
    return torch.cat([prompt, first.view(1)]), [int(first)]


@torch.inference_mode()
def generate_speculative(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    draft_len: int,
    verifier: Verifier,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
    generator: Optional[torch.Generator] = None,
    draft_exit: Optional[DraftExit] = None,
) -> DecodeResult:
    """Speculative decoding of one sequence. EOS / max_new_tokens behave exactly as in `generate_autoregressive`.
    `draft_exit`: stop each proposal at the drafter's first unsure draft (draft_exit.py; AR drafters)."""
    if draft_len < 1:
        raise ValueError(f"draft_len must be >= 1, got {draft_len}")
    lm, eos = CachedLM(target), set(eos_token_ids)
    stats = DecodeStats(draft_len=draft_len)
    _start(drafter, lm)
    with tap_for(target, drafter.feature_layers) as tap, _own_exit_threshold(drafter, draft_exit):
        seq, tokens = _prefill(lm, drafter, tap, prompt_ids, params, generator)
        stats.target_forward_passes = 1
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            # A step yields at most k+1 tokens: never draft past max_new_tokens (k == 0 is a plain target step).
            k = min(draft_len, max_new_tokens - len(tokens) - 1)
            if draft_exit is not None:
                drafter.exit_below = draft_exit.threshold
            began = _clock(lm.device)
            proposal = drafter.propose(seq, k, params, generator) if k else Proposal(seq.new_empty(0))
            drafted = _clock(lm.device)
            stats.drafter_call_seconds += drafted - began  # proposals and declined calls (draft exit) alike
            k = proposal.draft_len  # a drafter may propose fewer (prompt lookup without a match: none)
            logits = lm.forward(torch.cat([seq[-1:], proposal.tokens]), num_logits=k + 1)  # [k+1, V]
            num_accepted, next_token = verifier(proposal, logits, generator)
            stats.target_forward_passes += 1
            if k:
                if draft_exit is not None and not proposal.from_lookup:
                    draft_exit.update(k, num_accepted)
                stats.record_step(k, num_accepted)
                stats.proposals += 1
                if proposal.from_lookup:
                    stats.lookup_proposals += 1
                    stats.lookup_accepted += num_accepted
                stats.draft_seconds += drafted - began
                stats.verify_seconds += _clock(lm.device) - drafted
            lm.crop(seq.numel() + num_accepted)  # keep seq + accepted drafts; next_token is fed next step
            # verified and kept: seq[-1] and the accepted drafts
            drafter.commit(seq.numel() + num_accepted, _kept(tap.features, num_accepted + 1))
            new = torch.cat([proposal.tokens[:num_accepted], next_token.view(1)])
            seq = torch.cat([seq, new])
            new_list = new.tolist()
            stop = _stop_index(new_list, eos)
            tokens.extend(new_list[:stop])
    stats.tokens_generated = len(tokens)
    return DecodeResult(tokens=tokens, stats=stats)


def lookup_len(drafter: Drafter, spec: TreeSpec) -> int:
    """The longest chain prompt lookup in front of `drafter` proposes instead of its trees (eval.lookup): as many
    drafts as the tree's nodes, so that a lookup step's verify pass is no larger than a tree step's; 0: no lookup."""
    return spec.nodes() if hasattr(drafter, "lookup_chain") else 0


def tree_stats(spec: TreeSpec, lookup: int = 0) -> DecodeStats:
    """Empty counters for trees of `spec` and lookup chains of up to `lookup` drafts (accepted_within only for topk
    trees, whose first n nodes are a tree, as a chain's first n drafts are)."""
    return DecodeStats(draft_len=max(spec.depth, lookup), max_nodes=spec.nodes() if spec.branching == "topk" else 0)


def _tested_depth(tree: DraftTree, path: list[int]) -> int:
    """How deep verification looked: one below the path's end, unless that end has no children."""
    end = path[-1] + 1 if path else 0
    return len(path) + (1 if tree.children[end] else 0)


@torch.inference_mode()
def generate_tree_speculative(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    spec: TreeSpec,
    verifier: TreeVerifier,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
    generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    """Speculative decoding of one sequence with a draft tree per target pass (see the module doc)."""
    check_full_cache(target, "draft trees")  # a tree's own 4-D mask would override a sliding layer's window
    lm, eos = CachedLM(target), set(eos_token_ids)
    chain_len = lookup_len(drafter, spec)
    stats = tree_stats(spec, chain_len)
    _start(drafter, lm)
    with tap_for(target, drafter.feature_layers) as tap:
        seq, tokens = _prefill(lm, drafter, tap, prompt_ids, params, generator)
        stats.target_forward_passes = 1
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            # never draft past max_new_tokens: the tree is at most as deep as the tokens left - 1 (0: a plain step)
            left = max_new_tokens - len(tokens) - 1
            depth = min(spec.depth, left)
            began = _clock(lm.device)
            tree = lookup_tree(drafter, seq, min(chain_len, left))  # eval.lookup: its chain where it matches
            if tree is None:
                tree = build_tree(drafter, seq, replace(spec, depth=depth), params, generator) if depth else \
                    DraftTree(seq.new_empty(0), seq.new_empty(0))
            drafted = _clock(lm.device)
            stats.drafter_call_seconds += drafted - began
            past = seq.numel() - 1  # the target's cache holds seq[:-1]
            inputs, mask, positions = verify_inputs(tree, seq[-1], past, target.dtype)
            logits = lm.forward_tree(inputs, mask, positions)  # [N+1, V]
            path, next_token = verifier(tree, logits, generator)
            rows = tree.path_rows(path)  # verified and kept: the root (seq[-1]) and the accepted nodes
            lm.keep(torch.cat([torch.arange(past, device=lm.device), past + torch.tensor(rows, device=lm.device)]))
            stats.target_forward_passes += 1
            if tree.num_nodes:  # a drafter may propose nothing (prompt lookup without a match): a plain step
                stats.record_step(tree.num_nodes, len(path), _tested_depth(tree, path), path)
                stats.proposals += 1
                if tree.from_lookup:
                    stats.lookup_proposals += 1
                    stats.lookup_accepted += len(path)
                stats.draft_seconds += drafted - began
                stats.verify_seconds += _clock(lm.device) - drafted
            features = None if tap.features is None else tap.features[0, rows]
            drafter.commit(seq.numel() + len(path), features,
                           None if tree.pool_ids is None else tree.pool_ids[path].tolist())
            new = torch.cat([tree.tokens[path], next_token.view(1)])
            seq = torch.cat([seq, new])
            new_list = new.tolist()
            tokens.extend(new_list[:_stop_index(new_list, eos)])
    stats.tokens_generated = len(tokens)
    return DecodeResult(tokens=tokens, stats=stats)
