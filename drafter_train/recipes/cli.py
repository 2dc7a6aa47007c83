"""What every console script shares: user errors as one line on stderr, no traceback; the configs registered with
Hydra (job schemas and every drafter kind's)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from drafter_train.config import (CONF_DIR, DatagenJobConfig, DrafterConfig, EvalJobConfig, ExportJobConfig,
                                  ReportJobConfig, TrainJobConfig)
from drafter_train.data.prompts import check_prompt_file
from drafter_train.drafters.registry import all_kinds, is_saved_drafter
from drafter_train.errors import ConfigError, DrafterTrainError, ModelNotFoundError
from drafter_train.targets import check_model_path


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


def check_inputs(cfg) -> None:
    """Every path a job config names, and what can be checked of it without a model, before anything loads: a
    mistyped path is one line at once, not after minutes of loading the target and timing its kernels."""
    target, drafter = getattr(cfg, "target", None), getattr(cfg, "drafter", None)
    if target is not None:
        _named("target.path", lambda: check_model_path(target.path, target.gguf_file))
    if drafter is not None and is_saved_drafter(drafter.path):
        _named("drafter.path", lambda: check_model_path(drafter.path))
    for option, folder in _data_folders(cfg):
        if folder and not Path(folder).expanduser().is_dir():
            raise ConfigError(f"{option}: {folder}: no such folder")
    for option, prompts in (("eval", getattr(getattr(cfg, "eval", None), "prompts", None)),
                            ("datagen", getattr(getattr(cfg, "datagen", None), "prompts", None))):
        if prompts and (Path(prompts).suffix or Path(prompts).expanduser().is_absolute()):  # a file, not a hub id
            check_prompt_file(prompts, option)


def _named(option: str, check) -> None:
    """Run `check`, naming the option in its one-line error."""
    try:
        check()
    except ModelNotFoundError as err:
        raise ModelNotFoundError(f"{option}: {err}") from None


def _data_folders(cfg) -> list[tuple[str, Optional[str]]]:
    folders = []
    if hasattr(cfg, "train"):
        folders.append(("train.data_dir", cfg.train.data_dir))
    if hasattr(cfg, "eval"):
        folders.append(("eval.lookup.corpus.path", cfg.eval.lookup.corpus.path))
    corpus = getattr(getattr(cfg, "drafter", None), "corpus", None)
    if corpus is not None:
        folders.append(("drafter.corpus.path", corpus.path))
    return folders


def register_configs() -> None:
    """Register the job schemas and every drafter kind's schema in Hydra's ConfigStore, so the YAML files can extend
    them, and the resolvers the YAML files use (called by the entry points, not at import)."""
    OmegaConf.register_new_resolver("main_process_only", main_process_only, replace=True)
    cs = ConfigStore.instance()
    for name, node in (("eval_schema", EvalJobConfig), ("datagen_schema", DatagenJobConfig),
                       ("train_schema", TrainJobConfig), ("export_schema", ExportJobConfig),
                       ("report_schema", ReportJobConfig)):
        cs.store(name=name, node=node)
    # One schema per registered drafter kind (<kind>_schema), extended by the YAML files of the `drafter` group
    # (conf/drafter/*.yaml); any_schema: a saved folder of whatever kind (drafter=path).
    for kind in all_kinds():
        cs.store(group="drafter", name=f"{kind.name}_schema", node=kind.config_class)
    cs.store(group="drafter", name="any_schema", node=DrafterConfig)


def compose_config(name: str, overrides: list[str]) -> Any:
    """The typed, validated job config of entry point `name` (train, eval, datagen, export, report) with Hydra
    `overrides`, composed from the package's conf/ as the command line composes it: for scripts and notebooks."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(compose(name, overrides=list(overrides)))
