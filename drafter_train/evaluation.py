"""Plain and speculative decoding of the same prompts, side by side in one process: the one implementation of the
headline numbers (tau, acceptance, per-position acceptance, speedup). `drafter-eval` (recipes/evaluate.py), every
training checkpoint and layer-skip's search call `evaluate_decoding`; `drafter-compare` calls
`evaluate_side_by_side`, several speculative decoders against one plain decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from drafter_train.config import EvalConfig, check_side_by_side
from drafter_train.decoding.autoregressive import DecodeResult, generate_autoregressive
from drafter_train.decoding.draft_exit import DraftExit, supports_draft_exit
from drafter_train.decoding.drafter import Drafter
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative, lookup_len, tree_stats
from drafter_train.decoding.stats import DecodeStats
from drafter_train.decoding.tree import TreeSpec
from drafter_train.decoding.verify import make_tree_verifier, make_verifier
from drafter_train.decoding.lookup import lookup_first
from drafter_train.devices import on_cpu, synchronize
from drafter_train.cpu_kernels import CPU_KERNELS, KernelState, apply_kernel_state, kernel_states, kernels_in_use
from drafter_train.errors import ConfigError
from drafter_train.machine import describe_usable
from drafter_train.targets import check_full_cache


def check_decoder(target: PreTrainedModel, cfg: EvalConfig) -> None:
    """What the configured decoder needs of the target, refused in one line before any decoding."""
    if cfg.tree.enabled:
        check_full_cache(target, "eval.tree (draft trees)")


def sampling_params(cfg: EvalConfig) -> SamplingParams:
    """verify=sample and spectr sample at the configured temperature; greedy and specdec decode greedily."""
    if cfg.samples:
        return SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    return SamplingParams()


def tree_spec(cfg: EvalConfig) -> Optional[TreeSpec]:
    """eval.tree as the decoder's TreeSpec (None: a chain)."""
    if not cfg.tree.enabled:
        return None
    return TreeSpec(cfg.tree.top_k, cfg.tree_depth, cfg.tree.total_tokens, cfg.tree.branching)


def tree_record(cfg: EvalConfig) -> Optional[dict]:
    """What metrics.json records of the tree (total_tokens resolved: the draft nodes of a full-depth tree)."""
    spec = tree_spec(cfg)
    if spec is None:
        return None
    return {"top_k": spec.top_k, "depth": spec.depth, "total_tokens": spec.nodes(), "branching": spec.branching}


def speculative_runner(target: PreTrainedModel, drafter: Drafter, cfg: EvalConfig, eos_token_ids: Sequence[int]):
    """(run(prompt, seed, draft exit) -> DecodeResult, new empty DecodeStats of the same shape) for eval's chain or
    tree."""
    params, spec = sampling_params(cfg), tree_spec(cfg)
    if spec is None:
        verifier = make_verifier(cfg.verify, params, cfg.specdec_top_beta, cfg.specdec_tolerance)

        def run(prompt, seed, exit: Optional[DraftExit] = None):
            gen = torch.Generator(device=target.device).manual_seed(seed)
            return generate_speculative(target, drafter, prompt, cfg.draft_len, verifier, cfg.max_new_tokens, params,
                                        eos_token_ids, gen, exit)

        return run, lambda: DecodeStats(draft_len=cfg.draft_len)
    tree_verifier = make_tree_verifier(cfg.verify, params)

    def run_tree(prompt, seed, exit: Optional[DraftExit] = None):  # draft exit is for chains (config checks it)
        gen = torch.Generator(device=target.device).manual_seed(seed)
        return generate_tree_speculative(target, drafter, prompt, spec, tree_verifier, cfg.max_new_tokens, params,
                                         eos_token_ids, gen)

    return run_tree, lambda: tree_stats(spec, lookup_len(drafter, spec))


def _timed(fn, device: torch.device) -> tuple[DecodeResult, float]:
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


@torch.inference_mode()
def divergence_margin(target: PreTrainedModel, prompt: Sequence[int], ar: list[int], spec: list[int]) -> float:
    """Target's top-1 minus top-2 logit at the first position where the two greedy outputs differ.

    Lossless greedy verification can only disagree with AR decoding where the target's own logits differ between a
    1-token and a (k+1)-token forward (rounding, mostly in bfloat16) and that difference flips a near-tie; a margin
    at the level of the dtype's rounding error shows that is what happened.
    """
    first = next((i for i, (a, b) in enumerate(zip(ar, spec)) if a != b), min(len(ar), len(spec)))
    ids = torch.tensor([list(prompt) + ar[:first]], device=target.device)
    top2 = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float().topk(2).values
    return float(top2[0] - top2[1])


@torch.inference_mode()
def target_logprob_sum(target: PreTrainedModel, prompt: Sequence[int], tokens: list[int]) -> float:
    """Sum of the target's log-probabilities (float32) of `tokens` after `prompt`: how likely it finds the output."""
    ids = torch.tensor([list(prompt) + tokens], device=target.device)
    logits = target(input_ids=ids, logits_to_keep=len(tokens) + 1).logits[0, :-1].float()
    return float(logits.log_softmax(-1).gather(-1, ids[0, -len(tokens):, None]).sum())


def make_draft_exit(cfg: EvalConfig, drafter: Drafter) -> Optional[DraftExit]:
    """eval.draft_exit's threshold state, or None when off; refused in one line for one-pass drafters."""
    if not cfg.draft_exit:
        return None
    if not supports_draft_exit(drafter):
        raise ConfigError(
            f"eval.draft_exit: {type(drafter).__name__} does not draft token by token; draft exit applies to "
            "autoregressive drafters (ar, eagle3, layerskip)"
        )
    return DraftExit(cfg.draft_exit, adapt=cfg.draft_exit_adapt, target=cfg.draft_exit_target)


def baseline_settings(target: PreTrainedModel, baseline_kernels: str, kernels: str) -> tuple[str, ...]:
    """The CPU kernel settings plain decoding is timed on, `kernels` (the speculative run's own) first: every setting
    with eval.baseline_kernels=all on a CPU target, else `kernels` alone (off the CPU the setting changes nothing)."""
    if baseline_kernels == "same" or not on_cpu(target.device):
        return (kernels,)
    return (kernels, *(k for k in CPU_KERNELS if k != kernels))


def baseline_states(target: PreTrainedModel, baseline_kernels: str,
                    kernels: Optional[str] = None) -> tuple[str, dict[str, KernelState]]:
    """(the speculative run's kernel setting, {setting: its KernelState} for every setting plain decoding is timed
    on, that one first). `kernels` None: read off the target (cpu_kernels.kernels_in_use); the target is left on it."""
    kernels = kernels or kernels_in_use(target)
    return kernels, kernel_states(target, kernels, baseline_settings(target, baseline_kernels, kernels))


def time_interleaved(i: int, settings: Sequence[str], ready_spec: Callable[[], Callable[[], DecodeResult]],
                     ready_ar: Callable[[str], Callable[[], DecodeResult]], device: torch.device):
    """Request i timed as (spec (result, seconds), {setting: plain decoding's (result, seconds)}): time_side_by_side
    with one speculative decoder."""
    (spec,), ar = time_side_by_side(i, settings, [ready_spec], ready_ar, device)
    return spec, ar


def time_side_by_side(i: int, settings: Sequence[str], ready_specs: Sequence[Callable[[], Callable[[], DecodeResult]]],
                      ready_ar: Callable[[str], Callable[[], DecodeResult]], device: torch.device):
    """Request i timed as ([each speculative decoder's (result, seconds)], {setting: plain decoding's (result,
    seconds)}), interleaved so that load changes hit every decoder alike: whether the speculative decoders or plain
    decoding go first alternates request by request, and the speculative decoders and the plain-decoding settings
    each take turns going first. `ready_*` switch the target's kernels (untimed) and return the decode to time."""
    order = tuple(settings[i % len(settings):]) + tuple(settings[:i % len(settings)])
    n = len(ready_specs)
    turn = [(j + i) % n for j in range(n)]
    if i % 2:
        spec = {j: _timed(ready_specs[j](), device) for j in turn}
    ar = {k: _timed(ready_ar(k), device) for k in order}
    if not i % 2:
        spec = {j: _timed(ready_specs[j](), device) for j in turn}
    return [spec[j] for j in range(n)], ar


@dataclass
class Tally:
    """Summed over prompts: the speculative run's counters and seconds, and plain decoding's per kernel setting."""

    spec: DecodeStats
    spec_time: float = 0.0
    ar: dict = field(default_factory=dict)  # kernel setting -> DecodeStats
    ar_time: dict = field(default_factory=dict)  # kernel setting -> seconds

    def add(self, spec: tuple[DecodeResult, float], ar: dict) -> None:
        """One prompt: (result, seconds) of the speculative run and, per kernel setting, of plain decoding."""
        self.spec.merge(spec[0].stats)
        self.spec_time += spec[1]
        for kernels, (result, seconds) in ar.items():
            self.ar.setdefault(kernels, DecodeStats()).merge(result.stats)
            self.ar_time[kernels] = self.ar_time.get(kernels, 0.0) + seconds

    @property
    def spec_tokens_per_s(self) -> float:
        return self.spec.tokens_generated / self.spec_time

    def ar_tokens_per_s(self) -> dict[str, float]:
        return {k: self.ar[k].tokens_generated / self.ar_time[k] for k in self.ar}

    def fastest(self) -> str:
        """The kernel setting of the fastest plain decoding (ties: the first timed, the speculative run's own)."""
        tps = self.ar_tokens_per_s()
        return max(tps, key=tps.get)


def evaluate_decoding(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt_ids: Sequence[Sequence[int]],
    cfg: EvalConfig,
    eos_token_ids: Sequence[int],
    progress: bool = True,
    categories: Optional[Sequence[Optional[str]]] = None,
    kernels: Optional[str] = None,
) -> dict:
    """Decode every prompt with plain (AR) decoding on every CPU kernel setting (eval.baseline_kernels) and
    speculatively on the target's own setting, interleaved, and divide by the fastest plain decoding.

    `kernels`: the target.cpu_kernels setting the target was loaded with (None: read off the target,
    cpu_kernels.kernels_in_use); the speculative run keeps exactly that state, and the target is left in it.
    Returns the metrics defined in docs/evaluate.md ("Definitions"): tau, acceptance_rate, per_position_acceptance,
    speedup, baseline, ... and, when prompts have task categories, the same headline numbers per category.
    """
    return evaluate_side_by_side(target, {"": (drafter, cfg)}, prompt_ids, eos_token_ids, progress, categories,
                                 kernels)[""]


@dataclass
class _Decoder:
    """One speculative decoder of a side-by-side evaluation and what it has counted so far."""

    drafter: Drafter
    cfg: EvalConfig
    run: Callable
    total: Tally
    new_stats: Callable[[], DecodeStats]
    draft_exit: Optional[DraftExit] = None
    by_category: dict = field(default_factory=dict)
    matches: int = 0
    margins: list = field(default_factory=list)
    outside: int = 0  # tokens of plain decoding outside a reduced draft vocabulary (EAGLE-3's)
    logprob: dict = field(default_factory=lambda: {"spec": 0.0, "ar": 0.0})  # verify=specdec


def evaluate_side_by_side(
    target: PreTrainedModel,
    decoders: dict[str, tuple[Drafter, EvalConfig]],
    prompt_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    progress: bool = True,
    categories: Optional[Sequence[Optional[str]]] = None,
    kernels: Optional[str] = None,
) -> dict[str, dict]:
    """evaluate_decoding for several speculative decoders (name -> (drafter, its eval config)) on the same prompts
    against one plain decoding: per prompt, plain decoding runs once per CPU kernel setting and every decoder once,
    interleaved (time_side_by_side), so their speedups are ratios measured side by side and plain decoding is paid once
    instead of once per decoder. The configs must agree on what plain decoding depends on (check_side_by_side).
    Returns each decoder's metrics, as evaluate_decoding returns them."""
    check_side_by_side({name: cfg for name, (_, cfg) in decoders.items()})
    base = next(iter(decoders.values()))[1]
    params = sampling_params(base)
    kernels, states = baseline_states(target, base.baseline_kernels, kernels)
    settings = tuple(states)

    # ready_*: switch the target to the decoder's kernels (untimed), return the decode to time
    def ready_ar(prompt, seed, setting: str):
        apply_kernel_state(target, states[setting])
        gen = torch.Generator(device=target.device).manual_seed(seed)
        # The baseline decodes with the same params: AR greedy for greedy/specdec, AR sampling for sample/spectr.
        return lambda: generate_autoregressive(target, prompt, base.max_new_tokens, params, eos_token_ids, gen)

    def ready_spec(one: _Decoder, prompt, seed):
        apply_kernel_state(target, states[kernels])
        return lambda: one.run(prompt, seed, one.draft_exit)

    runs = {}
    for name, (drafter, cfg) in decoders.items():
        drafter = lookup_first(drafter, cfg.lookup)
        run, new_stats = speculative_runner(target, drafter, cfg, eos_token_ids)
        runs[name] = _Decoder(drafter, cfg, run, Tally(new_stats()), new_stats)
    try:
        for _ in range(base.warmup):  # untimed, every decoder: first calls pay allocator and kernel-selection costs
            for setting in settings:
                ready_ar(prompt_ids[0], base.seed, setting)()
            for one in runs.values():
                one.draft_exit = make_draft_exit(one.cfg, one.drafter)
                ready_spec(one, prompt_ids[0], base.seed)()
        for one in runs.values():  # one adaptive threshold per decoder for the whole run (as a server would keep
            one.draft_exit = make_draft_exit(one.cfg, one.drafter)  # it), fresh after the warm-up
        shapes = " | ".join(tree_spec(o.cfg).describe() if o.cfg.tree.enabled else f"draft_len={o.cfg.draft_len}"
                            for o in runs.values())
        bar = tqdm(prompt_ids, desc=f"eval {shapes} {base.verify}", disable=not progress, unit="prompt")
        for i, prompt in enumerate(bar):
            seed = base.seed + i
            specs, ar_runs = time_side_by_side(i, settings, [lambda o=o: ready_spec(o, prompt, seed)
                                                             for o in runs.values()],
                                               lambda k: ready_ar(prompt, seed, k), target.device)
            apply_kernel_state(target, states[kernels])  # what follows (margins, log-likelihoods): the own kernels
            for one, (spec, t_spec) in zip(runs.values(), specs):
                _count(one, target, prompt, (spec, t_spec), ar_runs, ar_runs[kernels][0],
                       None if categories is None else categories[i])
            fastest_tps = max(next(iter(runs.values())).total.ar_tokens_per_s().values())
            bar.set_postfix(tau="/".join(f"{o.total.spec.tau:.2f}" for o in runs.values()),
                            speedup="/".join(f"{o.total.spec_tokens_per_s / fastest_tps:.2f}" for o in runs.values()))
    finally:
        apply_kernel_state(target, states[kernels])
    return {name: _metrics(one, kernels, settings, len(prompt_ids)) for name, one in runs.items()}


def _count(one: _Decoder, target: PreTrainedModel, prompt, spec: tuple[DecodeResult, float], ar_runs: dict,
           ar: DecodeResult, category: Optional[str]) -> None:
    """Add one prompt's runs to a decoder's tally; `ar`: plain decoding on the speculative run's own kernels, which
    losslessness is judged against."""
    one.total.add(spec, ar_runs)
    if category is not None:
        one.by_category.setdefault(category, Tally(one.new_stats())).add(spec, ar_runs)
    result = spec[0]
    one.matches += result.tokens == ar.tokens
    draft_vocab = getattr(one.drafter, "draft_vocab", None)  # a reduced draft vocabulary can never propose the rest
    if draft_vocab is not None:
        one.outside += int((~draft_vocab[torch.tensor(ar.tokens, device=draft_vocab.device)]).sum())
    if result.tokens != ar.tokens and one.cfg.verify == "greedy":
        one.margins.append(divergence_margin(target, prompt, ar.tokens, result.tokens))
    if one.cfg.verify == "specdec":
        one.logprob["spec"] += target_logprob_sum(target, prompt, result.tokens)
        one.logprob["ar"] += target_logprob_sum(target, prompt, ar.tokens)


def _metrics(one: _Decoder, kernels: str, settings: Sequence[str], num_prompts: int) -> dict:
    """A decoder's metrics (docs/evaluate.md "Definitions")."""
    cfg, total = one.cfg, one.total
    spec_stats, fastest, own_ar = total.spec, total.fastest(), total.ar[kernels]
    draft_vocab = getattr(one.drafter, "draft_vocab", None)
    return {
        **spec_stats.summary(),
        # The most drafts one verify pass can accept along a path = len(per_position_acceptance): a chain's
        # eval.draft_len; a tree's depth; with a lookup ahead, the longer of that and the lookup's chains.
        "draft_len": spec_stats.draft_len,
        # The tree's shape (top_k, depth, total_tokens: draft nodes per pass, branching); None for a chain.
        "tree": tree_record(cfg),
        "verify": cfg.verify,
        # Adaptive draft exit: the threshold γ at the start and at the end of the run (None: off). Without
        # eval.draft_exit a drafter may carry its own fixed γ (a searched layerskip folder).
        "draft_exit": cfg.draft_exit or getattr(one.drafter, "exit_below", 0.0) or None,
        "draft_exit_final": None if one.draft_exit is None else one.draft_exit.threshold,
        "num_prompts": num_prompts,
        **baseline_fields(total, kernels, settings),
        # Share of prompts whose speculative output is token-identical to plain decoding's on the same kernels: must
        # be 1.0 for greedy (lossless); for specdec it measures how far the relaxation moves the output; not defined
        # when sampling (two independent samples).
        "greedy_match": None if cfg.samples else one.matches / num_prompts,
        # For each greedy mismatch: the target's top-1 minus top-2 logit where the outputs part (near 0 = a tie
        # broken differently by rounding; see divergence_margin).
        "greedy_mismatch_margins": one.margins,
        # Share of the AR output's tokens outside the drafter's draft vocabulary (None: it drafts the full vocabulary).
        "out_of_draft_vocab": None if draft_vocab is None else one.outside / own_ar.tokens_generated,
        # The headline numbers per task category of the prompts, against the same (overall fastest) kernel setting.
        "per_category": {name: _headline(group, fastest) for name, group in sorted(one.by_category.items())},
        # verify=specdec only: the target's mean log-likelihood per generated token of the speculative output and of
        # the AR greedy output (the relaxation accepts tokens the target ranks lower: the first falls below the second).
        "spec_target_logprob": (one.logprob["spec"] / spec_stats.tokens_generated if cfg.verify == "specdec"
                                else None),
        "ar_target_logprob": one.logprob["ar"] / own_ar.tokens_generated if cfg.verify == "specdec" else None,
    }


def baseline_fields(total: Tally, kernels: str, settings: Sequence[str]) -> dict:
    """The speed figures of a run (docs/evaluate.md "Definitions"): the speedup over the fastest plain decoding of
    `settings`, over plain decoding on the speculative run's own `kernels`, and which setting was the divisor."""
    fastest, ar_tps = total.fastest(), total.ar_tokens_per_s()
    return {
        # ar_*: the baseline, plain decoding on the fastest kernel setting timed.
        "ar_tokens_generated": total.ar[fastest].tokens_generated,
        "spec_time_s": total.spec_time,
        "ar_time_s": total.ar_time[fastest],
        "spec_tokens_per_s": total.spec_tokens_per_s,
        "ar_tokens_per_s": ar_tps[fastest],
        "speedup": total.spec_tokens_per_s / ar_tps[fastest],
        # The speculative run's kernel setting (target.cpu_kernels), and the speedup over plain decoding on it.
        "spec_kernels": kernels,
        "speedup_same_kernels": total.spec_tokens_per_s / ar_tps[kernels],
        # Which plain decoding is the divisor: the fastest kernel setting, and every setting timed.
        "baseline": {"kernels": fastest, "tokens_per_s": ar_tps[fastest], "by_kernels": {
            k: {"tokens_per_s": ar_tps[k], "time_s": total.ar_time[k], "tokens_generated": total.ar[k].tokens_generated}
            for k in settings}},
    }


def _headline(group: Tally, baseline: str) -> dict:
    """tau, acceptance and speedup over plain decoding on the `baseline` kernel setting, for one group of prompts."""
    return {"tau": group.spec.tau, "acceptance_rate": group.spec.acceptance_rate,
            "speedup": group.spec_tokens_per_s / group.ar_tokens_per_s()[baseline],
            "tokens_generated": group.spec.tokens_generated}


def print_table(metrics: dict, console: Optional[Console] = None, title: str = "drafter-eval") -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("tau", "acceptance_rate", "speedup", "spec_tokens_per_s", "ar_tokens_per_s", "speedup_same_kernels",
                "greedy_match", "spec_target_logprob", "ar_target_logprob"):
        value = metrics.get(key)
        table.add_row(key, "-" if value is None else f"{value:.3f}")
    baseline = metrics["baseline"]  # what the speedup divides by, and what it was chosen from
    timed = ", ".join(f"{k} {b['tokens_per_s']:.1f}" for k, b in baseline["by_kernels"].items())
    table.add_row("baseline", f"plain decoding on {baseline['kernels']} kernels, the fastest of {timed} tok/s"
                  if len(baseline["by_kernels"]) > 1 else f"plain decoding on {baseline['kernels']} kernels only")
    table.add_row("speculative kernels", metrics["spec_kernels"])
    table.add_row("per_position_acceptance", " ".join(f"{a:.2f}" for a in metrics["per_position_acceptance"]))
    table.add_row("tokens / target passes", f"{metrics['tokens_generated']} / {metrics['target_forward_passes']}")
    if metrics.get("out_of_draft_vocab") is not None:
        table.add_row("out_of_draft_vocab", f"{metrics['out_of_draft_vocab']:.3f}")
    for name, numbers in metrics.get("per_category", {}).items():
        # escaped: rich reads "[name]" as markup and would print nothing of it
        table.add_row(escape(f"[{name}] tau / speedup"), f"{numbers['tau']:.3f} / {numbers['speedup']:.3f}")
    machine = metrics.get("machine")
    if machine:  # what the speedup was measured on: it depends on the CPU and the kernels chosen for it
        table.add_row("machine", f"{machine['cpu']} ({describe_usable(machine)}), {machine['torch_threads']} threads")
        table.add_row("target kernels by rows", machine["target_kernels_by_rows"] or machine["cpu_kernels"])
    (console or Console(stderr=True)).print(table)


def calibration_decoder(target, drafter: Drafter, prompts, eos: Sequence[int], base: EvalConfig):
    """decode(eval config) -> DecodeStats over the calibration prompts (the first call pays an untimed warm-up)."""
    warm = []

    def decode(cfg: EvalConfig) -> DecodeStats:
        run, new_stats = speculative_runner(target, drafter, replace(
            cfg, max_new_tokens=base.calibration.max_new_tokens or base.max_new_tokens), eos)
        if not warm:
            warm.append(run(prompts[0], base.seed))
        stats = new_stats()
        for i, prompt in enumerate(prompts):
            stats.merge(run(prompt, base.seed + i).stats)
        return stats

    return decode


def print_calibration(record: dict, console: Optional[Console] = None, rows: int = 10) -> None:
    """The best predicted settings, then the pick's predicted and measured speedup side by side."""
    table = Table(title=f"calibration on {record['machine']['cpu']} ({record['machine']['device']}, "
                        f"{record['machine']['torch_threads']} threads)")
    for column in ("setting", "predicted tau", "drafter ms", "verify ms", "predicted speedup"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for c in record["candidates"][:rows]:
        table.add_row(c["name"], f"{c['predicted_tau']:.2f}", f"{c['draft_ms']:.1f}", f"{c['verify_ms']:.1f}",
                      f"{c['predicted_speedup']:.3f}")
    pick = record["pick"]
    console = console or Console(stderr=True)
    console.print(table)
    console.print(f"pick: {pick['name']}: predicted speedup {pick['predicted_speedup']:.3f}, measured "
                  f"{pick['measured_speedup']:.3f} (tau predicted {pick['predicted_tau']:.2f}, measured "
                  f"{pick['measured_tau']:.2f}; AR pass {record['ar_ms_per_token']:.1f} ms; both over "
                  f"{pick.get('baseline', 'plain decoding')})")
    if "fastest_baseline" in pick:
        console.print(f"over {pick['fastest_baseline']}, the fastest timed: predicted "
                      f"{pick['predicted_speedup_over_fastest']:.3f}, measured {pick['measured_speedup_over_fastest']:.3f}")
    if record.get("engines"):
        print_engine_predictions(record["engines"], console)


def print_engine_predictions(rows: Sequence[dict], console: Console) -> None:
    """The chain candidates' predicted speedup in other engines (their cost curves, this drafter's tau)."""
    table = Table(title="other engines: predicted speedup over their plain decoding")
    table.add_column("engine", no_wrap=True)
    # draft_len; predicted tau; verify and drafter cost in 1-token passes; the tau that breaks even and the
    # per-position acceptance that gives it ("-": beyond a chain of that length)
    for column in ("k", "tau", "verify", "drafter", "even at", "needs", "speedup"):
        table.add_column(column, justify="right")
    for r in rows:
        need = "-" if r["acceptance_needed"] is None else f"{r['acceptance_needed']:.2f}"
        table.add_row(escape(f"{r['engine']} {r['precision'] or ''}".strip()), str(r["draft_len"]),
                      f"{r['predicted_tau']:.2f}", f"{r['verify_cost']:.2f}", f"{r['draft_cost']:.2f}",
                      f"{r['break_even_tau']:.2f}", need, f"{r['predicted_speedup']:.3f}")
    console.print(table)
