"""train.optimizer=muon: Muon on the hidden weight matrices and AdamW on the rest, as one optimizer that steps,
schedules and checkpoints like AdamW alone; checked against the two torch optimizers run side by side, and through
drafter-train (EAGLE-3 on the tiny target: it learns, and an interrupted run resumes exactly)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import get_scheduler

from drafter_train.errors import ConfigError
from drafter_train.optimizers import logged_lrs, make_optimizer, muon_parameters

SETTINGS = SimpleNamespace(optimizer="muon", lr=1e-3, weight_decay=0.0, muon_lr=0.02, muon_weight_decay=0.1)


class Drafterish(torch.nn.Module):
    """The parameter kinds a drafter has: a frozen embedding, a fused input matrix, a layer's matrices, a norm, a
    bias, a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(32, 8).requires_grad_(False)
        self.fc = torch.nn.Linear(24, 8, bias=False)
        self.q_proj = torch.nn.Linear(8, 8, bias=True)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 32, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.q_proj(self.fc(x))))


def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw():
    model = Drafterish()
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = muon_parameters(model.named_parameters())
    assert sorted(names[id(p)] for p in muon) == ["fc.weight", "q_proj.weight"]
    assert sorted(names[id(p)] for p in adamw) == ["lm_head.weight", "norm.bias", "norm.weight", "q_proj.bias"]


def _losses_steps(model, optimizer, scheduler, steps, start=0):
    torch.manual_seed(100 + start)
    for _ in range(steps):
        loss = model(torch.randn(4, 24)).logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def test_one_optimizer_steps_as_muon_and_adamw_side_by_side_under_one_schedule():
    ours, reference = Drafterish(), Drafterish()
    optimizer = make_optimizer(ours, SETTINGS, partitioned=False)
    scheduler = get_scheduler("cosine", optimizer, 2, 6)
    muon, adamw = muon_parameters(reference.named_parameters())
    pair = [torch.optim.Muon(muon, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(adamw, lr=1e-3, weight_decay=0.0)]
    schedules = [get_scheduler("cosine", o, 2, 6) for o in pair]
    _losses_steps(ours, optimizer, scheduler, 6)
    torch.manual_seed(100)
    for _ in range(6):
        reference(torch.randn(4, 24)).logsumexp(-1).mean().backward()
        for o, s in zip(pair, schedules):
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert not torch.equal(ours.fc.weight, Drafterish().fc.weight)  # it did train
    # each group follows the schedule from its own base lr
    lrs = scheduler.get_last_lr()
    assert lrs[0] == pytest.approx(schedules[0].get_last_lr()[0]) and lrs[-1] == pytest.approx(schedules[1].get_last_lr()[0])


def test_the_logged_lr_is_train_lr_and_muon_lr_is_logged_beside_it():
    """train/lr once logged Muon's lr (0.02 here) as if it were train.lr: each is logged under its own name."""
    model = Drafterish()
    optimizer = make_optimizer(model, SETTINGS, partitioned=False)
    scheduler = get_scheduler("cosine", optimizer, 0, 4)
    scheduler.step()
    factor = scheduler.get_last_lr()[0] / SETTINGS.muon_lr
    logged = logged_lrs(optimizer, scheduler.get_last_lr())
    assert logged == {"train/lr": pytest.approx(SETTINGS.lr * factor), "train/muon_lr": pytest.approx(0.02 * factor)}
    adamw = make_optimizer(model, SimpleNamespace(**{**vars(SETTINGS), "optimizer": "adamw"}), partitioned=False)
    assert logged_lrs(adamw, [SETTINGS.lr]) == {"train/lr": SETTINGS.lr}


def test_its_state_dict_resumes_the_same_steps():
    straight = Drafterish()
    optimizer = make_optimizer(straight, SETTINGS, partitioned=False)
    scheduler = get_scheduler("linear", optimizer, 1, 6)
    _losses_steps(straight, optimizer, scheduler, 3)
    saved = copy.deepcopy((straight.state_dict(), optimizer.state_dict(), scheduler.state_dict()))
    _losses_steps(straight, optimizer, scheduler, 3, start=3)
    resumed = Drafterish()
    resumed.load_state_dict(saved[0])
    again = make_optimizer(resumed, SETTINGS, partitioned=False)
    schedule = get_scheduler("linear", again, 1, 6)
    again.load_state_dict(saved[1])
    schedule.load_state_dict(saved[2])
    _losses_steps(resumed, again, schedule, 3, start=3)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_muon_falls_back_to_adamw_in_one_line_where_matrices_are_partitioned(capsys):
    fallback = make_optimizer(Drafterish(), SETTINGS, partitioned=True)
    assert type(fallback) is torch.optim.AdamW and fallback.param_groups[0]["lr"] == SETTINGS.lr
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("train.optimizer=muon: DeepSpeed and FSDP partition")
    plain = make_optimizer(Drafterish(), SimpleNamespace(**dict(vars(SETTINGS), optimizer="adamw")), partitioned=True)
    assert type(plain) is torch.optim.AdamW


def test_a_bad_optimizer_name_is_one_line_before_anything_loads():
    from drafter_train.config import TrainConfig

    with pytest.raises(ConfigError, match="train.optimizer.*adamw or muon"):
        TrainConfig(optimizer="sgd")


def test_eagle3_trains_with_muon_and_resumes_exactly(tiny_data, tmp_path, monkeypatch):
    from tests.test_eagle3 import eagle3_cfg
    from tests.test_train import assert_resumes_exactly, losses

    args = ("drafter.features=offline", "loss=fkl", "train.optimizer=muon")
    run_a, _, _ = assert_resumes_exactly(lambda out: eagle3_cfg(tiny_data, out, *args), "eagle3", tmp_path,
                                         monkeypatch)
    assert losses(run_a)[6] < losses(run_a)[1]
