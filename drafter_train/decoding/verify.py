"""Verification rules: given k drafts and the target's logits at the k+1 positions they cover, decide how many
drafts to keep and which token the target contributes (the correction at the first rejection, or the bonus token
when all k are accepted). Each returns (num_accepted, next_token).

Tree rules (decoding/tree.py) take a DraftTree and the target's logits [N + 1, V] of its root and nodes, walk down
from the root and return (accepted path: node indices, root side first; next_token).

Symbols: p_target = target's processed distribution, q_draft = drafter's processed distribution.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams, logits_to_probs, sample
from drafter_train.decoding.tree import DraftTree

Verifier = Callable[[Proposal, Tensor, Optional[torch.Generator]], tuple[int, Tensor]]
TreeVerifier = Callable[[DraftTree, Tensor, Optional[torch.Generator]], tuple[list[int], Tensor]]


def _num_leading_true(ok: Tensor) -> int:
    """ok: [k] bool -> length of the all-True prefix."""
    return int(ok.long().cumprod(0).sum())


def verify_greedy(proposal: Proposal, target_logits: Tensor, generator=None) -> tuple[int, Tensor]:
    """Keep drafts while they equal the target's argmax. target_logits: [k+1, V]."""
    k = proposal.draft_len
    best = target_logits.argmax(-1)  # [k+1] target's greedy choice after each prefix
    n = _num_leading_true(proposal.tokens == best[:k])
    return n, best[n]  # best[n]: correction at the first mismatch, or the bonus token when n == k


def make_sample_verifier(params: SamplingParams) -> Verifier:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2): lossless for any p_target."""

    def verify_sample(proposal: Proposal, target_logits: Tensor, generator=None) -> tuple[int, Tensor]:
        k = proposal.draft_len
        p_target = logits_to_probs(target_logits, params)  # [k+1, V]
        if k == 0:  # the decoder's last, shortened step: a plain target sample
            return 0, sample(p_target[0], generator)
        q_draft = proposal.q_draft  # [k, V], the drafts were sampled from it
        if q_draft is None:  # deterministic drafts (prompt lookup): q is one-hot on each draft
            q_draft = torch.nn.functional.one_hot(proposal.tokens, p_target.shape[-1]).to(p_target.dtype)
        rows = torch.arange(k, device=p_target.device)
        p_d = p_target[rows, proposal.tokens]  # [k] p_target(draft_i)
        q_d = q_draft[rows, proposal.tokens]  # [k] q_draft(draft_i) > 0
        u = torch.rand(k, generator=generator, device=p_target.device)
        n = _num_leading_true(u * q_d < p_d)  # accept draft_i with probability min(1, p/q)
        if n == k:
            return n, sample(p_target[k], generator)  # bonus token from p_target after all k drafts
        residual = torch.clamp(p_target[n] - q_draft[n], min=0.0)  # resample from norm(max(0, p - q))
        total = residual.sum()
        # residual == 0 only if p == q at this row, where rejection has probability 0; float noise can still get
        # here, and then p_target is the exact answer.
        return n, sample(residual / total if total > 0 else p_target[n], generator)

    return verify_sample


def make_specdec_verifier(top_beta: int, tolerance: float) -> Verifier:
    """SpecDec relaxed verification (Xia et al. 2022, arXiv:2203.16487, Sec. 3.2 "Spec-Verification").

    Draft i is accepted iff, under the target's log-probs log P at its position,
      (1) it is among the target's top-beta candidates, and
      (2) log P(top-1) - log P(draft_i) <= tolerance;
    verification stops at the first draft failing either test, and the target's top-1 token is emitted there
    (or after all k drafts, as the bonus token). With top_beta=1 this is exactly greedy verification.
    Not lossless: output may differ from AR greedy; the evaluator reports by how much.
    """

    def verify_specdec(proposal: Proposal, target_logits: Tensor, generator=None) -> tuple[int, Tensor]:
        k = proposal.draft_len
        logp = torch.log_softmax(target_logits.float(), dim=-1)  # [k+1, V]
        top = torch.topk(logp[:k], min(top_beta, logp.shape[-1]), dim=-1)  # values/indices [k, beta]
        in_top_beta = (top.indices == proposal.tokens[:, None]).any(-1)  # [k]
        draft_logp = logp[torch.arange(k, device=logp.device), proposal.tokens]  # [k]
        within_tolerance = top.values[:, 0] - draft_logp <= tolerance
        n = _num_leading_true(in_top_beta & within_tolerance)
        return n, logp[n].argmax(-1)

    return verify_specdec


# ----------------------------------------------------------------------------------------------------------------
# Trees


def verify_tree_greedy(tree: DraftTree, target_logits: Tensor, generator=None) -> tuple[list[int], Tensor]:
    """The longest path whose tokens equal the target's argmax. target_logits: [N + 1, V] (row 0: the root)."""
    best = target_logits.argmax(-1).tolist()  # [N + 1] target's greedy choice after the root and after each node
    tokens, path, row = tree.tokens.tolist(), [], 0
    while (child := next((c for c in tree.children[row] if tokens[c] == best[row]), None)) is not None:
        path.append(child)
        row = child + 1
    return path, target_logits.new_tensor(best[row], dtype=torch.long)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)); p itself if nothing is left (p <= q everywhere happens only when rejection had
    probability 0, i.e. through float noise)."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def kseq_rho(p: Tensor, q: Tensor, k: int) -> float:
    """SpecTr's K-SEQ scale: the rho in [1, k] with 1 - (1 - beta)^k = rho * beta, beta = sum min(q, p / rho).
    The left side falls and the right side rises with rho, so bisection finds the one root."""
    if k == 1:
        return 1.0
    p, q = p.double(), q.double()
    low, high = 1.0, float(k)
    for _ in range(50):
        rho = (low + high) / 2
        beta = float(torch.minimum(q, p / rho).sum())
        low, high = (rho, high) if 1 - (1 - beta) ** k > rho * beta else (low, rho)
    return (low + high) / 2


def make_tree_sample_verifier(params: SamplingParams, rule: str = "sample") -> TreeVerifier:
    """Lossless tree verification by recursive rejection sampling over the siblings of each accepted node.

    rule=sample (SpecInfer's multi-step speculative sampling, arXiv 2305.09781): test the children in turn, accept
    child x with probability min(1, p(x) / q(x)); after each rejection p <- norm(max(0, p - q)). Deterministic (topk)
    children have q = one-hot(x): accept with probability p(x), then p <- p with x removed, renormalised.
    rule=spectr (SpecTr's K-SEQ, arXiv 2310.15141) for k i.i.d. draws from q: accept draw x with probability
    min(1, p(x) / (rho q(x))), and if all k fail sample norm(max(0, p - rho q)) (kseq_rho).
    With no child left (a leaf, or all rejected), the next token is drawn from what remains of p.
    """

    def verify(tree: DraftTree, target_logits: Tensor, generator=None) -> tuple[list[int], Tensor]:
        p_target = logits_to_probs(target_logits, params)  # [N + 1, V] row 0: after the root, row i + 1: after node i
        # one uniform per draw (none for an empty tree: the last, shortened step is a plain target sample)
        u = torch.rand(tree.num_draws, generator=generator, device=p_target.device) if tree.num_draws else None
        tokens, path, row = tree.tokens.tolist(), [], 0

        def q_of(node: int) -> Tensor:  # [V] what node's token was drawn from; one-hot for a deterministic child
            if tree.q_draft is not None:
                return tree.q_draft[node]
            return F.one_hot(tree.tokens[node], p_target.shape[-1]).to(p_target.dtype)

        while True:
            p, draws = p_target[row], tree.draws(row, generator)  # [V]; the children as (node, draw slot)
            if not draws:  # a leaf: the bonus token
                return path, sample(p, generator)
            rho = kseq_rho(p, q_of(draws[0][0]), len(draws)) if rule == "spectr" else 1.0  # siblings share q
            for child, slot in draws:
                q, x = q_of(child), tokens[child]
                if u[slot] * rho * q[x] < p[x]:  # accept with probability min(1, p(x) / (rho q(x)))
                    break
                if rule == "sample":  # the next sibling is tested against what is left of p
                    p = _residual(p, q)
            else:  # every child rejected: the correction
                return path, sample(_residual(p, rho * q) if rule == "spectr" else p, generator)
            path.append(child)
            row = child + 1

    return verify


def make_tree_verifier(mode: str, params: SamplingParams) -> TreeVerifier:
    if mode == "greedy":
        return verify_tree_greedy
    if mode in ("sample", "spectr"):
        return make_tree_sample_verifier(params, mode)
    raise ValueError(f"verify: {mode!r} has no tree rule (expected greedy, sample or spectr)")


def make_verifier(mode: str, params: SamplingParams, top_beta: int = 1, tolerance: float = 0.0) -> Verifier:
    if mode == "greedy":
        return verify_greedy
    if mode == "sample":
        return make_sample_verifier(params)
    if mode == "specdec":
        return make_specdec_verifier(top_beta, tolerance)
    raise ValueError(f"verify: unknown mode {mode!r} (expected greedy, sample or specdec)")
