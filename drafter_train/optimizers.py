"""The drafter's optimizer (train.optimizer): AdamW, or Muon on the hidden weight matrices with AdamW on the rest.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum update, so it applies to 2-D weights inside the network
only; embeddings, the vocabulary head, norms and biases stay with AdamW. Both run as one optimizer object here (Stepped) (one
scheduler over all their parameter groups, one state_dict in the checkpoint), so the training loop, accelerate's
wrapper and resume see no difference. Muon needs each matrix whole: DeepSpeed and FSDP partition them, so there AdamW
trains instead, said in one line (the EAGLE-3 recipe asks for Muon, and a ZeRO or FSDP launch should still train).
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch

from drafter_train.errors import ConfigError

MATRIX_EXCLUDED = ("embed", "lm_head")  # vocabulary-sized: Muon's orthogonalised update does not suit them


def muon_parameters(named: Iterable[tuple[str, torch.nn.Parameter]]) -> tuple[list, list]:
    """(Muon's, AdamW's) among the trainable parameters: 2-D weights not named as embeddings or heads go to Muon."""
    muon, adamw = [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        is_matrix = param.ndim == 2 and not any(part in name for part in MATRIX_EXCLUDED)
        (muon if is_matrix else adamw).append(param)
    return muon, adamw


class Stepped(torch.optim.Optimizer):
    """Optimizers over disjoint parameters, stepped together as one. The parameter groups are the inner optimizers'
    own dicts, so an LR scheduler over this object scales each group from its own base lr (Muon's and AdamW's
    differ)."""

    def __init__(self, *inner: torch.optim.Optimizer):
        self.inner = list(inner)
        super().__init__([{"params": g["params"]} for o in self.inner for g in o.param_groups], {})
        self.param_groups = [g for o in self.inner for g in o.param_groups]  # shared with the inner optimizers

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for optimizer in self.inner:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.inner:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"inner": [optimizer.state_dict() for optimizer in self.inner]}

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer, state in zip(self.inner, state_dict["inner"], strict=True):
            optimizer.load_state_dict(state)
        self.param_groups = [g for o in self.inner for g in o.param_groups]  # loading made new group dicts


def make_optimizer(model: torch.nn.Module, tcfg, partitioned: bool) -> torch.optim.Optimizer:
    """train.optimizer over the model's trainable parameters. `partitioned`: DeepSpeed or FSDP hold the weights."""
    if tcfg.optimizer == "muon" and partitioned:
        print(f"train.optimizer=muon: DeepSpeed and FSDP partition the weight matrices Muon needs whole; AdamW at "
              f"train.lr={tcfg.lr} instead (DDP or one process runs Muon)", file=sys.stderr)
    if tcfg.optimizer == "adamw" or partitioned:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tcfg.lr,
                                 weight_decay=tcfg.weight_decay)
    muon, adamw = muon_parameters(model.named_parameters())
    if not muon:
        raise ConfigError("train.optimizer=muon: this drafter has no trainable hidden weight matrix")
    # match_rms_adamw: Muon's step scaled to an AdamW-like update size, 0.2 * muon_lr per element
    inner = [torch.optim.Muon(muon, lr=tcfg.muon_lr, weight_decay=tcfg.muon_weight_decay,
                              adjust_lr_fn="match_rms_adamw")]
    if adamw:
        inner.append(torch.optim.AdamW(adamw, lr=tcfg.lr, weight_decay=tcfg.weight_decay))
    return Stepped(*inner)


def logged_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> dict[str, float]:
    """The schedule's current lrs (scheduler.get_last_lr(), one per param group) as logged: `train/lr` is train.lr's
    (AdamW's groups), `train/muon_lr` train.muon_lr's where Muon trains the weight matrices."""
    muon = ["ns_steps" in group for group in optimizer.param_groups]
    logged = {"train/lr": next((lr for lr, m in zip(lrs, muon) if not m), None),
              "train/muon_lr": next((lr for lr, m in zip(lrs, muon) if m), None)}
    return {k: v for k, v in logged.items() if v is not None}

