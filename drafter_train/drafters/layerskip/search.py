"""`drafter-train drafter=layerskip`: search the sub-layers a self-speculative drafter skips, run like training.

Bayesian optimisation with optuna's TPE sampler over one skip flag per attention and per MLP sub-layer of the
target's layers 1 .. L-2 (the first and last always run). Each trial is scored without decoding (SWIFT, ICLR 2025):

    alpha  = share of positions of target-generated text (train.data_dir's responses) where the skipping model's
             argmax, from ONE parallel forward with the skips (no cache), equals the full target's
    c      = share of the target's per-token cost kept: the parameters of the kept sub-layers plus the LM head, over
             all of them (what a batch-1 forward reads from memory)
    objective = max over k <= drafter.draft_len of (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))
                the expected speedup of k drafts per target pass (Leviathan et al.; the verify pass costs one
                target pass), at the best k (adaptive draft exit shortens proposals where drafting does not pay);
                0 for the empty skip set (drafting with the whole target never pays)

The first trials are the configured skip set (if any) and a few middle-layer skip sets (prior_skip_sets), so TPE's
first model sees drafters that work. At the end the drafter.search_confirm best trials are decoded for real
(the evaluator: AR baseline and speculative decoding on the eval prompts, eval.draft_exit as configured) and the
fastest is written as the run's checkpoint: a drafter folder any command loads like a trained drafter.

Resumable: trials live in an optuna journal in the run folder; a rerun continues after the last completed trial (a
trial cut off by a kill is marked failed and drawn again). Deterministic under train.seed: trial n's sampler is
seeded from (train.seed, n) and sees the same n completed trials whether or not the search was interrupted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import optuna
import torch
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState, create_trial
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from drafter_train.checkpoint import check_same_run, mark_best, prepare_run_dir, save_checkpoint, save_run_config
from drafter_train.config import TrainJobConfig
from drafter_train.drafters.layerskip.config import LayerSkipDrafterConfig
from drafter_train.cpu_kernels import stock_kernels
from drafter_train.data.batches import collate
from drafter_train.drafters.common.distill import head_at
from drafter_train.distributed import make_accelerator
from drafter_train.drafters.layerskip.model import decoder_layers, new_model, skipping, target_fingerprint
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.evaluation import evaluate_decoding
from drafter_train.data.prompts import split_name
from drafter_train.data.overlap import check_eval_overlap
from drafter_train.data.training_data import eval_prompt_ids, eval_prompt_texts, eval_prompts_path, load_training_data
from drafter_train.targets import check_full_cache, eos_token_ids, load_target, model_identity
from drafter_train.tracking import RunLogger, log_with

JOURNAL = "search.journal"
STUDY = "layerskip"
# Settings a rerun may change without starting another search (more trials, more confirmations).
RESUMABLE_CHANGES = ("drafter.search_trials", "drafter.search_confirm")
_FLAG = CategoricalDistribution([False, True])


@dataclass(frozen=True)
class SkipSet:
    attn: tuple[int, ...]
    mlp: tuple[int, ...]

    def params(self, layers: Sequence[int]) -> dict:
        return {**{f"attn.{i}": i in self.attn for i in layers}, **{f"mlp.{i}": i in self.mlp for i in layers}}

    @staticmethod
    def of(params: dict) -> "SkipSet":
        chosen = [name.split(".") for name, skip in params.items() if skip]
        return SkipSet(tuple(sorted(int(i) for part, i in chosen if part == "attn")),
                       tuple(sorted(int(i) for part, i in chosen if part == "mlp")))


# ----------------------------------------------------------------------------------------------------------------
# The objective


def skippable(num_layers: int) -> list[int]:
    return list(range(1, num_layers - 1))


def relative_cost(target: PreTrainedModel, skips: SkipSet) -> float:
    """c: the share of the target's per-token weights a forward with these skips still reads (sub-layers kept plus
    the LM head; the embedding is a lookup)."""
    layers = decoder_layers(target)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    attn, mlp = [count(layer.self_attn) for layer in layers], [count(layer.mlp) for layer in layers]
    total = sum(attn) + sum(mlp) + target.get_output_embeddings().weight.numel()
    return (total - sum(attn[i] for i in skips.attn) - sum(mlp[i] for i in skips.mlp)) / total


def expected_speedup(alpha: float, cost: float, draft_len: int) -> float:
    """Tokens per target pass over the pass's cost in target passes, for i.i.d. acceptance alpha, at the best draft
    length up to draft_len (adaptive draft exit shortens proposals where drafting does not pay)."""
    def at(k: int) -> float:
        tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens / (k * cost + 1)

    return max(at(k) for k in range(1, draft_len + 1))


class Proxy:
    """SWIFT's proxy on fixed target-generated text: the full target's argmax is computed once; each trial is one
    forward with skips."""

    def __init__(self, target: PreTrainedModel, records: list, response_key: str, max_len: int, pad_id: int,
                 batch_size: int = 4):
        self.target = target
        self.batches = [collate(records[i:i + batch_size], response_key, max_len, pad_id).to(target.device)
                        for i in range(0, len(records), batch_size)]
        self.reference = [self._argmax(batch) for batch in self.batches]

    @torch.inference_mode()
    @stock_kernels()  # the search's score must not depend on what `auto` timed (cpu_kernels.py)
    def _argmax(self, batch) -> torch.Tensor:
        return head_at(self.target, batch.input_ids, batch.attention_mask, batch.resp_pos).argmax(-1)

    def __call__(self, skips: SkipSet) -> float:
        """alpha: the share of response positions where the skipping target predicts the target's next token."""
        same = total = 0
        with skipping(self.target, skips.attn, skips.mlp):
            for batch, reference in zip(self.batches, self.reference):
                hit = (self._argmax(batch) == reference) & batch.resp_mask
                same, total = same + int(hit.sum()), total + batch.num_tokens
        return same / max(total, 1)


def prior_skip_sets(num_layers: int, configured: SkipSet) -> list[SkipSet]:
    """The first trials: the configured skip set (if any), both sub-layers of a centred block of L/8 and of L/4
    layers, and attention-only and MLP-only skips of every 2nd layer of the middle half (Draft & Verify and SWIFT
    find the middle layers the most skippable; SmolLM2's late ones are not)."""
    centre, priors = num_layers // 2, [configured]
    for width in (max(1, num_layers // 8), max(1, num_layers // 4)):
        block = tuple(i for i in range(centre - width // 2, centre - width // 2 + width) if 0 < i < num_layers - 1)
        priors.append(SkipSet(block, block))
    middle = tuple(i for i in range(num_layers // 4, 3 * num_layers // 4, 2) if 0 < i < num_layers - 1)
    priors += [SkipSet(middle, ()), SkipSet((), middle)]
    return list(dict.fromkeys(p for p in priors if p.attn or p.mlp))


# ----------------------------------------------------------------------------------------------------------------
# The study


def open_study(run_dir: Path, seed: int) -> optuna.Study:
    """The run's study, created or continued; trials a killed run left running are marked failed (drawn again)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(str(run_dir / JOURNAL)))
    study = optuna.create_study(study_name=STUDY, storage=storage, direction="maximize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=seed))
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
        study.tell(trial.number, state=TrialState.FAIL)
    return study


def completed(study: optuna.Study) -> list:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def run_trial(study: optuna.Study, seed: int, layers: list[int], priors: list[SkipSet], score) -> optuna.trial.FrozenTrial:
    """One more completed trial: the next prior, else TPE's proposal with a sampler seeded by (seed, n)."""
    n = len(completed(study))
    if n < len(priors):  # scored first, then stored complete in one step: a kill leaves nothing half-done
        skips = priors[n]
        value, attrs = score(skips)
        study.add_trial(create_trial(params=skips.params(layers), distributions={k: _FLAG for k in
                                     skips.params(layers)}, value=value, user_attrs=attrs))
        return completed(study)[-1]
    study.sampler = optuna.samplers.TPESampler(seed=seed * 1_000_003 + n)
    trial = study.ask({**{f"attn.{i}": _FLAG for i in layers}, **{f"mlp.{i}": _FLAG for i in layers}})
    value, attrs = score(SkipSet.of(trial.params))
    for key, attr in attrs.items():
        trial.set_user_attr(key, attr)
    return study.tell(trial, value)


# ----------------------------------------------------------------------------------------------------------------
# The recipe


def search(cfg: TrainJobConfig, check_inputs: Callable[[TrainJobConfig], None]) -> dict:
    """Search the skip set as configured (see the module doc); returns the chosen drafter's eval metrics.
    `check_inputs`: the entry point's check of the paths the config names (preflight), run once the config is known
    to ask for a search."""

    dcfg, tcfg = cfg.drafter, cfg.train
    if not isinstance(dcfg, LayerSkipDrafterConfig) or dcfg.path != "skips":
        raise ConfigError("drafter.path: drafter-train drafter=layerskip searches a new skip set (drafter.path=skips); "
                          "evaluate a saved one with drafter-eval")
    check_inputs(cfg)
    run_dir = prepare_run_dir(tcfg.output_root, tcfg.run_name, tcfg.resume)
    config = OmegaConf.to_container(OmegaConf.structured(cfg))
    if tcfg.resume == "auto":
        check_same_run(run_dir, config, ignore=RESUMABLE_CHANGES, started=(run_dir / JOURNAL).exists())
    elif (run_dir / JOURNAL).exists():
        raise ConfigError(f"train.resume: {run_dir} already holds a search; pick another train.run_name or resume=auto")
    accelerator = make_accelerator(tcfg, log_with(cfg.tracker), run_dir)
    set_seed(tcfg.seed)
    target, tokenizer = load_target(cfg.target)
    check_full_cache(target, "drafter=layerskip (drafting on the target's own KV cache)")
    target.to(accelerator.device)
    num_layers = len(decoder_layers(target))
    layers, configured = skippable(num_layers), SkipSet(tuple(sorted(dcfg.skip_attn)), tuple(sorted(dcfg.skip_mlp)))
    new_model(target, configured.attn, configured.mlp)  # checks the configured skip set in one line
    data, response_key = load_training_data(cfg, tokenizer)
    overlap = check_eval_overlap(eval_prompt_texts(cfg), cfg, tokenizer, [tcfg.data_dir])  # the confirmation's prompts
    records = list(data.select(range(min(dcfg.search_sequences, len(data)))))
    proxy = Proxy(target, records, response_key, dcfg.search_max_tokens, tokenizer.pad_token_id or 0)
    study = open_study(run_dir, tcfg.seed)
    save_run_config(run_dir, config)
    logger = RunLogger(accelerator, run_dir, cfg.tracker, tcfg.run_name, [f"draft_len={dcfg.draft_len}",
                                                                           "drafter=layerskip"], config)

    def score(skips: SkipSet) -> tuple[float, dict]:
        alpha, cost = proxy(skips), relative_cost(target, skips)
        # skipping nothing drafts with the whole target: never a speedup (the formula's break-even 1.0 is not one)
        value = expected_speedup(alpha, cost, dcfg.draft_len) if skips.attn or skips.mlp else 0.0
        return value, {"proxy": alpha, "cost": cost}

    priors = prior_skip_sets(num_layers, configured)
    bar = tqdm(total=dcfg.search_trials, initial=min(len(completed(study)), dcfg.search_trials),
               desc=f"search {tcfg.run_name}", unit="trial")
    while len(completed(study)) < dcfg.search_trials:
        trial = run_trial(study, tcfg.seed, layers, priors, score)
        skips, best = SkipSet.of(trial.params), max(t.value for t in completed(study))
        logger.log({"search/proxy": trial.user_attrs["proxy"], "search/cost": trial.user_attrs["cost"],
                    "search/objective": trial.value, "search/best_objective": best,
                    "search/skipped_attn": len(skips.attn), "search/skipped_mlp": len(skips.mlp)},
                   len(completed(study)))
        bar.update(1)
        bar.set_postfix(proxy=f"{trial.user_attrs['proxy']:.3f}", best=f"{best:.3f}")
    bar.close()
    metrics = confirm(cfg, target, tokenizer, study, run_dir, logger, eval_prompt_ids(cfg, tokenizer), overlap)
    logger.finish()
    return metrics


def best_trials(study: optuna.Study, count: int) -> list:
    """The `count` best completed trials, distinct skip sets, best first (ties: the earlier trial)."""
    ranked, seen = sorted(completed(study), key=lambda t: (-t.value, t.number)), set()
    unique = [t for t in ranked if not (SkipSet.of(t.params) in seen or seen.add(SkipSet.of(t.params)))]
    return unique[:count]


def confirm(cfg: TrainJobConfig, target, tokenizer, study, run_dir: Path, logger: RunLogger, prompts,
            overlap: dict | None = None) -> dict:
    """Decode the best trials for real; save the fastest (measured speedup) as step-<trials> and mark it best."""
    step = len(completed(study))
    final = run_dir / f"step-{step}"
    if (final / "metrics.json").is_file() and (run_dir / "best").resolve() == final.resolve():
        return json.loads((final / "metrics.json").read_text())  # a finished search, rerun
    eos, results = eos_token_ids(target, tokenizer), []
    for rank, trial in enumerate(tqdm(best_trials(study, cfg.drafter.search_confirm), desc="confirm", unit="skip set")):
        skips = SkipSet.of(trial.params)
        model = new_model(target, skips.attn, skips.mlp, cfg.drafter.exit_threshold)
        drafter = make_drafter(model, cfg.target.cpu_kernels)
        metrics = evaluate_decoding(target, drafter, prompts[0], cfg.eval, eos, progress=False, categories=prompts[1],
                                    kernels=cfg.target.cpu_kernels)
        logger.log({f"confirm/{rank}/{k}": metrics[k] for k in ("tau", "acceptance_rate", "speedup")}, step)
        results.append((metrics["speedup"], -rank, trial, metrics))
    _, _, trial, metrics = max(results, key=lambda r: r[:2])
    skips = SkipSet.of(trial.params)
    gamma = metrics["draft_exit_final"] if metrics.get("draft_exit_final") is not None else \
        cfg.drafter.exit_threshold
    order = {t.number: i + 1 for i, t in enumerate(completed(study))}  # trial n = the n-th completed (kills fail some)
    record = {"trial": order[trial.number], "trials": step, "proxy": trial.user_attrs["proxy"],
              "cost": trial.user_attrs["cost"], "objective": trial.value,
              "confirmed": [{"trial": order[t.number], "skip_attn": list(SkipSet.of(t.params).attn),
                             "skip_mlp": list(SkipSet.of(t.params).mlp), "speedup": s, "tau": m["tau"]}
                            for s, _, t, m in results]}
    model = new_model(target, skips.attn, skips.mlp, gamma, target=model_identity(cfg.target),
                      search=record, **target_fingerprint(target))
    metrics = {**metrics, "search": record, "skip_attn": list(skips.attn), "skip_mlp": list(skips.mlp),
               "split": split_name(eval_prompts_path(cfg)), "overlap": overlap}  # confirmed on it (never test)
    logger.log({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
               step)
    step_dir = save_checkpoint(run_dir, model, tokenizer, {"search": record}, metrics, step)
    mark_best(run_dir, step_dir)
    return metrics
