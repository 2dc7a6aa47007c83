"""The typed config of `drafter-seq2seq` (recipes/seq2seq.py; conf/seq2seq.yaml): an encoder-decoder target, its
source/target pairs, one AR or NAR drafter, its training run and its evaluation. Every field is checked in
`__post_init__` with a one-line error naming it; paths are checked by `check_paths` before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from drafter_train.config import BASELINE_KERNELS, CPU_KERNELS, EvalConfig, LossConfig, TreeConfig, check_field
from drafter_train.errors import ConfigError

SPLITS = ("train", "dev", "test")
SPLIT_SUFFIXES = (".jsonl", ".json", ".parquet")  # or <split>/ : a `datasets` folder (save_to_disk)
DRAFTER_KINDS = ("ar", "nar")
VERIFY = ("greedy", "sample")


@dataclass
class Seq2SeqTargetConfig:
    # A local folder of a transformers encoder-decoder (T5, BART, Marian/NLLB ...) with its tokenizer.
    path: str = MISSING
    dtype: str = "float32"
    # As target.cpu_kernels of the other entry points (cpu_kernels.py): the speculative run's kernels, set after
    # datagen (the target's outputs never depend on a per-load timing).
    cpu_kernels: str = "auto"

    def __post_init__(self) -> None:
        check_field(self.dtype in ("float32", "bfloat16", "float16"), "target.dtype",
                    f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        check_field(self.cpu_kernels in CPU_KERNELS, "target.cpu_kernels",
                    f"must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")


@dataclass
class Seq2SeqDataConfig:
    # A folder holding the splits train, dev and test, each as <split>.jsonl / .json / .parquet or a <split>/
    # `datasets` folder, with a source column (the references, if any, are not used: the target rewrites them).
    path: str = MISSING
    source_key: str = "source"
    # Sources of each split used (0: all): train = what the target regenerates and the drafter learns from,
    # dev = what `best` is chosen on, test = what the final metrics report.
    num_train: int = 0
    num_dev: int = 32
    num_test: int = 64
    # Longest output the target writes for a source (datagen) and decodes (evaluation).
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("num_train", "num_dev", "num_test"):
            check_field(getattr(self, name) >= 0, f"data.{name}", f"must be >= 0, got {getattr(self, name)}")
        check_field(self.max_new_tokens >= 1, "data.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")


@dataclass
class Seq2SeqDrafterConfig:
    # ar: the target's encoder and first `decoder_layers` decoder layers, decoding token by token (Leviathan et al.);
    # nar: SpecDec's Spec-Drafter, the same cut with `draft_len` [MASK] queries drafted in one pass.
    kind: str = "ar"
    decoder_layers: int = 1
    # Drafts per target pass (the NAR drafter's number of queries).
    draft_len: int = 4

    def __post_init__(self) -> None:
        check_field(self.kind in DRAFTER_KINDS, "drafter.kind", f"must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        check_field(self.decoder_layers >= 1, "drafter.decoder_layers", f"must be >= 1, got {self.decoder_layers}")
        check_field(self.draft_len >= 1, "drafter.draft_len", f"must be >= 1, got {self.draft_len}")


@dataclass
class Seq2SeqTrainConfig:
    # The run folder is <output_root>/<run_name>: datagen/ (the target's outputs, resumable), step-<N>/ checkpoints,
    # `latest`, `best`, config.yaml and metrics.json (the test split's figures for `best`).
    output_root: str = "checkpoints"
    run_name: str = "seq2seq"
    max_steps: int = 200
    batch_size: int = 32
    lr: float = 1e-3
    # NAR: random cuts per example and step (each a block of draft_len queries).
    blocks_per_example: int = 4
    # Checkpoint, and evaluate on the dev split (tau chooses `best`), every N steps and at the end.
    save_every: int = 50
    keep_last: int = 2
    # auto: continue from <run>/latest (the newest intact checkpoint); never: refuse a run folder with checkpoints.
    resume: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "blocks_per_example", "save_every", "keep_last"):
            check_field(getattr(self, name) >= 1, f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        check_field(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        check_field(self.resume in ("auto", "never"), "train.resume", f"must be auto or never, got {self.resume!r}")
        check_field(bool(self.run_name) and "/" not in self.run_name, "train.run_name", "must be a plain folder name")


@dataclass
class Seq2SeqEvalConfig:
    # greedy (lossless: outputs equal plain decoding's) | sample (speculative sampling at `temperature`).
    # The defaults are drafter-eval's (EvalConfig), stated there once.
    verify: str = EvalConfig.verify
    temperature: float = EvalConfig.temperature
    # As eval.baseline_kernels: all = plain decoding on every CPU kernel setting, the fastest the divisor.
    baseline_kernels: str = EvalConfig.baseline_kernels
    # Untimed runs of every decoder before the timing.
    warmup: int = EvalConfig.warmup
    # Where the test split's metrics go; unset: metrics.json in the run folder.
    output: Optional[str] = None
    # Draft trees instead of chains (eval.tree.top_k set; depth unset: drafter.draft_len), as drafter-eval's: only
    # where the target's decoder takes tree positions (docs/seq2seq.md "Draft trees"; refused in one line otherwise).
    tree: TreeConfig = field(default_factory=TreeConfig)

    def __post_init__(self) -> None:
        check_field(self.verify in VERIFY, "eval.verify", f"must be one of {VERIFY}, got {self.verify!r}")
        check_field(self.verify != "greedy" or not self.tree.enabled or self.tree.branching == "topk",
                    "eval.tree.branching", "iid trees are sampled: verify them with eval.verify=sample (greedy uses "
                    "topk trees)")
        check_field(self.temperature > 0, "eval.temperature", f"must be > 0, got {self.temperature}")
        check_field(self.baseline_kernels in BASELINE_KERNELS, "eval.baseline_kernels",
                    f"must be one of {BASELINE_KERNELS}, got {self.baseline_kernels!r}")
        check_field(self.warmup >= 0, "eval.warmup", f"must be >= 0, got {self.warmup}")


@dataclass
class Seq2SeqJobConfig:
    """drafter-seq2seq: datagen, training (checkpoints, resume, best on dev) and test evaluation of one drafter."""

    target: Seq2SeqTargetConfig = field(default_factory=Seq2SeqTargetConfig)
    data: Seq2SeqDataConfig = field(default_factory=Seq2SeqDataConfig)
    drafter: Seq2SeqDrafterConfig = field(default_factory=Seq2SeqDrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: Seq2SeqTrainConfig = field(default_factory=Seq2SeqTrainConfig)
    eval: Seq2SeqEvalConfig = field(default_factory=Seq2SeqEvalConfig)

    def __post_init__(self) -> None:
        check_field(self.loss.teacher == "online", "loss.teacher",
                    "seq2seq drafters learn from the target's logits on the same batch: use loss.teacher=online")
        self.eval.tree.check_size(self.eval.tree.depth or self.drafter.draft_len)

    def tree_spec(self):
        """eval.tree as the decoder's TreeSpec (depth unset: drafter.draft_len); None: chains."""
        from drafter_train.decoding.tree import TreeSpec

        tree = self.eval.tree
        return TreeSpec(tree.top_k, tree.depth or self.drafter.draft_len, tree.total_tokens, tree.branching) \
            if tree.enabled else None

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_root) / self.train.run_name


def split_path(data_dir: str, split: str) -> Path:
    """The file or `datasets` folder of `split` in data.path; a one-line error naming data.path if there is none."""
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"data.path: {data_dir}: no such folder")
    for candidate in [folder / f"{split}{suffix}" for suffix in SPLIT_SUFFIXES] + [folder / split]:
        if candidate.exists():
            return candidate
    raise ConfigError(f"data.path: {data_dir} has no {split} split ({split}.jsonl, .json, .parquet or a {split}/ "
                      "datasets folder)")


def check_paths(cfg: Seq2SeqJobConfig) -> None:
    """Every path the job names, and what its config.json alone tells, before any weights load: the target folder
    (an encoder-decoder with more decoder layers than the drafter takes, whose decoder takes draft trees if eval.tree
    asks for them), the three splits. The paths first: what reads config.json imports transformers (and torch)."""
    if not (Path(cfg.target.path).expanduser() / "config.json").is_file():
        raise ConfigError(f"target.path: {cfg.target.path} is not a model folder (no config.json)")
    for split in SPLITS:
        split_path(cfg.data.path, split)
    from transformers import AutoConfig

    from drafter_train.seq2seq.target import check_trees, model_class, num_layers

    config = AutoConfig.from_pretrained(cfg.target.path)
    model_class(config)  # refuses a decoder-only model in one line
    total = num_layers(config)[1]
    check_field(cfg.drafter.decoder_layers < total, "drafter.decoder_layers",
                f"must be below the target's {total} decoder layers, got {cfg.drafter.decoder_layers}")
    spec = cfg.tree_spec()
    if spec is not None:  # from config.json alone: a decoder that cannot place a tree's tokens is refused here
        check_trees(config)
        check_field(cfg.drafter.kind != "nar" or spec.depth <= cfg.drafter.draft_len, "eval.tree.depth",
                    f"the Spec-Drafter has drafter.draft_len={cfg.drafter.draft_len} mask queries, cannot draft a "
                    f"tree {spec.depth} deep")
