"""What every console script shares: user errors as one line on stderr, no traceback; the configs registered with
Hydra (job schemas and every drafter kind's)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from drafter_train.config import (CONF_DIR, DatagenJobConfig, DrafterConfig, EvalJobConfig, ExportJobConfig,
                                  ReportJobConfig, TrainJobConfig)
from drafter_train.drafters.registry import all_kinds
from drafter_train.errors import DrafterTrainError
from drafter_train.seq2seq.config import Seq2SeqJobConfig


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
    for kind in all_kinds():
        cs.store(group="drafter", name=f"{kind.name}_schema", node=kind.config_class)
    cs.store(group="drafter", name="any_schema", node=DrafterConfig)


def compose_config(name: str, overrides: list[str]) -> Any:
    """The typed, validated job config of entry point `name` (train, eval, datagen, export, report) with Hydra
    `overrides`, composed from the package's conf/ as the command line composes it: for scripts and notebooks."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(compose(name, overrides=list(overrides)))
