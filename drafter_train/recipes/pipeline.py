"""drafter-pipeline pipeline=NAME [overrides]: run a pipeline of stages (conf/pipeline/NAME.yaml) to its end; rerunning
the same command resumes at the first stage not done (pipeline/runner.py).

    drafter-pipeline pipeline=quickstart                        # the main job (scripts/quickstart.sh)
    drafter-pipeline pipeline=served_qwen pipeline.stages=[datagen,eagle3] pipeline.num_prompts=16
"""

from __future__ import annotations

import shlex
import sys

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from drafter_train.config import CONF_DIR
from drafter_train.pipeline.config import (EngineArtifactsConfig, LongRunConfig, PipelineConfig, QuickstartConfig,
                                           ServedQwenConfig)
from drafter_train.recipes.cli import job_config, one_line_errors

SCHEMAS = {"quickstart_schema": QuickstartConfig, "served_qwen_schema": ServedQwenConfig,
           "engine_artifacts_schema": EngineArtifactsConfig, "long_run_schema": LongRunConfig}


def wrapper_command(script: str) -> str:
    """Resolver `${pipeline_command:SCRIPT}`: `bash SCRIPT` and this run's overrides but the pipeline's choice: what
    reproduces the run (a result file's command)."""
    tasks = HydraConfig.get().overrides.task if HydraConfig.initialized() else []  # composed outside Hydra's run
    given = [o for o in tasks if not o.startswith("pipeline=")]
    return " ".join(["bash", script, *map(shlex.quote, given)])


def machine_kind() -> str:
    """Resolver `${machine_kind:}`: this machine's kind (amd-epyc-avx2, ...), which names timed results."""
    from drafter_train.machine import kind_slug

    return kind_slug()


def pipeline_shared(name: str, key: str):
    """Resolver `${pipeline_shared:NAME,KEY}`: pipeline NAME's shared KEY, resolved in that pipeline (the long run
    trains with the main job's recipe, kept in one place: conf/pipeline/quickstart.yaml)."""
    from hydra import compose  # Hydra is initialised: the config that asks is being composed

    return OmegaConf.to_container(compose("pipeline", overrides=[f"pipeline={name}"]).pipeline.shared[key], resolve=True)


def register() -> None:
    OmegaConf.register_new_resolver("pipeline_command", wrapper_command, replace=True)
    OmegaConf.register_new_resolver("machine_kind", machine_kind, replace=True)
    OmegaConf.register_new_resolver("pipeline_shared", pipeline_shared, replace=True)
    for name, node in SCHEMAS.items():
        ConfigStore.instance().store(group="pipeline", name=name, node=node)


def compose_pipeline(overrides: list[str]) -> PipelineConfig:
    """The typed pipeline config with Hydra `overrides` (pipeline=served_qwen ...), as the command line composes it."""
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return job_config(compose("pipeline", overrides=list(overrides)).pipeline, "drafter-pipeline")


def task(cfg: DictConfig) -> None:
    from drafter_train.pipeline.runner import StageFailed, run_pipeline

    with one_line_errors("drafter-pipeline"):
        job = job_config(cfg.pipeline, "drafter-pipeline")
        try:
            run_pipeline(job)
        except StageFailed as err:
            print(f"drafter-pipeline: {err}", file=sys.stderr)
            sys.exit(err.returncode)


def main() -> None:
    """The console script drafter-pipeline."""
    register()
    hydra.main(version_base=None, config_path=CONF_DIR, config_name="pipeline")(task)()


if __name__ == "__main__":
    main()
