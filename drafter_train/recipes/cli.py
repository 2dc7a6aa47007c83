"""The console scripts (pyproject.toml's [project.scripts]) and what they share: user errors as one line on stderr,
no traceback; the configs registered with Hydra (job schemas and every drafter kind's).

A console script checks before it loads. It composes its config (Hydra), builds the typed job (every field's own
check, a value left unset named), checks every path the job names (preflight.py; drafter-seq2seq's own check_paths),
and only then imports its recipe module: torch, transformers, datasets and accelerate come with the recipe, so a bad
input is one line on stderr (`drafter-train: error: ...`, exit 2) in about a second instead of after ~10 s of imports.
Nothing imported here imports them (tests/test_startup_checks.py keeps it so).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Any, Callable, Iterator

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from drafter_train.config import (CONF_DIR, DatagenJobConfig, DrafterConfig, EvalJobConfig, ExportJobConfig,
                                  ReportJobConfig, TrainJobConfig, check_side_by_side)
from drafter_train.drafters.registry import kind_schemas
from drafter_train.errors import ConfigError, DrafterTrainError
from drafter_train.preflight import check_inputs
from drafter_train.seq2seq.config import Seq2SeqJobConfig, check_paths


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """Turn a DrafterTrainError into `prog: error: message` and exit status 2 (argparse's convention)."""
    try:
        yield
    except DrafterTrainError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        sys.exit(2)


def on_main_process() -> bool:
    """Whether this is the launch's main process: RANK 0 under `accelerate launch` / torchrun, or no launcher at all.

    Every rank runs the console script in the same run folder; what is written or printed once (Hydra's files, the
    final summary, a sweep's report) is done here, before and after any Accelerator exists.
    """
    return os.environ.get("RANK", "0") == "0"


def main_process_only(value, elsewhere=None):
    """Hydra resolver `${main_process_only:VALUE[,ELSEWHERE]}`: VALUE on the main process, ELSEWHERE on other ranks."""
    return value if on_main_process() else elsewhere


def register_configs() -> None:
    """Register the job schemas and every drafter kind's schema in Hydra's ConfigStore, so the YAML files can extend
    them, and the resolvers the YAML files use (called by the entry points, not at import)."""
    OmegaConf.register_new_resolver("main_process_only", main_process_only, replace=True)
    cs = ConfigStore.instance()
    for name, node in (("eval_schema", EvalJobConfig), ("datagen_schema", DatagenJobConfig),
                       ("train_schema", TrainJobConfig), ("export_schema", ExportJobConfig),
                       ("report_schema", ReportJobConfig), ("seq2seq_schema", Seq2SeqJobConfig)):
        cs.store(name=name, node=node)
    # One schema per registered drafter kind (<kind>_schema), extended by the YAML files of the `drafter` group
    # (conf/drafter/*.yaml); any_schema: a saved folder of whatever kind (drafter=path).
    for name, schema in kind_schemas().items():
        cs.store(group="drafter", name=f"{name}_schema", node=schema)
    cs.store(group="drafter", name="any_schema", node=DrafterConfig)


def compose_config(name: str, overrides: list[str]) -> Any:
    """The typed, validated job config of entry point `name` (train, eval, datagen, export, report) with Hydra
    `overrides`, composed from the package's conf/ as the command line composes it: for scripts and notebooks."""
    register_configs()
    return OmegaConf.to_object(_compose(name, overrides))


def _compose(name: str, overrides: list[str]) -> DictConfig:
    """Entry point `name`'s Hydra config with `overrides`, untyped (the schemas registered by the caller)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(name, overrides=list(overrides))


def job_config(cfg: DictConfig, prog: str) -> Any:
    """Composed Hydra config -> the typed job (dataclasses: every field's check runs); a required value left unset
    (`???`) is one line naming it."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]}: must be set ({prog} {missing[0]}=...)")
    return OmegaConf.to_object(cfg)


def console(prog: str, config_name: str, recipe: str, check: Callable[[Any], None] = lambda job: None) -> None:
    """Run console script `prog` on the command line: for each job (one, or a -m sweep's), the typed job and `check`
    of what it names, then `command(job)` of the module `recipe`, imported only now (module doc). Returns nothing;
    the command's return value goes to Hydra (a sweeper optimises drafter-train's tau)."""
    register_configs()

    def task(cfg: DictConfig) -> Any:
        with one_line_errors(prog):
            job = job_config(cfg, prog)
            check(job)
            return importlib.import_module(recipe).command(job)

    task.__module__ = recipe  # Hydra names the job after its task's module: drafter-train's log is train.log
    try:
        hydra.main(version_base=None, config_path=CONF_DIR, config_name=config_name)(task)()
    finally:
        end_process_group()


def end_process_group() -> None:
    """Destroy the launch's process group once every job (a -m sweep's too) is done. Left to interpreter exit, a
    rank of a ZeRO-3 launch sometimes died with SIGABRT ("terminate called without an active exception") after its
    run had finished. torch is looked up, not imported: a console script that never loaded it has no group."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


def train_main() -> None:
    """drafter-train (recipes/train.py)."""
    console("drafter-train", "train", "drafter_train.recipes.train", check_inputs)


def eval_main() -> None:
    """drafter-eval (recipes/evaluate.py)."""
    console("drafter-eval", "eval", "drafter_train.recipes.evaluate", check_inputs)


COMPARE_USAGE = """usage: drafter-compare [COMMON OVERRIDES] NAME: OVERRIDES [NAME: OVERRIDES ...]

Several drafter-eval jobs' decoders on the same prompts against one plain decoding, side by side: the target loads
once, plain decoding is timed once per prompt, every decoder interleaved with it. Each NAME: starts a decoder; its
OVERRIDES are drafter-eval's, after the COMMON ones; each sets its own eval.output (its metrics.json). The jobs must
share the target, the prompts and what plain decoding depends on (max_new_tokens, seed, warm-up, baseline kernels,
sampling); eval.engine=ours, no calibration. Ending the line with --cfg job prints each job's config instead.

    drafter-compare eval.prompts=test eval.num_prompts=24 \\
        chain: drafter=path drafter.path=RUN/best/drafter eval.draft_len=3 eval.output=RUN/chain.json \\
        lookup: drafter=ngram eval.draft_len=3 eval.output=RUN/lookup.json"""


def compare_jobs(argv: list[str], paths: bool = True) -> dict[str, EvalJobConfig]:
    """drafter-compare's command line -> {name: the typed drafter-eval job}, every check that needs no model done:
    each job's own, its paths (preflight; `paths` False: not those), and that the jobs can share one plain
    decoding."""
    common, decoders, name = [], {}, None
    for arg in argv:
        if arg.endswith(":") and "=" not in arg:
            name = arg[:-1]
            if not name or name in decoders:
                raise ConfigError(f"decoder names must be given once and not be empty, got {arg!r}")
            decoders[name] = []
        elif name is None:
            common.append(arg)
        else:
            decoders[name].append(arg)
    if not decoders:
        raise ConfigError("no decoder given (NAME: OVERRIDES ...)\n" + COMPARE_USAGE)
    register_configs()
    jobs = {n: job_config(_compose_eval([*common, *options]), "drafter-compare") for n, options in decoders.items()}
    (first, base), outputs = next(iter(jobs.items())), {}
    for n, job in jobs.items():
        if not job.eval.output:
            raise ConfigError(f"{n}: eval.output must be set (each decoder writes its own metrics)")
        if job.eval.output in outputs:
            raise ConfigError(f"{n}: eval.output={job.eval.output} is {outputs[job.eval.output]}'s too")
        outputs[job.eval.output] = n
        if job.eval.engine != "ours" or job.eval.calibration.enabled:
            raise ConfigError(f"{n}: drafter-compare runs our decoder without calibration (eval.engine=ours, "
                              "eval.calibration.enabled=false): use drafter-eval for the rest")
        for field, mine, theirs in (("target", job.target, base.target), ("eval.prompts", job.eval.prompts,
                                    base.eval.prompts), ("eval.num_prompts", job.eval.num_prompts, base.eval.num_prompts),
                                    ("eval.prompt_field", job.eval.prompt_field, base.eval.prompt_field)):
            if mine != theirs:
                raise ConfigError(f"{n}: its {field} differs from {first}'s: decoders side by side decode the same "
                                  "prompts on the same target (set it among the common overrides)")
        if paths:
            check_inputs(job)
    check_side_by_side({n: job.eval for n, job in jobs.items()})
    return jobs


def _compose_eval(overrides: list[str]) -> DictConfig:
    """drafter-eval's config with `overrides`; an override Hydra cannot apply is one line."""
    from hydra.errors import HydraException

    try:
        return _compose("eval", overrides)
    except HydraException as err:
        raise ConfigError(str(err).splitlines()[0]) from None


def compare_main(argv: list[str] | None = None) -> None:
    """drafter-compare (recipes/evaluate.py's compare): the jobs composed and checked here, then the recipe."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(COMPARE_USAGE)
        return
    show = argv[-2:] == ["--cfg", "job"]  # as Hydra's --cfg job: each job's config printed, nothing run or checked
    with one_line_errors("drafter-compare"):
        jobs = compare_jobs(argv[:-2] if show else argv, paths=not show)
        if show:
            for name, job in jobs.items():
                print(f"# {name}\n{OmegaConf.to_yaml(OmegaConf.structured(job))}")
            return
        importlib.import_module("drafter_train.recipes.evaluate").compare(jobs)


def datagen_main() -> None:
    """drafter-datagen (recipes/datagen.py)."""
    console("drafter-datagen", "datagen", "drafter_train.recipes.datagen", check_inputs)


def export_main() -> None:
    """drafter-export (recipes/export.py: its checks are its own, and it imports no torch before they pass)."""
    console("drafter-export", "export", "drafter_train.recipes.export")


def report_main() -> None:
    """drafter-report (recipes/report.py: its checks are its own, and it imports no torch at all)."""
    console("drafter-report", "report", "drafter_train.recipes.report")


def seq2seq_main() -> None:
    """drafter-seq2seq (recipes/seq2seq.py): its target folder and splits checked first (seq2seq/config.py)."""
    console("drafter-seq2seq", "seq2seq", "drafter_train.recipes.seq2seq", check_paths)


MAINS = {"train": train_main, "eval": eval_main, "datagen": datagen_main, "export": export_main,
         "report": report_main, "seq2seq": seq2seq_main, "compare": compare_main}

if __name__ == "__main__":  # python -m drafter_train.recipes.cli JOB ARGS: the console script drafter-JOB
    job = sys.argv.pop(1)
    sys.argv[0] = f"drafter-{job}"
    MAINS[job]()
