"""The layerskip kind: self-speculative decoding (Draft & Verify, Zhang et al. 2023, arXiv 2309.08168).

The target drafts for itself with some attention and MLP sub-layers skipped: a skipped sub-layer adds nothing to the
residual stream (residual + 0) and a skipped attention writes no cache entry. The first and last layers always run.
There are no weights and no second model: a drafter folder holds the skip set, the draft-exit threshold gamma it
starts from, and the identity of the target it was searched for (loading it for another target fails in one line).

Drafting reads the target's own KV cache of the verified prefix (the decoder hands it over with `share_target`):
no second cache of the prefix is built. The layers that run append entries for the drafted tokens, the skipped
ones do not, so the cache grows unevenly across layers; before the target verifies, each layer is cut back to the
verified length on its own (`keep_first`; a uniform `cache.crop(-n)` drops n entries from EVERY layer and would eat
verified entries of the skipped ones). Drafted entries needed later (a tree's nodes, expanded over several calls)
are set aside between calls, so the target's cache holds only the verified prefix whenever the decoder looks.

Drafting is the AR drafter's (ARDrafter): token by token, adaptive draft exit, sampling with the drafts'
distributions (lossless), EAGLE-2 trees. `drafter-train drafter=layerskip` searches the skip set (search.py).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, DynamicCache, PretrainedConfig, PreTrainedModel

from drafter_train.config import DrafterConfig
from drafter_train.drafters.layerskip.config import LayerSkipDrafterConfig
from drafter_train.decoding.cached_lm import CachedLM
from drafter_train.decoding.drafter import ARDrafter, Proposal
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.drafters.registry import BuildContext, DrafterKind, register
from drafter_train.drafters.common.weightless import WeightlessModel
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.targets import check_full_cache

MODEL_TYPE = "layerskip_drafter"
# What a target's shape is made of (load-time keys such as _name_or_path or dtype are left out of the hash).
_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
               "rope_parameters", "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "hidden_act")
_PROBES = 16  # embedding values recorded to tell two targets of one shape apart


# ----------------------------------------------------------------------------------------------------------------
# Skipping sub-layers


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layers of an HF decoder-only model, each with `self_attn` and `mlp` (Llama, Qwen, Mistral...)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        raise ConfigError(f"drafter=layerskip: {type(model).__name__} has no decoder layers with self_attn and mlp "
                          "sub-layers to skip")
    return layers


def check_skips(skip_attn: Sequence[int], skip_mlp: Sequence[int], num_layers: int) -> None:
    """Layer ids in range, and never the first or last layer (one-line ConfigError naming the field)."""
    last = num_layers - 1
    for name, layers in (("skip_attn", skip_attn), ("skip_mlp", skip_mlp)):
        for i in layers:
            if not 0 <= i <= last:
                raise ConfigError(f"drafter.{name}: layer {i} is out of range (the target has {num_layers} layers, "
                                  f"0..{last}; skippable: 1..{last - 1})")
            if i in (0, last):
                raise ConfigError(f"drafter.{name}: layer {i} is the {'first' if i == 0 else 'last'} layer, which is "
                                  f"never skipped (skippable: 1..{last - 1})")


def _no_attention(hidden_states: Tensor, *args, **kwargs) -> tuple[Tensor, None]:
    return torch.zeros_like(hidden_states), None  # residual + 0; no cache update


def _no_mlp(hidden_states: Tensor) -> Tensor:
    return torch.zeros_like(hidden_states)


@contextmanager
def skipping(model: PreTrainedModel, skip_attn: Sequence[int], skip_mlp: Sequence[int]) -> Iterator[None]:
    """Run `model` with these sub-layers skipped, inside the block only: their `forward` is overridden on the module
    instances and the override removed on exit, so the same module is the target outside and the drafter inside."""
    layers = decoder_layers(model)
    patched = [(layers[i].self_attn, _no_attention) for i in skip_attn] + [(layers[i].mlp, _no_mlp) for i in skip_mlp]
    for module, forward in patched:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in patched:
            del module.forward


def keep_first(cache: DynamicCache, length: int) -> None:
    """Cut every layer of `cache` back to its first `length` entries, each layer on its own (layers may hold
    different lengths: skipped attention layers added nothing)."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise ConfigError("drafter=layerskip needs a full KV cache; this model has sliding-window layers")
        if layer.get_seq_length() > length:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


# ----------------------------------------------------------------------------------------------------------------
# The target's identity


def target_fingerprint(target: PreTrainedModel) -> dict:
    """A hash of the target's shape (its config's architecture fields) and a few of its embedding values: what a
    saved drafter is checked against."""
    shape = {key: getattr(target.config, key) for key in _SHAPE_KEYS if hasattr(target.config, key)}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()
    flat = target.get_input_embeddings().weight.detach().reshape(-1)
    probe = flat[probe_positions(flat.numel())].float()
    return {"target_config_sha256": digest, "target_probe": [round(float(x), 6) for x in probe]}


def probe_positions(numel: int) -> Tensor:
    """_PROBES evenly spaced flat positions, first and last included, in integer arithmetic (float32 steps round
    past the end of a 28M-value embedding)."""
    return torch.arange(_PROBES) * (numel - 1) // (_PROBES - 1)


def check_target(config: "LayerSkipConfig", target: PreTrainedModel) -> None:
    """Refuse (one line) a target other than the one the drafter's skip set was searched for."""
    if config.target_config_sha256 is None:
        return  # built from drafter.skip_attn / skip_mlp for this very target
    found = target_fingerprint(target)
    searched_for = (config.target or {}).get("path", "another target")
    if found["target_config_sha256"] != config.target_config_sha256:
        problem = f"its config differs (sha256 {found['target_config_sha256'][:12]}, recorded " \
                  f"{config.target_config_sha256[:12]})"
    elif not torch.allclose(torch.tensor(found["target_probe"]), torch.tensor(config.target_probe), rtol=1e-2,
                            atol=1e-3):
        problem = "its weights differ"
    else:
        return
    raise ConfigError(f"drafter.path: this layerskip drafter was searched for {searched_for}, not this target "
                      f"({problem}); search a skip set for it with drafter-train drafter=layerskip")


# ----------------------------------------------------------------------------------------------------------------
# The saved drafter: settings only


class LayerSkipConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, num_layers: int = 0, skip_attn: Sequence[int] = (), skip_mlp: Sequence[int] = (),
                 exit_threshold: float = 0.0, target: Optional[dict] = None,
                 target_config_sha256: Optional[str] = None, target_probe: Optional[list] = None,
                 search: Optional[dict] = None, **kwargs):
        self.num_layers = num_layers  # the target's
        self.skip_attn, self.skip_mlp = sorted(skip_attn), sorted(skip_mlp)
        self.exit_threshold = exit_threshold  # gamma a proposal starts from when the evaluator sets none
        self.target = target  # targets.model_identity of the target searched for (None: built for the one at hand)
        self.target_config_sha256, self.target_probe = target_config_sha256, target_probe
        self.search = search  # what the search measured for this skip set (proxy, cost, objective, trials)
        super().__init__(**kwargs)


class LayerSkipModel(WeightlessModel):
    """Holds the skip set so the kind saves, loads and reports like the others; it has no weights (the target's
    own are used)."""

    config_class = LayerSkipConfig
    base_model_prefix = "layerskip"


def new_model(for_target: PreTrainedModel, skip_attn: Sequence[int], skip_mlp: Sequence[int],
              exit_threshold: float = 0.0, **record) -> LayerSkipModel:
    """A drafter for `for_target` (skip set checked). record: LayerSkipConfig's target identity and search results,
    for a saved folder."""
    num_layers = len(decoder_layers(for_target))
    check_skips(skip_attn, skip_mlp, num_layers)
    return LayerSkipModel(LayerSkipConfig(num_layers, skip_attn, skip_mlp, exit_threshold,
                                          vocab_size=for_target.config.vocab_size, **record)).eval()


# ----------------------------------------------------------------------------------------------------------------
# Decoding


class SkipView(CachedLM):
    """The target with skipped sub-layers on the TARGET's cache (`lm.cache`, which holds the verified prefix).

    Use it inside `drafting()`: on entry the entries drafted by earlier calls of this proposal or tree are put back
    on top of the verified prefix, on exit each layer is cut back to the verified length and what was drafted is
    set aside. `length` counts the verified prefix plus what is set aside.
    """

    def __init__(self, lm: CachedLM, skip_attn: Sequence[int], skip_mlp: Sequence[int]):
        self.target_lm, self.skip_attn, self.skip_mlp = lm, list(skip_attn), list(skip_mlp)
        super().__init__(lm.model)

    def reset(self) -> None:
        """Forget what was drafted (the target verified it, or a proposal is over)."""
        self.cache, self.length = self.target_lm.cache, self.target_lm.length
        self.drafted: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> keys, values of drafted positions

    @contextmanager
    def drafting(self) -> Iterator[None]:
        base, layers = self.target_lm.length, self.cache.layers
        for i, (keys, values) in self.drafted.items():
            layers[i].keys, layers[i].values = torch.cat([layers[i].keys, keys], -2), torch.cat([layers[i].values,
                                                                                                values], -2)
        try:
            yield
        finally:
            self.drafted = {i: (layer.keys[..., base:, :], layer.values[..., base:, :])
                            for i, layer in enumerate(layers) if layer.get_seq_length() > base}
            keep_first(self.cache, base)

    def forward(self, tokens: Tensor, num_logits: int) -> Tensor:
        with skipping(self.model, self.skip_attn, self.skip_mlp):
            return super().forward(tokens, num_logits)

    def forward_tree(self, tokens: Tensor, mask: Tensor, position_ids: Tensor) -> Tensor:
        with skipping(self.model, self.skip_attn, self.skip_mlp):
            return super().forward_tree(tokens, mask, position_ids)


class LayerSkipDrafter(ARDrafter):
    """ARDrafter's drafting (chains, draft exit, trees) with the target's skipping self as the draft model, on the
    target's cache: the decoder calls `share_target` with its CachedLM after `reset` (no cache of its own)."""

    def __init__(self, model: LayerSkipModel):
        self.config = model.config
        self.skip_attn, self.skip_mlp = list(model.config.skip_attn), list(model.config.skip_mlp)
        self.exit_below = model.config.exit_threshold  # the evaluator's draft exit, when set, replaces it
        self.checked: Optional[int] = None  # id of the target last checked against the recorded identity
        self.lm: Optional[SkipView] = None

    def share_target(self, lm: CachedLM) -> None:
        if self.checked != id(lm.model):
            check_target(self.config, lm.model)
            check_skips(self.skip_attn, self.skip_mlp, len(decoder_layers(lm.model)))
            self.checked = id(lm.model)
        self.lm = SkipView(lm, self.skip_attn, self.skip_mlp)

    def _view(self) -> SkipView:
        if self.lm is None:
            raise RuntimeError("a layerskip drafter drafts on the target's cache: the decoder must call "
                               "share_target(lm) first")
        return self.lm

    def reset(self) -> None:
        self.base, self.slots, self.lm = 0, {}, None

    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams,
                generator: Optional[torch.Generator]) -> Proposal:
        view = self._view()
        with view.drafting():
            proposal = super().propose(seq, draft_len, params, generator)
        view.reset()  # the target re-reads the drafts in its verify pass
        return proposal

    def tree_root(self, seq: Tensor) -> Tensor:
        with self._view().drafting():
            return super().tree_root(seq)

    def tree_expand(self, pool, nodes: list[int]) -> Tensor:
        with self._view().drafting():
            return super().tree_expand(pool, nodes)

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path: Optional[Sequence[int]] = None) -> None:
        self._view().reset()  # the target's cache now holds the verified sequence: nothing drafted is kept
        self.slots = {}


# ----------------------------------------------------------------------------------------------------------------
# The kind


def build(cfg: DrafterConfig, ctx: BuildContext) -> LayerSkipModel:
    check_full_cache(ctx.target, "drafter=layerskip (drafting on the target's own KV cache)")
    if cfg.path != "skips":
        model = load(cfg.path, ctx.dtype)
        check_target(model.config, ctx.target)
        check_skips(model.config.skip_attn, model.config.skip_mlp, len(decoder_layers(ctx.target)))
        return model
    if ctx.for_training:
        raise ConfigError("drafter=layerskip: the skip set is searched, not trained (drafter-train drafter=layerskip "
                          "runs the search)")
    return new_model(ctx.target, cfg.skip_attn, cfg.skip_mlp, cfg.exit_threshold)


def load(path: str, dtype: str) -> LayerSkipModel:
    try:
        config = LayerSkipConfig.from_pretrained(path)  # a config.json only: there are no weights
    except OSError:
        raise ModelNotFoundError(f"drafter.path: {path}: no layerskip drafter folder there") from None
    return LayerSkipModel(config).eval()


def _no_loss(*args, **kwargs):
    raise ConfigError("drafter=layerskip: the skip set is searched, not trained with a loss")


def _search(cfg, check_inputs) -> dict:
    from drafter_train.drafters.layerskip.search import search  # the search loads optuna: only when it runs

    return search(cfg, check_inputs)


KIND = register(DrafterKind(
    name="layerskip",
    description="a self-speculative layer-skipping drafter",
    model_type=MODEL_TYPE,
    config_class=LayerSkipDrafterConfig,
    build=build,
    load=load,
    decoder_drafter=LayerSkipDrafter,
    loss=_no_loss,
    has_weights=False,
    fit=_search,
    engine_methods={},
    summary="Self-speculative decoding (Draft & Verify): the target drafts for itself with the recorded attention "
            "and MLP sub-layers skipped, on its own KV cache; no weights of its own.",
    card_tags=("self-speculative", "layer-skipping"),
))

AutoConfig.register(MODEL_TYPE, LayerSkipConfig, exist_ok=True)
AutoModel.register(LayerSkipConfig, LayerSkipModel, exist_ok=True)
