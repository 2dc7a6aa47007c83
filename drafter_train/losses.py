"""Distillation losses for training a drafter (student) against the target (teacher).

Notation follows DistillSpec (Zhou et al. 2023): p = target probs, q = draft probs, and the acceptance rate of
speculative sampling (Leviathan et al. 2023) at one position is alpha = sum_x min(p(x), q(x)) = 1 - TVD(p, q).

Shapes: B batch, T sequence positions, V vocabulary. Every loss takes ``mask [B, T]`` (bool or 0/1: the response
positions that count) and optional ``weights [B, T]`` (each position's per-token loss is multiplied by its weight,
e.g. DFlash's decay over block positions), and returns a ``LossOutput``: the SUM of (weighted) per-token losses over
those positions and their number. Summing both over the micro-batches of an optimizer step and dividing once gives
the same value and gradients as one big batch, which a per-micro-batch mean does not when micro-batches hold
different token counts:

    n_total = sum(mb_mask.sum() for mb_mask in step_masks)  # all-reduced too under data parallelism
    for mb in micro_batches:
        (loss_fn(student(mb), target(mb), mb.mask).loss_sum / n_total).backward()

``temperature`` divides both sets of logits before the softmax (no Hinton T^2 rescaling: the decoder samples at
that temperature, so the distributions at it are what we match). Masked positions contribute exactly zero and get
zero gradient whatever their logits hold (-inf, nan), because they are replaced before any softmax.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor


class LossOutput(NamedTuple):
    """A loss as (sum over response tokens, number of response tokens); unpacks as a pair."""

    loss_sum: Tensor  # [] float: sum of per-token losses over masked positions
    num_tokens: Tensor  # [] long: number of masked positions

    def mean(self) -> Tensor:
        """[] The per-token mean for one batch (0 when it has no response tokens)."""
        return self.loss_sum / self.num_tokens.clamp_min(1)


def _log_probs(logits: Tensor, mask: Tensor, temperature: float) -> Tensor:
    """[B, T, V] log-softmax(logits / temperature), upcast to >= float32; masked rows become uniform.

    Log-probs are clamped to the dtype's finite minimum so a token that a model rules out with -inf (a padded
    vocabulary) gives 0 * finite = 0 in the sums below instead of 0 * -inf = nan, in the loss and in its gradient.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = torch.where(mask[..., None], logits, 0.0)
    if temperature != 1.0:  # x / 1 is x: a pass over [B, T, V] saved at the usual temperature
        logits = logits / temperature
    return logits.log_softmax(-1).clamp_min(torch.finfo(logits.dtype).min)


class SharedTeacher:
    """A teacher's logits [B, T, V] that several losses read over the same positions (EAGLE-3's training-time-test
    steps, each against the same target distribution): its log-probs, probs and the sum p log p of each row are
    computed once per temperature instead of once per loss. Pass it where a loss takes target_logits.

    ``mask [B, T]`` must cover every position a loss given this teacher counts: its log-probs are made under it,
    and the rows outside it are uniform."""

    def __init__(self, logits: Tensor, mask: Tensor):
        self.logits, self.mask, self._made = logits, mask.bool(), {}

    @property
    def shape(self) -> torch.Size:
        return self.logits.shape

    def argmax(self, dim: int) -> Tensor:
        return self.logits.argmax(dim)

    def log_probs(self, temperature: float) -> Tensor:
        return self._once(("log_probs", temperature), lambda: _log_probs(self.logits, self.mask, temperature))

    def probs(self, temperature: float) -> Tensor:
        return self._once(("probs", temperature), lambda: self.log_probs(temperature).exp())

    def plogp(self, temperature: float) -> Tensor:
        """[B, T] sum_x p(x) log p(x): the part of KL(p || q) that does not depend on the student."""
        return self._once(("plogp", temperature),
                          lambda: (self.probs(temperature) * self.log_probs(temperature)).sum(-1))

    def _once(self, key, make: Callable[[], Tensor]) -> Tensor:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def keep_top_k(target_logits: Tensor, k: int) -> Tensor:
    """[..., V] teacher logits with everything outside each row's k largest set to -inf: p renormalised over its
    top k (HASS's harmonized objective distillation, Zhang et al. 2024: the drafter only needs to rank the tokens the
    target would choose). Every loss then reads it as its p: fkl gives sum_{x in top k} p_k(x) log(p_k(x) / q(x)) with
    q the student's whole softmax gathered there, tvd the distance from q to p_k over the whole vocabulary. HASS's
    own term, -sum_{x in top k} p(x) log q(x) added to the full loss, is this fkl times the top-k mass, plus a
    constant, where this weighs every position alike. k = 0 or k = V: unchanged (the plain loss)."""
    vocab = target_logits.shape[-1]
    if k > vocab:
        raise ValueError(f"loss.top_k: {k} is larger than the teacher's vocabulary ({vocab} tokens)")
    if not 0 < k < vocab:
        return target_logits
    kept = target_logits.topk(k, dim=-1).indices
    return torch.full_like(target_logits, float("-inf")).scatter_(-1, kept, target_logits.gather(-1, kept))


def _pair(student_logits: Tensor, target_logits, mask: Tensor, temperature: float):
    """(log q, log p, mask as bool), each log-prob [B, T, V], after checking the shapes agree (target_logits: a
    tensor or a SharedTeacher)."""
    if student_logits.shape != target_logits.shape or mask.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"expected student/target logits [B, T, V] and mask [B, T], got {tuple(student_logits.shape)}, "
            f"{tuple(target_logits.shape)} and {tuple(mask.shape)}"
        )
    mask = mask.bool()
    log_p = target_logits.log_probs(temperature) if isinstance(target_logits, SharedTeacher) else \
        _log_probs(target_logits, mask, temperature)
    return _log_probs(student_logits, mask, temperature), log_p, mask


def _reduce(per_token: Tensor, mask: Tensor, weights: Optional[Tensor] = None) -> LossOutput:
    """Sum a [B, T] per-token loss (times weights [B, T], if given) over the mask (where, not multiply: a masked
    position adds exactly 0); the count is the unweighted number of masked positions."""
    if weights is not None:
        per_token = per_token * weights
    return LossOutput(torch.where(mask, per_token, 0.0).sum(), mask.sum())


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """[B, T] KL(a || b) = sum_x a(x) (log a(x) - log b(x)) from log-probs [B, T, V]."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def ce(student_logits: Tensor, labels: Tensor, mask: Tensor, temperature: float = 1.0,
       weights: Optional[Tensor] = None) -> LossOutput:
    """Cross-entropy -log q(label) on target-generated tokens: sequence-level KD (Kim & Rush 2016).

    student_logits [B, T, V], labels [B, T] long (the token the target produced at each position; any value where
    mask is 0, e.g. -100), mask [B, T]. Needs no target logits, so the target runs only to generate the corpus.
    """
    mask = mask.bool()
    log_q = _log_probs(student_logits, mask, temperature)
    picked = log_q.gather(-1, torch.where(mask, labels, 0)[..., None]).squeeze(-1)
    return _reduce(-picked, mask, weights)


def greedy_ce(student_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
              weights: Optional[Tensor] = None) -> LossOutput:
    """Cross-entropy -log q(argmax p) toward the target's greedy token at each position.

    Sequence-level KD's labels computed on any text (e.g. fixed responses whose own tokens are not the target's):
    what greedy verification accepts is exactly the target's argmax. student/target_logits [B, T, V], mask [B, T].
    """
    mask = mask.bool()
    return ce(student_logits, target_logits.argmax(-1), mask, temperature, weights)


def fkl(student_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
        weights: Optional[Tensor] = None) -> LossOutput:
    """Forward KL(p || q) per token: mass-covering. student/target_logits [B, T, V], mask [B, T]. With a SharedTeacher
    its p and sum p log p are reused: only sum p log q is computed again."""
    log_q, log_p, mask = _pair(student_logits, target_logits, mask, temperature)
    if isinstance(target_logits, SharedTeacher):
        per_token = target_logits.plogp(temperature) - (target_logits.probs(temperature) * log_q).sum(-1)
        return _reduce(per_token, mask, weights)
    return _reduce(_kl(log_p, log_q), mask, weights)


def rkl(student_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
        weights: Optional[Tensor] = None) -> LossOutput:
    """Reverse KL(q || p) per token: mode-seeking. student/target_logits [B, T, V], mask [B, T]."""
    log_q, log_p, mask = _pair(student_logits, target_logits, mask, temperature)
    return _reduce(_kl(log_q, log_p), mask, weights)


def jsd(
    student_logits: Tensor, target_logits: Tensor, mask: Tensor, beta: float = 0.5, temperature: float = 1.0,
    weights: Optional[Tensor] = None,
) -> LossOutput:
    """Generalized JSD of GKD (Agarwal et al. 2024, eq. 1; TRL ``generalized_jsd_loss``) per token.

    JSD_beta = beta KL(p || M) + (1 - beta) KL(q || M), with M = beta p + (1 - beta) q.
    student/target_logits [B, T, V], mask [B, T], beta in [0, 1]. beta = 0.5 is the symmetric JSD (<= log 2).
    JSD_beta itself tends to 0 at both ends, so, as in TRL, the ends return its slopes there:
    beta = 0 gives fkl, KL(p || q) = lim JSD_beta / beta; beta = 1 gives rkl, KL(q || p) = lim JSD_beta / (1 - beta).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return fkl(student_logits, target_logits, mask, temperature, weights)
    if beta == 1.0:
        return rkl(student_logits, target_logits, mask, temperature, weights)
    log_q, log_p, mask = _pair(student_logits, target_logits, mask, temperature)
    # log M mixed in log space: forming beta p + (1 - beta) q in probs would underflow to log(0) in the tails.
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return _reduce(beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m), mask, weights)


def _tvd_per_token(log_q: Tensor, log_p: Tensor) -> Tensor:
    """[B, T] 0.5 sum_x |p(x) - q(x)| = 1 - alpha."""
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def tvd(student_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
        weights: Optional[Tensor] = None) -> LossOutput:
    """Total variation 0.5 sum_x |p(x) - q(x)| per token, i.e. 1 - alpha, the chance the draft token is rejected.

    DistillSpec's direct acceptance-rate objective. student/target_logits [B, T, V], mask [B, T].
    """
    log_q, log_p, mask = _pair(student_logits, target_logits, mask, temperature)
    return _reduce(_tvd_per_token(log_q, log_p), mask, weights)


def _window_cumprod(alpha: Tensor, mask: Tensor, draft_len: int, inclusive: bool) -> Tensor:
    """[B, T] product of alpha over the earlier (inclusive: and this) positions of each position's window; 0 off mask.

    Windows are consecutive runs of ``draft_len`` response positions of a row, counted from its first masked
    position (gaps in the mask are skipped). Positions are packed into [B, windows, draft_len] so one cumprod does
    every window, with no host sync: T positions need at most ceil(T / draft_len) windows per row.
    """
    B, T = alpha.shape
    rank = mask.long().cumsum(-1) - 1  # [B, T] index of each response position within its row
    n_slots = -(-T // draft_len) * draft_len
    # Off-mask positions are scattered to one spare column that is dropped; unused slots hold 1 and are never read.
    index = torch.where(mask, rank, n_slots)
    slots = alpha.new_ones(B, n_slots + 1).scatter(1, index, alpha)[:, :n_slots].view(B, -1, draft_len)
    if not inclusive:  # shift right within each window: the first position of a window is always reached
        slots = torch.nn.functional.pad(slots[..., :-1], (1, 0), value=1.0)
    prods = slots.cumprod(-1).view(B, n_slots)
    return torch.where(mask, prods.gather(1, rank.clamp_min(0)), 0.0)


def _alpha(student_logits: Tensor, target_logits: Tensor, mask: Tensor, draft_len: int, temperature: float):
    """(alpha [B, T] = 1 - TVD per position, mask as bool)."""
    if draft_len < 1:
        raise ValueError(f"draft_len must be >= 1, got {draft_len}")
    log_q, log_p, mask = _pair(student_logits, target_logits, mask, temperature)
    return 1.0 - _tvd_per_token(log_q, log_p), mask


def accepted_length_loss(
    student_logits: Tensor, target_logits: Tensor, mask: Tensor, draft_len: int, temperature: float = 1.0,
    weights: Optional[Tensor] = None,
) -> LossOutput:
    """Minus the expected number of accepted draft tokens, summed over windows of ``draft_len`` positions.

    student/target_logits [B, T, V], mask [B, T], draft_len >= 1. Each row's response positions are cut into
    consecutive windows of draft_len (the last may be shorter), each standing for one draft block verified by one
    target pass. With alpha_j = sum_x min(p_j(x), q_j(x)), draft position i of a window is accepted with
    probability prod_{j<=i} alpha_j, so a window contributes -sum_i prod_{j<=i} alpha_j, in [-len(window), 0].
    Windows start at fixed offsets, whereas in decoding a block starts after the last rejection: a model of it.

    ``loss_sum`` is the sum over all windows and ``num_tokens`` counts response positions, as for every other loss,
    so accumulation works the same; ``mean()`` is in [-1, 0] (-1 when q = p) and ``mean() * draft_len`` is minus
    the expected accepted tokens per full window. The gradient reaches an early alpha through every later product.
    """
    alpha, mask = _alpha(student_logits, target_logits, mask, draft_len, temperature)
    return _reduce(-_window_cumprod(alpha, mask, draft_len, inclusive=True), mask, weights)


def reach_weighted_tvd(
    student_logits: Tensor, target_logits: Tensor, mask: Tensor, draft_len: int, temperature: float = 1.0,
    weights: Optional[Tensor] = None,
) -> LossOutput:
    """TVD at each position times the probability that the position is reached: a surrogate for accepted length.

    student/target_logits [B, T, V], mask [B, T], draft_len >= 1; windows as in ``accepted_length_loss``. Position
    i of a window is reached (verified at all) with probability r_i = prod_{j<i} alpha_j (r = 1 first in a window)
    and contributes r_i * TVD_i = r_i * (1 - alpha_i), with r_i detached: plain TVD that stops spending effort on
    positions decoding rarely gets to, without the long product chains of ``accepted_length_loss``. Per-token
    values lie in [0, 1].
    """
    alpha, mask = _alpha(student_logits, target_logits, mask, draft_len, temperature)
    reach = _window_cumprod(alpha.detach(), mask, draft_len, inclusive=False)
    return _reduce(reach * (1.0 - alpha), mask, weights)


# Every entry is called as fn(student_logits, target, mask, **options): target is labels [B, T] for "ce" and
# target_logits [B, T, V] for the rest; options are beta (jsd), draft_len (accepted_length, reach_weighted_tvd)
# temperature and weights (all).
LOSSES: dict[str, Callable[..., LossOutput]] = {
    "ce": ce,
    "greedy_ce": greedy_ce,
    "fkl": fkl,
    "rkl": rkl,
    "jsd": jsd,
    "tvd": tvd,
    "accepted_length": accepted_length_loss,
    "reach_weighted_tvd": reach_weighted_tvd,
}


def get_loss(name: str) -> Callable[..., LossOutput]:
    """The loss function registered as ``name`` in ``LOSSES``."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(LOSSES)}")
    return LOSSES[name]
