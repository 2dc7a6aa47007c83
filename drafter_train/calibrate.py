"""Cost-aware choice of the draft length or tree size for THIS machine (`eval.calibration.enabled=true`).

The best setting depends on the hardware: on a CPU a target pass over n tokens costs 1.6-2.6x a 1-token pass and
not monotonically in n, on a GPU 1 to 32 tokens cost about the same. Calibration

1. measures the machine's verify cost curve: the median time of one target pass over n tokens after a cached prefix,
   for every n a candidate needs (interleaved over sizes, so load changes hit them alike);
2. runs the speculative decoder once per candidate chain length and once per tree shape (top_k, depth) on a few
   prompts: the drafter's ms per proposal and the accepted drafts per step. A smaller tree of a shape is the larger
   one's best nodes (growing a tree does not depend on total_tokens), so one run at the largest size also gives the
   smaller sizes: in every step, a greedy verifier would have accepted exactly the path's nodes that rank below n
   (DecodeStats.accepted_within). That is an estimate only in which contexts are visited (a smaller tree advances
   less per step, so its own run would verify other steps);
3. predicts each candidate's speedup over AR decoding:
       speedup = (1 + accepted drafts per step) * cost(1) / (drafter ms per proposal + cost(drafts + 1))
   (per-step bookkeeping of both decoders is left out);
4. picks the best; evaluate.py then decodes the evaluation prompts with it for real and prints predicted next to
   measured, and calibration.json records the pick and the machine (drafter-export puts both in the model card).

Nothing is cached between runs: the curve takes seconds to measure, and a stored one goes stale silently when the
load, the thread count or the libraries change.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from drafter_train.config import CalibrationConfig, EvalConfig, TreeConfig
from drafter_train.decoding.cached_lm import CachedLM, as_tensor
from drafter_train.decoding.stats import DecodeStats
from drafter_train.decoding.tree import TreeSpec, attention_mask
from drafter_train.devices import device_name, synchronize


@dataclass
class Candidate:
    """One setting and its predicted speedup."""

    draft_len: int  # a chain's length, or a tree's depth
    tree: Optional[dict]  # {top_k, depth, total_tokens, branching}; None: a chain
    draft_tokens: int  # draft tokens the target verifies per pass (chain: draft_len; tree: total_tokens)
    accepted_per_step: float  # mean accepted drafts per verify step (measured)
    draft_ms: float  # drafter ms per proposal (measured)
    verify_ms: float  # target ms per pass over draft_tokens + 1 tokens (the cost curve)
    predicted_speedup: float = 0.0

    @property
    def name(self) -> str:
        if self.tree is None:
            return f"chain draft_len={self.draft_len}"
        return f"tree top_k={self.tree['top_k']} depth={self.tree['depth']} total_tokens={self.tree['total_tokens']}"

    @property
    def predicted_tau(self) -> float:
        """Tokens per verify step (the run's tau without its prefill pass)."""
        return 1.0 + self.accepted_per_step

    def apply(self, cfg: EvalConfig) -> EvalConfig:
        """`cfg` decoding with this setting."""
        if self.tree is None:
            return replace(cfg, draft_len=self.draft_len, tree=TreeConfig())
        tree = TreeConfig(top_k=self.tree["top_k"], depth=self.tree["depth"], total_tokens=self.tree["total_tokens"])
        return replace(cfg, draft_len=self.draft_len, tree=tree)


def machine_info(device: torch.device, dtype: str) -> dict:
    """What the costs were measured on."""
    info = {"cpu": _cpu_model(), "cpu_features": _cpu_features(), "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": device_name(device), "dtype": dtype,
            "torch": torch.__version__, "platform": platform.platform(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}
    return info


def _cpuinfo(field: str) -> Optional[str]:
    """The first /proc/cpuinfo line's value for `field` (None off Linux or without it)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


# The instruction-set extensions that decide which CPU kernels are fast (fp32 FMA width, bf16 / AMX units)
_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpu_features() -> list[str]:
    flags = set((_cpuinfo("flags") or "").split())
    return [f for f in _FEATURES if f in flags]


@torch.inference_mode()
def verify_cost_curve(target: PreTrainedModel, prefix: Sequence[int], plain: Sequence[int], tree: Sequence[int],
                      repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of one target pass over n new tokens after the cached `prefix`, as the decoders run it: `plain`
    sizes as a chain pass (causal, no mask given), `tree` sizes as a tree pass (additive mask, explicit positions).
    Each repeat times every size once (after one untimed round), so load changes hit all sizes alike."""
    lm = CachedLM(target)
    lm.forward(as_tensor(prefix, lm.device), num_logits=1)
    past = lm.length
    keep = torch.arange(past, device=lm.device)
    tokens = as_tensor(list(prefix) * (max([*plain, *tree, 1]) // max(len(prefix), 1) + 1), lm.device)
    jobs = [("plain", n) for n in sorted(set(plain))] + [("tree", n) for n in sorted(set(tree))]
    times: dict[tuple[str, int], list[float]] = {job: [] for job in jobs}
    for r in range(repeats + 1):
        for kind, n in jobs:
            mask = attention_mask(torch.ones(n, n, dtype=torch.bool, device=lm.device).tril(), past, target.dtype)
            positions = torch.arange(past, past + n, device=lm.device)[None]
            synchronize(lm.device)
            start = time.perf_counter()
            if kind == "plain":
                lm.forward(tokens[:n], num_logits=n)
            else:
                lm.forward_tree(tokens[:n], mask, positions)
            synchronize(lm.device)
            if r:  # round 0 is the warm-up
                times[kind, n].append(1000 * (time.perf_counter() - start))
            lm.keep(keep)
    curve: dict[str, dict[int, float]] = {"plain": {}, "tree": {}}
    for (kind, n), values in times.items():
        curve[kind][n] = statistics.median(values)
    return curve


def chain_candidate(k: int, stats: DecodeStats, curve: dict) -> Candidate:
    return Candidate(k, None, k, stats.accepted / max(stats.proposals, 1), _draft_ms(stats), curve["plain"][k + 1])


def tree_candidates(spec: TreeSpec, stats: DecodeStats, sizes: Sequence[int], curve: dict) -> list[Candidate]:
    """Every size of one shape from its run: the tree of total_tokens = n is the run's n best nodes."""
    out = []
    for n in sizes:
        accepted = stats.accepted_within[n - 1] / max(stats.proposals, 1)
        tree = {"top_k": spec.top_k, "depth": spec.depth, "total_tokens": n, "branching": "topk"}
        out.append(Candidate(spec.depth, tree, n, accepted, _draft_ms(stats), curve["tree"][n + 1]))
    return out


def _draft_ms(stats: DecodeStats) -> float:
    return 1000 * stats.draft_seconds / max(stats.proposals, 1)


def tree_shapes(cal: CalibrationConfig) -> list[tuple[TreeSpec, list[int]]]:
    """(the shape run at its largest size, the sizes predicted from it) for every (top_k, depth) pair."""
    shapes = []
    for top_k in cal.tree_top_k:
        for depth in cal.tree_depth:
            spec = TreeSpec(top_k, depth)
            sizes = sorted(n for n in set(cal.tree_sizes) if depth <= n <= spec.candidates())
            if sizes:
                shapes.append((replace(spec, total_tokens=sizes[-1]), sizes))
    return shapes


RunFn = Callable[[EvalConfig], DecodeStats]


def calibrate(target: PreTrainedModel, prompts: Sequence[Sequence[int]], cfg: EvalConfig, decode: RunFn,
              progress: bool = True) -> tuple[list[Candidate], dict]:
    """Candidates ranked best first by predicted speedup, and the cost curve (see the module doc).

    decode(eval config) runs the speculative decoder over `prompts` with that setting and returns its stats.
    """
    cal = cfg.calibration
    shapes = tree_shapes(cal)
    typical = sorted(prompts, key=len)[len(prompts) // 2]  # a median-length prompt, half-way through its answer
    prefix = list(typical) + list(typical)[: (cal.max_new_tokens or cfg.max_new_tokens) // 2]
    curve = verify_cost_curve(target, prefix, [1] + [k + 1 for k in cal.draft_lens],
                              [n + 1 for _, sizes in shapes for n in sizes], cal.repeats)
    runs = [(TreeConfig(), k, []) for k in cal.draft_lens] + [
        (TreeConfig(top_k=spec.top_k, depth=spec.depth, total_tokens=spec.total_tokens), spec.depth, sizes)
        for spec, sizes in shapes]
    candidates: list[Candidate] = []
    for tree, k, sizes in tqdm(runs, desc="calibration runs", disable=not progress, unit="setting"):
        stats = decode(replace(cfg, draft_len=k, tree=tree))
        if tree.enabled:
            candidates += tree_candidates(TreeSpec(tree.top_k, k, tree.total_tokens), stats, sizes, curve)
        else:
            candidates.append(chain_candidate(k, stats, curve))
    ar_ms = curve["plain"][1]
    for c in candidates:
        c.predicted_speedup = c.predicted_tau * ar_ms / (c.draft_ms + c.verify_ms)
    candidates.sort(key=lambda c: -c.predicted_speedup)
    return candidates, {"prefix_len": len(prefix), "verify_cost_ms": curve, "ar_ms_per_token": ar_ms}


def calibration_record(candidates: list[Candidate], costs: dict, measured: dict, info: dict) -> dict:
    """What calibration.json holds: the machine, the cost curve, every candidate, the pick and its measurement."""
    pick = candidates[0]
    return {
        "format": "drafter-calibration/1",
        "measured_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **info,
        **costs,
        "candidates": [{"name": c.name, **asdict(c), "predicted_tau": c.predicted_tau} for c in candidates],
        "pick": {"name": pick.name, "draft_len": pick.draft_len, "tree": pick.tree,
                 "predicted_speedup": pick.predicted_speedup, "predicted_tau": pick.predicted_tau,
                 "measured_speedup": measured["speedup"], "measured_tau": measured["tau"],
                 "measured_on": f"{measured['num_prompts']} prompts x up to {measured['max_new_tokens']} new tokens"},
    }
