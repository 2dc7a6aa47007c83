"""The layer-skip kind's typed config (layerskip_schema)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter_train.config import DrafterConfig, check_field


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
            check_field(all(i >= 0 for i in layers), f"drafter.{name}", f"layer ids must be >= 0, got {layers}")
            check_field(len(set(layers)) == len(layers), f"drafter.{name}", f"names a layer twice: {layers}")
        check_field(0 <= self.exit_threshold < 1, "drafter.exit_threshold", f"must be in [0, 1), got {self.exit_threshold}")
        for name in ("search_trials", "search_sequences", "search_max_tokens", "search_confirm"):
            check_field(getattr(self, name) >= 1, f"drafter.{name}", f"must be >= 1, got {getattr(self, name)}")
