"""DFlash (arXiv 2602.06036): a one-pass block drafter whose every layer reads the target's context features.

SpecDec's drafting (one forward proposes a whole block) with the target's own hidden states as the context:

    context c_j (j < a)  = hidden_norm(fc(target features at position j))          [n_t * H_t -> H]   (fuse)
    block   (positions a .. a + B - 1) = [embed(x_a); mask; ...; mask]                 (x_a: the anchor)
    every drafter layer: queries from the block rows only; keys/values from [context rows; block rows], where a
                         context row's k/v are that layer's k_proj/v_proj (k_norm, RoPE) of c_j, and the block rows
                         attend to each other bidirectionally
    block row k >= 1     -> norm -> LM head over the draft vocabulary ~ p_target(x_{a+k} | x_<a+k)

Row k predicts the token AT position a + k (the anchor's row is not read), the convention vLLM and SGLang serve.

The layers are the target architecture's own decoder layers (transformers' modules, `qk_norm` adds Qwen3's per-head
q/k RMSNorm where the target has none). Context keys/values are written into a transformers DynamicCache before the
block rows run, so the layers' own attention does the injection: the training forward and the decoder share it.

Training: random anchors in the response, many per sequence, all in one forward; a block sees the context strictly
before its anchor and its own rows, never another block (`block_mask`). Decoding: the cache holds the context
keys/values of every verified position, computed from the target's verify-pass features; a proposal runs one pass
over [last token, mask x draft_len] and drops the block's keys/values again.
"""

from __future__ import annotations

import copy
import importlib
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from transformers import (AutoConfig, AutoModel, DynamicCache, LlamaConfig, PretrainedConfig, PreTrainedModel,
                          Qwen3Config)

from drafter_train import draft_vocab
from drafter_train.config import DrafterConfig, TrainJobConfig
from drafter_train.drafters.dflash.config import DFlashDrafterConfig
from drafter_train.cpu_kernels import stock_kernels
from drafter_train.data.batches import Batch
from drafter_train.drafters.common.backbone import plain_layer_config
from drafter_train.drafters.common.distill import apply_loss
from drafter_train.drafters.common import conditioned
from drafter_train.drafters.dflash import export as dflash_export
from drafter_train.drafters.dflash.drafter import DFlashDrafter
from drafter_train.drafters.registry import BuildContext, DrafterKind, register
from drafter_train.errors import ConfigError
from drafter_train.features import check_layers, evenly_spaced_layers, num_layers
from drafter_train.losses import LossOutput
from drafter_train.drafters.common.block_distill import block_batch, glance, sample_block_starts

MODEL_TYPE = "dflash_drafter"


class DFlashConfig(PretrainedConfig):
    """`backbone`: the config (as a dict) whose decoder layer the drafter stacks num_layers times; target_layers: the
    fused target layers (features.py convention) of a target with target_num_layers layers; block_size: the trained
    block; mask_token_id: the id serving engines put in mask slots (learned_mask: its embedding is learned);
    lm_head_is_target: the LM head is the target's whole head, never trained (what SGLang can serve)."""

    model_type = MODEL_TYPE

    def __init__(self, backbone: Optional[dict] = None, num_layers: int = 1, block_size: int = 16,
                 target_layers: Sequence[int] = (), target_num_layers: int = 0, target_hidden_size: int = 0,
                 draft_vocab_size: int = 0, fc_norm: bool = False, draft_len: int = 15, mask_token_id: int = 0,
                 learned_mask: bool = True, lm_head_is_target: bool = False,
                 draft_vocab_fingerprint: Optional[str] = None, **kwargs):
        self.backbone, self.num_layers, self.block_size = backbone or {}, num_layers, block_size
        self.target_layers, self.target_num_layers = list(target_layers), target_num_layers
        self.target_hidden_size, self.draft_vocab_size = target_hidden_size, draft_vocab_size
        self.fc_norm, self.draft_len = fc_norm, draft_len
        self.mask_token_id, self.learned_mask = mask_token_id, learned_mask
        self.lm_head_is_target = lm_head_is_target
        self.draft_vocab_fingerprint = draft_vocab_fingerprint  # draft_vocab.fingerprint of d2t, checked at load
        self.initializer_range = self.backbone.get("initializer_range", 0.02)
        super().__init__(**kwargs)

    def layer_config(self) -> PretrainedConfig:
        """The backbone architecture with num_layers layers."""
        config = AutoConfig.for_model(**copy.deepcopy(self.backbone))
        config.num_hidden_layers = self.num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = (config.layer_types * self.num_layers)[:self.num_layers]
        config.tie_word_embeddings = False
        return config


def layer_backbone(target_config: PretrainedConfig, qk_norm: bool) -> dict:
    """The drafter layers' architecture: Qwen3 layers of the target's sizes (qk_norm: the layer DFlash, vLLM and
    SGLang use), else Llama layers; a Qwen3 target (qk_norm) or a Llama one (no qk_norm) lends its own config."""
    own, config_class = ("qwen3", Qwen3Config) if qk_norm else ("llama", LlamaConfig)
    if target_config.model_type == own:
        return target_config.to_dict()
    return plain_layer_config(target_config, config_class)


def block_mask(attention_mask: Tensor, anchors: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [B, 1, n * size, T + n * size]: n blocks of `size` rows over T context keys then the blocks'
    own keys. attention_mask [B, T] (1 = real token), anchors [B, n]: block m sits at positions anchors[m] + r.
    A row of block m sees the real context positions < anchors[m] and every row of block m, nothing else."""
    batch, length = attention_mask.shape
    n, device = anchors.shape[1], attention_mask.device
    pos = torch.arange(length, device=device)
    to_ctx = (pos[None, None, :] < anchors[..., None]) & attention_mask[:, None, :].bool()  # [B, n, T]
    block = torch.arange(n, device=device).repeat_interleave(size)  # [n*size] block of each row
    to_blocks = (block[:, None] == block[None, :]).expand(batch, -1, -1)
    allowed = torch.cat([to_ctx.repeat_interleave(size, 1), to_blocks], dim=2)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class DFlashModel(conditioned.TargetFeaturesModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _no_split_modules = []

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        layer_config = config.layer_config()
        base = AutoModel.from_config(layer_config)  # the layers' architecture, transformers' own modules
        hidden, vocab = layer_config.hidden_size, layer_config.vocab_size
        norm_class, eps = type(base.norm), layer_config.rms_norm_eps
        self._add_inputs(config, norm_class, eps, hidden, vocab)
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if config.learned_mask else None
        self.hidden_norm = norm_class(hidden, eps=eps)
        self.layers, self.norm, self.rotary_emb = base.layers, base.norm, base.rotary_emb
        # RoPE as the layers' attention applies it (their module's function)
        self._apply_rope = importlib.import_module(type(self.layers[0].self_attn).__module__).apply_rotary_pos_emb
        self._add_head(config, hidden, vocab)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- the pieces shared by training and decoding ----

    def fuse(self, features: Tensor) -> Tensor:
        """[..., n * H_t] target features -> [..., H] context rows: hidden_norm(fc(features))."""
        return self.hidden_norm(self.fused_input(features))

    def add_context(self, cache: DynamicCache, context: Tensor, positions: Tensor) -> None:
        """Append the keys/values of context rows [B, T, H] at `positions` [B, T] to every layer's cache entry: each
        layer's own k_proj / v_proj (and k_norm), RoPE at the positions. No query, no attention: rows are only read."""
        cos, sin = self.rotary_emb(context, positions)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            shape = (*context.shape[:-1], -1, attn.head_dim)
            keys = attn.k_proj(context).view(shape)
            if hasattr(attn, "k_norm"):
                keys = attn.k_norm(keys)
            keys = keys.transpose(1, 2)
            keys = self._apply_rope(keys, keys, cos, sin)[1]
            cache.update(keys, attn.v_proj(context).view(shape).transpose(1, 2), i)

    def block_embeds(self, anchor_ids: Tensor, size: int, glance_ids: Optional[Tensor] = None) -> Tensor:
        """[*A, size, H]: the anchor tokens' embeddings [*A] then size - 1 mask slots (GLAT glancing: a slot whose
        glance_ids [*A, size - 1] entry is a token id >= 0 gets that token's embedding instead)."""
        mask = self.mask_embedding if self.mask_embedding is not None else \
            self.embed_tokens.weight[self.config.mask_token_id]
        slots = mask.expand(*anchor_ids.shape, size - 1, -1)
        if glance_ids is not None:
            revealed = (glance_ids >= 0)[..., None]
            slots = torch.where(revealed, self.embed_tokens(glance_ids.clamp_min(0)), slots)
        return torch.cat([self.embed_tokens(anchor_ids)[..., None, :], slots.to(self.embed_tokens.weight.dtype)], -2)

    def run_block(self, embeds: Tensor, positions: Tensor, mask: Tensor, cache: DynamicCache) -> Tensor:
        """Block rows [B, Q, H] at `positions` [B, Q] through every layer, over the cached context keys/values plus
        their own (appended to the cache); `mask` [B, 1, Q, C + Q] additive. Returns the last layer's output."""
        hidden, embeddings = embeds, self.rotary_emb(embeds, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True, position_embeddings=embeddings)
        return hidden

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] block rows -> [..., Vd] logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config.layer_config())

    # ---- training ----

    def forward(self, input_ids: Tensor, features: Tensor, attention_mask: Tensor, anchors: Tensor,
                glance_ids: Optional[Tensor] = None, block_size: Optional[int] = None) -> Tensor:
        """Training forward, every block of every row in one pass (so DDP / DeepSpeed hooks run).

        input_ids/attention_mask [B, T], features [B, T, n*H_t] (the target's, at every position), anchors [B, n]
        (block m: anchor token at anchors[m], clamped into the sequence), glance_ids [B, n, S - 1] (or None).
        Returns logits [B, n, S - 1, Vd]: row k of block m predicts the token at anchors[m] + k (S = block_size,
        default the trained one).
        """
        batch, length = input_ids.shape
        size = block_size or self.config.block_size
        anchors = anchors.clamp(0, length - 1)
        cache = self.new_cache()
        self.add_context(cache, self.fuse(features), torch.arange(length, device=input_ids.device).expand(batch, -1))
        embeds = self.block_embeds(torch.gather(input_ids, 1, anchors), size, glance_ids).flatten(1, 2)
        positions = (anchors[..., None] + torch.arange(size, device=anchors.device)).flatten(1)
        mask = block_mask(attention_mask, anchors, size, embeds.dtype)
        hidden = self.run_block(embeds, positions, mask, cache).view(batch, anchors.shape[1], size, -1)
        return self.draft_logits(hidden[:, :, 1:])

    # ---- construction ----

    @classmethod
    def from_target(cls, target: PreTrainedModel, cfg: DFlashDrafterConfig, layer_ids: Sequence[int],
                    draft_ids: Tensor, mask_token_id: int) -> "DFlashModel":
        """A new drafter for `target`: frozen copy of its embeddings, its LM head rows of the draft vocabulary and
        final norm; fc and the layers freshly initialised; the learned mask starts at zero."""
        t = target.config
        vocab = target.get_input_embeddings().num_embeddings
        config = DFlashConfig(backbone=layer_backbone(t, cfg.qk_norm), num_layers=cfg.num_layers,
                              block_size=cfg.block_size, target_layers=list(layer_ids),
                              target_num_layers=num_layers(target), target_hidden_size=t.hidden_size,
                              draft_vocab_size=draft_ids.numel(), fc_norm=cfg.fc_norm, draft_len=cfg.draft_len,
                              mask_token_id=mask_token_id, learned_mask=cfg.learned_mask,
                              lm_head_is_target=draft_ids.numel() == vocab, vocab_size=vocab,
                              eos_token_id=t.eos_token_id, bos_token_id=t.bos_token_id,
                              pad_token_id=getattr(t, "pad_token_id", None), tie_word_embeddings=False)
        drafter = cls(config).to(target.dtype)
        drafter.copy_from_target(target, draft_ids)
        if drafter.mask_embedding is not None:
            # Zero, not a token's or the mean embedding: a mask slot's residual stream then holds only what its
            # layers read from the anchor and the context. Starting from the mean embedding, that vector drowned
            # what attention brought (stories260K, 100 steps: position-1 acceptance 0.48 instead of 0.97).
            drafter.mask_embedding.data.zero_()
        return drafter.to(target.device)


# ----------------------------------------------------------------------------------------------------------------
# Training


def position_decay(block_size: int, gamma: Optional[float]) -> float:
    """gamma of the position weights: the configured one, or DFlash's for the block size (7, 5, 4 for 16, 10, 8),
    linear between those sizes and beyond them."""
    if gamma is not None:
        return gamma
    points = [(8, 4.0), (10, 5.0), (16, 7.0)]
    (b0, g0), (b1, g1) = points[:2] if block_size < 10 else points[1:]
    return max(g0 + (block_size - b0) * (g1 - g0) / (b1 - b0), 0.5)


def position_weights(block_size: int, gamma: Optional[float]) -> Tensor:
    """[B - 1] loss weight of block rows k = 1 .. B - 1: exp(-(k - 1) / gamma) (gamma = 0: all 1)."""
    gamma = position_decay(block_size, gamma)
    k = torch.arange(block_size - 1, dtype=torch.float32)
    return torch.exp(-k / gamma) if gamma > 0 else torch.ones_like(k)


def to_anchor_blocks(batch: Batch, cfg: DFlashDrafterConfig) -> Batch:
    """Random anchors (drafter.blocks_per_sequence per row, torch's checkpointed RNG) in the response, as draft
    blocks: the batch's response fields hold, per block, the B - 1 tokens after its anchor (nar_distill.block_batch,
    whose `context_lens` is then anchor position + 1). An anchor is a response token with one after it."""
    after_first = batch.resp_mask.clone()
    # The first learned token of a turn is predicted from the token before it (the prompt's or the turn header's
    # last), which is not learned: never an anchor. Single-turn data: just response index 0.
    after_first[:, 1:] &= batch.resp_pos[:, 1:] == batch.resp_pos[:, :-1] + 1
    after_first[:, 0] = False
    starts = sample_block_starts(after_first, cfg.blocks_per_sequence)  # first predicted response index
    return block_batch(batch, starts, cfg.block_size - 1)


def prepare_batch(batch: Batch, records: list, cfg: TrainJobConfig) -> Batch:
    return to_anchor_blocks(conditioned.attach_cached_features(batch, records, cfg), cfg.drafter)


def dflash_loss(module: nn.Module, target: PreTrainedModel, blocks: Batch, cfg: TrainJobConfig) -> LossOutput:
    """The configured loss per block row against the target's distribution over the draft vocabulary (ce: the
    data's tokens, those outside the draft vocabulary masked), weighted by position; windowed losses use each block
    as their window. Counted per block token (the batch's num_tokens)."""
    model = module.module if hasattr(module, "module") else module  # DDP wraps; buffers are read, not trained
    with conditioned.target_precision(blocks.input_ids.device, cfg):
        features, target_hidden = conditioned.target_signals(target, blocks, model.config.target_layers)
    size = model.config.block_size
    rows, n = blocks.context_lens.shape
    anchors, shape = blocks.context_lens - 1, (rows, n, size - 1)
    labels, mask = conditioned.draft_labels(model, blocks.labels).view(shape), blocks.resp_mask.view(shape)
    learn = mask & (labels >= 0) if cfg.loss.name == "ce" else mask
    glance_ids = None
    if cfg.drafter.glancing_ratio > 0:
        with torch.no_grad(), stock_kernels():  # glancing's guesses are training data (cpu_kernels.py)
            guess = draft_vocab.draft_to_target(model.d2t)[module(blocks.input_ids, features, blocks.attention_mask,
                                                                  anchors).argmax(-1)]
        glance_ids, learn = glance(guess, blocks.labels.view(shape), learn, cfg.drafter.glancing_ratio)
    student = module(blocks.input_ids, features, blocks.attention_mask, anchors, glance_ids)  # [B, n, S - 1, Vd]

    def teacher() -> torch.Tensor:  # computed only by the losses that read it
        with conditioned.target_precision(blocks.input_ids.device, cfg):
            return conditioned.draft_teacher(model, target, target_hidden).view(rows * n, size - 1, -1)

    weights = position_weights(size, cfg.drafter.position_decay).to(student.device).expand(rows * n, -1)
    out = apply_loss(cfg.loss, student.flatten(0, 1).float(), labels.clamp(min=0).flatten(0, 1),
                     learn.flatten(0, 1), teacher, size - 1, weights)
    return LossOutput(out.loss_sum, mask.sum())


# ----------------------------------------------------------------------------------------------------------------
# The kind


def feature_layers(cfg: DrafterConfig, target: PreTrainedModel) -> list[int]:
    """drafter.target_layers, else num_layers target layers evenly spaced (features.evenly_spaced_layers)."""
    total = num_layers(target)
    if not cfg.target_layers and cfg.num_layers > total:
        raise ConfigError(f"drafter.num_layers: {cfg.num_layers} drafter layers read as many target layers by "
                          f"default, the target has {total}; name fewer in drafter.target_layers")
    if len(cfg.target_layers) > total:
        raise ConfigError(f"drafter.target_layers: {len(cfg.target_layers)} target layers requested, the target has "
                          f"{total}")
    return check_layers(cfg.target_layers or evenly_spaced_layers(total, cfg.num_layers), total)


def default_mask_token(tokenizer, vocab: int) -> int:
    """A token id for the engines' mask slots that the target does not generate: the last special token that is
    not BOS, EOS, padding or unknown, else the last id of the vocabulary."""
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = [i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i not in used and i < vocab]
    return max(special) if special else vocab - 1


def build(cfg: DrafterConfig, ctx: BuildContext) -> DFlashModel:
    target = ctx.target
    conditioned.check_new_or_saved(cfg, "DFlash")
    if cfg.path != "new":
        model = conditioned.check_target(load(cfg.path, ctx.dtype).to(target.device), target, "DFlash")
        if ctx.for_training and model.block_size != cfg.block_size:
            raise ConfigError(f"drafter.block_size: {cfg.path} was trained with blocks of {model.block_size}; "
                              f"continue it with drafter.block_size={model.block_size}")
        return mark_head(model, cfg, ctx)
    vocab = target.get_input_embeddings().num_embeddings
    mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token(ctx.tokenizer, vocab)
    if mask_token_id >= vocab:
        raise ConfigError(f"drafter.mask_token_id: {mask_token_id} is not a token id of the target (< {vocab})")
    model = DFlashModel.from_target(target, cfg, feature_layers(cfg, target),
                                    conditioned.choose_draft_ids(cfg, ctx, "DFlash"), mask_token_id)
    return mark_head(model, cfg, ctx)


def mark_head(model: DFlashModel, cfg: DrafterConfig, ctx: BuildContext) -> DFlashModel:
    """Training with a trainable LM head makes it the drafter's own, for good (exports read the flag)."""
    if ctx.for_training and not cfg.freeze_lm_head:
        model.config.lm_head_is_target = False
    return model


def load(path: str, dtype: str) -> DFlashModel:
    return conditioned.load_checked(DFlashModel, path, dtype, "DFlash")


KIND = register(DrafterKind(
    name="dflash",
    description="a DFlash drafter",
    model_type=MODEL_TYPE,
    config_class=DFlashDrafterConfig,
    build=build,
    load=load,
    decoder_drafter=DFlashDrafter,
    loss=dflash_loss,
    prepare_data=conditioned.data_preparer(feature_layers),
    prepare_batch=prepare_batch,
    export_formats=dflash_export.FORMATS,
    engine_methods={"vllm": "dflash", "sglang": "DFLASH", "gguf": "draft-dflash"},
    summary="A DFlash block drafter: one forward drafts a whole block, every layer reading the target's own fused "
            "context features as keys and values; a reduced draft vocabulary.",
    card_tags=("dflash", "target-conditioned", "non-autoregressive"),
))

# Importing this module lets transformers' Auto classes load saved DFlash drafter folders.
AutoConfig.register(MODEL_TYPE, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashModel, exist_ok=True)
