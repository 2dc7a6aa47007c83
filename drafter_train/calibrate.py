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
3. predicts each candidate's speedup over AR decoding on the same kernels (predicted_speedup):
       speedup = tau / (verify cost at drafts + 1 + drafter cost),   tau = 1 + accepted drafts per step,
   both costs relative to one 1-token pass (cost(n) / cost(1), drafter ms per proposal / cost(1)); per-step
   bookkeeping of both decoders is left out;
4. picks the best; evaluate.py then decodes the evaluation prompts with it for real and prints predicted next to
   measured, and calibration.json records the pick and the machine (drafter-export puts both in the model card).
   Predicted and measured divide by the same plain decoding: the target's own kernels (target.cpu_kernels), on
   which the cost curve was measured. The speedup over the fastest plain decoding (eval.baseline_kernels) is
   recorded beside them, with the prediction rescaled by the two plain decoders' measured ratio.

The same formula predicts other engines from their own cost curves (benchmarks/engines.py measures llama.cpp's):
break_even_tau says what tau speculation needs there, acceptance_needed what per-position acceptance gives it.

Nothing is cached between runs: the curve takes seconds to measure, and a stored one goes stale silently when the
load, the thread count or the libraries change.
"""

from __future__ import annotations

import datetime
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from drafter_train.config import CalibrationConfig, EvalConfig, TreeConfig
from drafter_train.decoding.cached_lm import CachedLM, as_tensor
from drafter_train.decoding.stats import DecodeStats
from drafter_train.decoding.tree import TreeSpec, attention_mask
from drafter_train.devices import synchronize


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


def relative_costs(curve_ms: Mapping[int, float]) -> dict[int, float]:
    """A verify-cost curve (n -> ms of one target pass over n tokens) relative to its 1-token pass."""
    return {n: ms / curve_ms[1] for n, ms in sorted(curve_ms.items())}


def predicted_speedup(tau: float, verify_cost: float, draft_cost: float) -> float:
    """Speculative decoding's speedup over plain decoding in the same engine.

    tau: tokens per target pass (1 + accepted drafts per step); verify_cost: one pass over the step's draft tokens
    + 1, relative to a 1-token pass (the engine's cost curve); draft_cost: the drafter's work per step relative to
    a 1-token pass. Plain decoding makes 1 token per 1-token pass."""
    return tau / (verify_cost + draft_cost)


def cost_at(relative: Mapping[int, float], n: int) -> float:
    """The relative cost of a pass over n tokens: measured, or linear between the nearest measured sizes (flat beyond
    the largest)."""
    if n in relative:
        return relative[n]
    below = max((m for m in relative if m < n), default=min(relative))
    above = min((m for m in relative if m > n), default=None)
    if above is None:
        return relative[below]
    return relative[below] + (relative[above] - relative[below]) * (n - below) / (above - below)


def predicted_steps_speedup(tokens: int, plain_passes: int, drafted: Sequence[int], relative: Mapping[int, float],
                            draft_cost: float) -> float:
    """predicted_speedup for a run whose steps differ (lookups that found nothing, drafts cut at the end): `tokens`
    made by `plain_passes` one-token passes plus one pass over d + 1 tokens per drafting step (d in `drafted`), and
    `draft_cost` of drafting over the whole run, in 1-token passes. With every step drafting k it is
    tau / (cost(k + 1) + draft_cost per step)."""
    cost = plain_passes + sum(cost_at(relative, d + 1) for d in drafted) + draft_cost
    return tokens / cost


def break_even_tau(verify_cost: float, draft_cost: float) -> float:
    """The tau at which predicted_speedup is 1: below it speculation loses to plain decoding in that engine."""
    return verify_cost + draft_cost


def chain_tau(acceptance: float, draft_len: int) -> float:
    """tau of a chain of draft_len drafts when each draft is accepted with probability `acceptance` given the ones
    before it were: 1 + a + a^2 + ... + a^draft_len."""
    return sum(acceptance ** i for i in range(draft_len + 1))


def acceptance_needed(tau: float, draft_len: int) -> Optional[float]:
    """The per-position acceptance (the same at every position) at which a chain of draft_len reaches `tau`; None
    when no acceptance can (tau > draft_len + 1). chain_tau rises with acceptance, so bisection finds it."""
    if tau > draft_len + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if chain_tau(mid, draft_len) < tau else (low, mid)
    return (low + high) / 2


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
        c.predicted_speedup = predicted_speedup(c.predicted_tau, c.verify_ms / ar_ms, c.draft_ms / ar_ms)
    candidates.sort(key=lambda c: -c.predicted_speedup)
    return candidates, {"prefix_len": len(prefix), "verify_cost_ms": curve, "ar_ms_per_token": ar_ms}


SERVER_STEP_KINDS = ("eagle3", "ngram", "ar")  # which of llama-server's measured verify steps stands for a drafter's


def engine_costs(record: dict) -> list[dict]:
    """The verify-cost curves in a benchmarks/engines.py result file (its data.cost_curves): engine, precision,
    ms of a 1-token pass and the relative cost by n (JSON's string keys made ints). Where the file has llama-server's
    own verify step (curve["server"], drafter_train/engines/llamacpp_cost.py: logits at every position and the drafter's work
    on the verify batch, which llama-bench's pass leaves out), that step is the curve: its EAGLE-3 step first, else
    its n-gram (verify only), else its draft-model step; `source` says which."""
    out = []
    for c in (record.get("data") or {}).get("cost_curves", []):
        kinds = (c.get("server") or {}).get("kinds", {})
        kind = next((k for k in SERVER_STEP_KINDS if k in kinds), None)
        relative = kinds[kind]["relative"] if kind else c["relative"]
        out.append(dict(c, relative={int(n): v for n, v in relative.items()},
                        source=f"llama-server {kind} step" if kind else "pass curve"))
    return out


def engine_predictions(candidates: Sequence[Candidate], ar_ms: float, curves: Sequence[dict]) -> list[dict]:
    """Each chain candidate's predicted speedup in every engine whose cost curve covers its pass (engines verify
    chains, not trees): this drafter's measured tau, the engine's verify cost at draft_len + 1, and the drafter's
    cost taken as the same share of a 1-token target pass as measured here. Also the tau that would break even
    there and the per-position acceptance that reaches it (None: beyond a chain of that length). Best first per
    engine."""
    out = []
    for curve in curves:
        rows = []
        for c in candidates:
            sizes = curve["relative"]
            if c.tree is not None or not min(sizes) <= c.draft_tokens + 1 <= max(sizes):
                continue
            verify = cost_at(sizes, c.draft_tokens + 1)  # measured, or between the nearest measured sizes
            draft = c.draft_ms / ar_ms
            need = break_even_tau(verify, draft)
            rows.append({"engine": curve["engine"], "precision": curve.get("precision"), "name": c.name,
                         "draft_len": c.draft_len, "predicted_tau": c.predicted_tau, "verify_cost": verify,
                         "draft_cost": draft, "break_even_tau": need,
                         "acceptance_needed": acceptance_needed(need, c.draft_len),
                         "predicted_speedup": predicted_speedup(c.predicted_tau, verify, draft)})
        out += sorted(rows, key=lambda r: -r["predicted_speedup"])
    return out


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
                 "measured_tau": measured["tau"], **measured_speedups(pick.predicted_speedup, measured),
                 "measured_on": f"{measured['num_prompts']} prompts x up to {measured['max_new_tokens']} new tokens"},
    }


def measured_speedups(predicted: float, measured: dict) -> dict:
    """The pick's measured speedup over the baseline its prediction models (plain decoding on the target's own
    kernels, where the cost curve was measured), and both figures over the fastest plain decoding timed (the
    prediction rescaled by the measured ratio of the two plain decoders)."""
    kernels = measured.get("spec_kernels")
    baseline = measured.get("baseline") or {}
    by_kernels = baseline.get("by_kernels") or {}
    if kernels not in by_kernels:  # one plain decoding timed: it is both baselines
        return {"measured_speedup": measured["speedup"], "baseline": "plain decoding, the same kernels",
                "measured_speedup_over_fastest": measured["speedup"], "predicted_speedup_over_fastest": predicted}
    ratio = by_kernels[kernels]["tokens_per_s"] / baseline["tokens_per_s"]
    return {"measured_speedup": measured["speedup_same_kernels"],
            "baseline": f"plain decoding on {kernels} kernels (the target's own, where the cost curve was measured)",
            "measured_speedup_over_fastest": measured["speedup"],
            "predicted_speedup_over_fastest": predicted * ratio,
            "fastest_baseline": f"plain decoding on {baseline['kernels']} kernels"}
