"""Losses against naive references (python loops over plain floats), F.kl_div and F.cross_entropy."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from drafter_train.losses import LOSSES, LossOutput, SharedTeacher, get_loss, jsd

B, T, V = 2, 5, 7
TOL = dict(atol=1e-10, rtol=1e-8)  # float64 references
# Row 0 has 3 response positions, row 1 has 4 with a gap: micro-batches of different token counts.
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 1, 1]], dtype=torch.bool)
DIVERGENCES = ["fkl", "rkl", "jsd", "tvd"]
OPTIONS = {"jsd": {"beta": 0.3}, "accepted_length": {"draft_len": 2}, "reach_weighted_tvd": {"draft_len": 2}}


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_()


def _labels(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _call(name, student, target, mask, **kw):
    """Run a registered loss; 'ce' gets the target's argmax tokens as its labels."""
    second = target.argmax(-1) if name == "ce" else target
    return get_loss(name)(student, second, mask, **OPTIONS.get(name, {}), **kw)


# ---- naive references: one position at a time, explicit sums over the vocabulary ----


def _softmax(row, temperature=1.0):
    z = [x / temperature for x in row]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    return [x / sum(e) for x in e]


def _positions(student, target, mask, temperature=1.0):
    """[(q, p)] per masked position, row-major: lists of floats."""
    out = []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                q, p = _softmax(student[b, t].tolist(), temperature), _softmax(target[b, t].tolist(), temperature)
                out.append((q, p))
    return out


def _naive_kl(a, b):
    return sum(ai * math.log(ai / bi) for ai, bi in zip(a, b) if ai > 0)


def _naive_jsd(q, p, beta):
    m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q)]
    return beta * _naive_kl(p, m) + (1 - beta) * _naive_kl(q, m)


def _naive_tvd(q, p):
    return 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q))


def _naive_alpha(q, p):
    return sum(min(pi, qi) for pi, qi in zip(p, q))


def _naive_windows(student, target, mask, draft_len):
    """Per row, the alpha lists of its consecutive windows of draft_len response positions."""
    rows = []
    for b in range(B):
        alphas = []
        for t in range(T):
            if mask[b, t]:
                alphas.append(_naive_alpha(_softmax(student[b, t].tolist()), _softmax(target[b, t].tolist())))
        rows.append([alphas[i : i + draft_len] for i in range(0, len(alphas), draft_len)])
    return rows


def _naive_sum(per_position, student, target, mask, temperature=1.0):
    total = sum(per_position(q, p) for q, p in _positions(student, target, mask, temperature))
    return torch.tensor(total, dtype=torch.float64)


# ---- against references ----


@pytest.mark.parametrize(
    "name, naive",
    [("fkl", lambda q, p: _naive_kl(p, q)), ("rkl", lambda q, p: _naive_kl(q, p)), ("tvd", _naive_tvd)],
)
def test_divergences_match_naive(name, naive):
    s, t = _logits(0), _logits(1)
    out = get_loss(name)(s, t, MASK)
    assert_close(out.loss_sum, _naive_sum(naive, s, t, MASK), **TOL)
    assert out.num_tokens.item() == int(MASK.sum())


def test_kl_matches_torch_kl_div():
    s, t = _logits(0), _logits(1)
    log_q, log_p = s[MASK].log_softmax(-1), t[MASK].log_softmax(-1)
    # F.kl_div(input, target) = KL(target || exp(input)).
    assert_close(get_loss("fkl")(s, t, MASK).loss_sum, F.kl_div(log_q, log_p, reduction="sum", log_target=True), **TOL)
    assert_close(get_loss("fkl")(s, t, MASK).loss_sum, F.kl_div(log_q, log_p.exp(), reduction="sum"), **TOL)
    assert_close(get_loss("rkl")(s, t, MASK).loss_sum, F.kl_div(log_p, log_q, reduction="sum", log_target=True), **TOL)
    assert_close(get_loss("rkl")(s, t, MASK).loss_sum, F.kl_div(log_p, log_q.exp(), reduction="sum"), **TOL)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_matches_naive(beta):
    s, t = _logits(0), _logits(1)
    expected = _naive_sum(lambda q, p: _naive_jsd(q, p, beta), s, t, MASK)
    assert_close(jsd(s, t, MASK, beta=beta).loss_sum, expected, **TOL)


def test_jsd_limits_and_symmetry():
    s, t = _logits(0), _logits(1)
    fkl, rkl = get_loss("fkl")(s, t, MASK).loss_sum, get_loss("rkl")(s, t, MASK).loss_sum
    assert_close(jsd(s, t, MASK, beta=0.0).loss_sum, fkl, **TOL)
    assert_close(jsd(s, t, MASK, beta=1.0).loss_sum, rkl, **TOL)
    # The ends are the slopes of JSD_beta there, so the values just inside approach them.
    eps = 1e-6
    assert_close(jsd(s, t, MASK, beta=eps).loss_sum / eps, fkl, atol=1e-4, rtol=1e-4)
    assert_close(jsd(s, t, MASK, beta=1 - eps).loss_sum / eps, rkl, atol=1e-4, rtol=1e-4)
    assert_close(jsd(s, t, MASK, beta=0.5).loss_sum, jsd(t, s, MASK, beta=0.5).loss_sum, **TOL)
    assert_close(jsd(s, t, MASK, beta=0.2).loss_sum, jsd(t, s, MASK, beta=0.8).loss_sum, **TOL)
    assert jsd(s, t, MASK, beta=0.5).mean() <= math.log(2)
    with pytest.raises(ValueError, match="beta"):
        jsd(s, t, MASK, beta=1.5)


def test_tvd_is_one_minus_alpha():
    s, t = _logits(0), _logits(1)
    alpha = _naive_sum(_naive_alpha, s, t, MASK)
    assert_close(MASK.sum() - get_loss("tvd")(s, t, MASK).loss_sum, alpha, **TOL)


def test_ce_matches_cross_entropy():
    s, labels = _logits(0), _labels()
    labels = labels.masked_fill(~MASK, -100)
    expected = F.cross_entropy(s.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    out = get_loss("ce")(s, labels, MASK)
    assert_close(out.loss_sum, expected, **TOL)
    assert_close(out.mean(), expected / MASK.sum(), **TOL)


def test_greedy_ce_is_cross_entropy_toward_the_targets_argmax():
    s, t = _logits(0), _logits(1)
    labels = t.argmax(-1).masked_fill(~MASK, -100)
    expected = F.cross_entropy(s.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    assert_close(get_loss("greedy_ce")(s, t, MASK).loss_sum, expected, **TOL)


def test_accepted_length_matches_naive_loop():
    s, t = _logits(0, scale=0.7), _logits(1, scale=0.7)
    for draft_len in (1, 2, 3, 4):
        expected = 0.0
        for windows in _naive_windows(s, t, MASK, draft_len):
            for alphas in windows:
                expected -= sum(math.prod(alphas[: i + 1]) for i in range(len(alphas)))
        out = get_loss("accepted_length")(s, t, MASK, draft_len=draft_len)
        assert_close(out.loss_sum, torch.tensor(expected, dtype=torch.float64), **TOL)


def test_reach_weighted_tvd_matches_naive_loop():
    s, t = _logits(0, scale=0.7), _logits(1, scale=0.7)
    expected = 0.0
    for windows in _naive_windows(s, t, MASK, 2):
        for alphas in windows:
            expected += sum(math.prod(alphas[:i]) * (1 - alphas[i]) for i in range(len(alphas)))
    out = get_loss("reach_weighted_tvd")(s, t, MASK, draft_len=2)
    assert_close(out.loss_sum, torch.tensor(expected, dtype=torch.float64), **TOL)


def test_reach_weight_is_detached():
    # Draft_len 2 windows start at rows' response ranks 0, 2: positions (0, 2), (0, 4), (1, 0), (1, 3). A reach
    # weight with a gradient would send the later positions' TVD back to these; detached, they see their own TVD.
    s, t = _logits(0), _logits(1)
    (reach_grad,) = torch.autograd.grad(get_loss("reach_weighted_tvd")(s, t, MASK, draft_len=2).loss_sum, s)
    (tvd_grad,) = torch.autograd.grad(get_loss("tvd")(s, t, MASK).loss_sum, s)
    starts = torch.tensor([[0, 0, 1, 0, 1], [1, 0, 0, 1, 0]], dtype=torch.bool)
    assert_close(reach_grad[starts], tvd_grad[starts], **TOL)


def test_accepted_length_when_draft_equals_target_and_gradients():
    s = _logits(0)
    same = get_loss("accepted_length")(s, s.detach().clone(), torch.ones(B, T, dtype=torch.bool), draft_len=5)
    assert_close(same.loss_sum, torch.tensor(-5.0 * B, dtype=torch.float64), **TOL)  # one full window per row
    out = get_loss("accepted_length")(s, _logits(1), MASK, draft_len=2)
    assert -2 <= out.mean() * 2 <= 0
    out.loss_sum.backward()
    assert torch.isfinite(s.grad).all() and s.grad[MASK].abs().sum() > 0


# ---- properties every loss shares ----


@pytest.mark.parametrize("name", list(LOSSES))
def test_temperature_equals_scaled_logits(name):
    s, t = _logits(0), _logits(1)
    hot = _call(name, s, t, MASK, temperature=2.5).loss_sum
    assert_close(hot, _call(name, s / 2.5, t / 2.5, MASK).loss_sum, **TOL)
    assert_close(get_loss("tvd")(s, t, MASK, temperature=2.5).loss_sum, _naive_sum(_naive_tvd, s, t, MASK, 2.5), **TOL)


@pytest.mark.parametrize("name", list(LOSSES))
def test_masked_positions_do_not_matter(name):
    s, t = _logits(0), _logits(1)
    clean = _call(name, s, t, MASK)
    clean.loss_sum.backward()
    garbage_s, garbage_t = s.detach().clone(), t.detach().clone()
    for value, (b, pos) in zip([float("inf"), float("-inf"), float("nan")], [(0, 0), (0, 1), (1, 2)]):
        garbage_s[b, pos, :3], garbage_t[b, pos, 2:] = value, -value
    garbage_s.requires_grad_()
    dirty = _call(name, garbage_s, garbage_t, MASK)
    dirty.loss_sum.backward()
    assert_close(dirty.loss_sum, clean.loss_sum, **TOL)
    assert_close(garbage_s.grad, s.grad, **TOL)
    assert (garbage_s.grad[~MASK] == 0).all()


@pytest.mark.parametrize("name", DIVERGENCES + ["accepted_length", "reach_weighted_tvd"])
def test_token_ruled_out_by_both_models_is_ignored(name):
    # A padded vocabulary: both models give the last token -inf; it must act as if it were not there.
    s, t = _logits(0), _logits(1)
    s_pad, t_pad = F.pad(s, (0, 1), value=float("-inf")), F.pad(t, (0, 1), value=float("-inf"))
    out = get_loss(name)(s_pad, t_pad, MASK, **OPTIONS.get(name, {}))
    out.loss_sum.backward()
    assert_close(out.loss_sum, get_loss(name)(s, t, MASK, **OPTIONS.get(name, {})).loss_sum, **TOL)
    assert torch.isfinite(s.grad).all()


@pytest.mark.parametrize("name", list(LOSSES))
def test_gradient_accumulation_matches_full_batch(name):
    s, t = _logits(0), _logits(1)
    full = _call(name, s, t, MASK).mean()
    (full_grad,) = torch.autograd.grad(full, s)
    parts = [_call(name, s[i : i + 1], t[i : i + 1], MASK[i : i + 1]) for i in range(B)]
    assert parts[0].num_tokens != parts[1].num_tokens  # a per-micro-batch mean would weight them wrongly
    accumulated = sum(p.loss_sum for p in parts) / sum(p.num_tokens for p in parts)
    (accumulated_grad,) = torch.autograd.grad(accumulated, s)
    assert_close(accumulated, full, **TOL)
    assert_close(accumulated_grad, full_grad, **TOL)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_identical_distributions_give_zero(name):
    s = _logits(0)
    out = get_loss(name)(s, s.detach().clone(), MASK, **OPTIONS.get(name, {}))
    assert_close(out.loss_sum, torch.tensor(0.0, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_range(name, seed):
    out = _call(name, _logits(seed), _logits(seed + 10, scale=4.0), MASK)
    assert isinstance(out, LossOutput) and torch.isfinite(out.loss_sum)
    if name == "accepted_length":
        assert -1.0 <= out.mean() <= 0.0  # per token; minus accepted tokens per window / draft_len
    else:
        assert out.loss_sum >= 0


def test_empty_mask_gives_zero_mean():
    out = get_loss("fkl")(_logits(0), _logits(1), torch.zeros(B, T, dtype=torch.bool))
    assert out.num_tokens == 0 and out.mean() == 0


def test_unknown_name_and_bad_shapes():
    with pytest.raises(ValueError, match="unknown loss 'kl'; valid names: ce, greedy_ce, fkl"):
        get_loss("kl")
    with pytest.raises(ValueError, match=r"mask \[B, T\]"):
        get_loss("fkl")(_logits(0), _logits(1), MASK[:, :3])


@pytest.mark.parametrize("name", list(LOSSES))
def test_weights_scale_each_positions_own_loss(name):
    """weights [B, T] multiply each position's per-token loss (DFlash's position decay): all ones change nothing,
    and the weighted sum is the weights times the one-position contributions; the count stays unweighted."""
    s, t = _logits(0), _logits(1)
    plain = _call(name, s, t, MASK)
    assert_close(_call(name, s, t, MASK, weights=torch.ones(B, T, dtype=torch.float64)).loss_sum, plain.loss_sum, **TOL)
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    weighted = _call(name, s, t, MASK, weights=w)
    parts = 0.0
    for b, pos in MASK.nonzero().tolist():
        one = torch.zeros(B, T, dtype=torch.float64)
        one[b, pos] = 1.0
        contribution = _call(name, s, t, MASK, weights=one).loss_sum
        if name not in ("accepted_length", "reach_weighted_tvd"):  # per-token losses: the position on its own
            alone = torch.zeros_like(MASK)
            alone[b, pos] = True
            assert_close(contribution, _call(name, s, t, alone).loss_sum, **TOL)
        parts = parts + w[b, pos] * contribution
    assert_close(weighted.loss_sum, parts, **TOL)
    assert weighted.num_tokens == plain.num_tokens


@pytest.mark.parametrize("name", [n for n in LOSSES if n != "ce"])
def test_a_shared_teacher_gives_each_losss_value_and_gradient_over_any_sub_mask(name):
    """EAGLE-3's training-time-test steps read one teacher through SharedTeacher: over the shared mask and over masks
    inside it (the later steps drop their first positions), each loss and its gradient are the plain call's, with
    a padded vocabulary's -inf too, and the teacher's softmax is made once for all of them."""
    s, t = _logits(0), _logits(1)
    s_pad, t_pad = F.pad(s.detach(), (0, 1), value=float("-inf")), F.pad(t.detach(), (0, 1), value=float("-inf"))
    shared = SharedTeacher(t_pad, MASK)
    later = MASK & torch.tensor([[0, 0, 0, 1, 1], [0, 1, 0, 1, 1]], dtype=torch.bool)
    for mask in (MASK, later, later & False):
        plain_s, shared_s = s_pad.clone().requires_grad_(), s_pad.clone().requires_grad_()
        plain = get_loss(name)(plain_s, t_pad, mask, **OPTIONS.get(name, {}))
        mine = get_loss(name)(shared_s, shared, mask, **OPTIONS.get(name, {}))
        (plain.loss_sum + 0 * plain_s.sum()).backward()
        (mine.loss_sum + 0 * shared_s.sum()).backward()
        assert_close(mine.loss_sum, plain.loss_sum, **TOL)
        assert mine.num_tokens == plain.num_tokens
        assert_close(shared_s.grad, plain_s.grad, **TOL)
    assert shared.log_probs(1.0) is shared.log_probs(1.0)


# ---- loss.top_k: distillation on the target's top-K tokens (HASS) ----


def _naive_top_k(per_position, student, target, mask, k):
    """The loss on p renormalised over its k largest, the student's whole softmax q read at those ids and, for the
    distance, its mass elsewhere: a python loop over plain floats."""
    total = 0.0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                row = target[b, t].tolist()
                kept = sorted(range(V), key=lambda i: -row[i])[:k]
                p_k = _softmax([row[i] for i in kept])
                q = _softmax(student[b, t].tolist())
                total += per_position([q[i] for i in kept], p_k, 1 - sum(q[i] for i in kept))
    return torch.tensor(total, dtype=torch.float64)


@pytest.mark.parametrize("name, naive", [
    ("fkl", lambda q_k, p_k, q_rest: sum(p * math.log(p / q) for p, q in zip(p_k, q_k))),
    ("tvd", lambda q_k, p_k, q_rest: 0.5 * (sum(abs(p - q) for p, q in zip(p_k, q_k)) + q_rest)),
])
@pytest.mark.parametrize("k", [1, 3])
def test_top_k_distillation_matches_a_naive_loop(name, naive, k):
    from drafter_train.config import LossConfig
    from drafter_train.drafters.common.distill import apply_loss

    s, t = _logits(0), _logits(1)
    out = apply_loss(LossConfig(name=name, top_k=k), s, None, MASK, lambda: t, 4)
    assert_close(out.loss_sum, _naive_top_k(naive, s, t, MASK, k), **TOL)
    assert not torch.allclose(out.loss_sum, get_loss(name)(s, t, MASK).loss_sum)
    # through a SharedTeacher (EAGLE-3's steps): restricted once where it is made, the same value
    from drafter_train.drafters.common.distill import top_k_teacher

    shared = SharedTeacher(top_k_teacher(t.detach(), LossConfig(name=name, top_k=k)), MASK)
    assert_close(apply_loss(LossConfig(name=name, top_k=k), s, None, MASK, lambda: shared, 4).loss_sum,
                 out.loss_sum, **TOL)


@pytest.mark.parametrize("name", ["fkl", "tvd", "jsd", "accepted_length"])
def test_top_k_of_the_whole_vocabulary_is_the_plain_loss(name):
    from drafter_train.config import LossConfig
    from drafter_train.drafters.common.distill import apply_loss

    s, t = _logits(0), _logits(1)
    for k in (0, V):
        out = apply_loss(LossConfig(name=name, top_k=k), s, None, MASK, lambda: t, 2)
        assert_close(out.loss_sum, apply_loss(LossConfig(name=name), s, None, MASK, lambda: t, 2).loss_sum, **TOL)


def test_a_top_k_larger_than_the_vocabulary_is_refused_in_one_line():
    from drafter_train.config import LossConfig
    from drafter_train.drafters.common.distill import apply_loss
    from drafter_train.errors import ConfigError

    s, t = _logits(0), _logits(1)
    with pytest.raises(ConfigError, match=rf"^loss.top_k: {V + 1} is larger than the teacher's vocabulary \({V} "):
        apply_loss(LossConfig(name="fkl", top_k=V + 1), s, None, MASK, lambda: t, 2)
