"""Spec-Drafter (SpecDec, Xia et al. 2022) for decoder-only targets: draft_len tokens in ONE forward pass.

The context is read causally, like any decoder; then draft_len learned [MASK] queries are appended. Query r sits at
position L + r (L = context length) and predicts the token there. The queries attend to the whole context and to
each other (bidirectionally within the block) but never to a token they predict: those tokens are not in the input.

    tokens x_0 .. x_{L-1}  -> embed -> encoder layers (context only, causal)
                           -> decoder layers: [context ; mask_0 .. mask_{k-1}] with the block mask below
                           -> final norm -> LM head on the k query rows -> q_1 .. q_k  (k next-token distributions)

SpecDec's design point "deep encoder, shallow decoder" is the `encoder_layers` option: the queries only pass
through the top `decoder_layers`; the context passes through all of them. Both stacks are the target's own
architecture (AutoModel from the target's config), so Llama, Qwen2, SmolLM, Mistral... work unchanged; a drafter can
be cut from the target's first layers, embeddings, final norm and LM head (`from_target`).

Target signals used: token embeddings and LM head (copied from the target), and its first layers as initialisation.
The target's hidden states are NOT used: the drafter stays a stand-alone model that reads tokens only, so it is
evaluated, exported and reloaded like an AR drafter.

Caching between decoding steps: the context keys/values of both stacks are cached by position like an AR drafter's;
a proposal feeds only the new tokens (1 to k+1 per step) plus the k queries, then drops the queries' keys/values
(the next step's queries see a longer context). So the prefix is never re-encoded.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, DynamicCache, PretrainedConfig, PreTrainedModel

from drafter_train.config import DrafterConfig, TrainJobConfig
from drafter_train.drafters.nar.config import NARDrafterConfig
from drafter_train.data.batches import Batch
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.tree import TreePool
from drafter_train.drafters.ar.model import SCRATCH, scratch_config
from drafter_train.drafters.registry import BuildContext, DrafterKind, register
from drafter_train.drafters.common.truncated import parse_truncated
from drafter_train.errors import ConfigError
from drafter_train.losses import LossOutput
from drafter_train.drafters.common.block_distill import nar_distill_loss, to_blocks

MODEL_TYPE = "spec_drafter"


class SpecDrafterConfig(PretrainedConfig):
    """`backbone`: the target architecture's config as a dict (its layer count is ignored); encoder_layers +
    decoder_layers = the drafter's depth; draft_len = number of mask queries (the most drafts one pass proposes)."""

    model_type = MODEL_TYPE

    def __init__(self, backbone: Optional[dict] = None, encoder_layers: int = 0, decoder_layers: int = 2,
                 draft_len: int = 4, **kwargs):
        self.backbone = backbone or {}
        self.encoder_layers, self.decoder_layers, self.draft_len = encoder_layers, decoder_layers, draft_len
        super().__init__(**kwargs)

    def stack_config(self, num_layers: int) -> PretrainedConfig:
        """The backbone config of one stack of `num_layers` layers."""
        config = AutoConfig.for_model(**copy.deepcopy(self.backbone))
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):  # per-layer attention kinds must match the layer count
            config.layer_types = config.layer_types[:num_layers]
        config.tie_word_embeddings = False
        return config


def _stack(config: PretrainedConfig, final_norm: bool) -> PreTrainedModel:
    """A base decoder stack fed with `inputs_embeds` (its own embedding table is dropped)."""
    stack = AutoModel.from_config(config)
    stack.embed_tokens = nn.Identity()  # the drafter embeds once, in SpecDrafter.embed_tokens
    if not final_norm:  # the encoder hands the raw residual stream to the decoder, as inside the target
        stack.norm = nn.Identity()
    return stack


def block_attention_mask(attention_mask: Tensor, context_lens: Tensor, draft_len: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [B, 1, T + n*k, T + n*k] for T context tokens followed by n blocks of k = draft_len queries.

    attention_mask [B, T] (1 = real token), context_lens [B, n]: block m's queries predict tokens at positions
    context_lens[m] + r, r < k. Context rows: causal over real tokens, never the queries. Query rows of block m:
    context positions < context_lens[m] (so never what they predict) and the k queries of block m (bidirectional).
    """
    batch, length = attention_mask.shape
    n, device = context_lens.shape[1], attention_mask.device
    pos = torch.arange(length, device=device)
    ctx_rows = (pos[None, :, None] >= pos[None, None, :]) & attention_mask[:, None, :].bool()  # [B, T, T]
    ctx_rows = torch.cat([ctx_rows, ctx_rows.new_zeros(batch, length, n * draft_len)], dim=2)
    to_ctx = pos[None, None, :] < context_lens[:, :, None]  # [B, n, T]
    block = torch.arange(n, device=device).repeat_interleave(draft_len)  # [n*k] block id of each query
    to_queries = block[None, :, None] == block[None, None, :]  # [1, n*k, n*k]
    query_rows = torch.cat([to_ctx.repeat_interleave(draft_len, 1), to_queries.expand(batch, -1, -1)], dim=2)
    allowed = torch.cat([ctx_rows, query_rows], dim=1)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class SpecDrafter(PreTrainedModel):
    config_class = SpecDrafterConfig
    base_model_prefix = "spec_drafter"
    _no_split_modules = []
    # Applied when config.tie_word_embeddings (the target's own setting): one tensor, as in the target, so a
    # Spec-Drafter has the parameter count of the AR drafter cut from the same layers (plus draft_len queries).
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: SpecDrafterConfig):
        super().__init__(config)
        backbone = config.stack_config(config.decoder_layers)
        hidden, vocab = backbone.hidden_size, backbone.vocab_size
        self.encoder = _stack(config.stack_config(config.encoder_layers), False) if config.encoder_layers else None
        self.decoder = _stack(backbone, True)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.mask_embeds = nn.Parameter(torch.zeros(config.draft_len, hidden))  # one learned query per offset
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.backbone.get("initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, SpecDrafter):
            nn.init.normal_(module.mask_embeds, std=std)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def draft_len(self) -> int:
        return self.config.draft_len

    def _context(self, input_ids: Tensor, attention_mask: Optional[Tensor], cache=None) -> Tensor:
        """[B, T, H] context after the encoder layers (or just the embeddings without an encoder)."""
        hidden = self.embed_tokens(input_ids)
        if self.encoder is None:
            return hidden
        out = self.encoder(inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=cache,
                           use_cache=cache is not None)
        return out.last_hidden_state

    def _queries(self, glance_ids: Optional[Tensor], shape: tuple) -> Tensor:
        """[*shape, H] mask queries; with glancing (GLAT), a revealed position (id >= 0) gets its token's embedding."""
        queries = self.mask_embeds.expand(*shape, -1)
        if glance_ids is None:
            return queries
        revealed = (glance_ids >= 0)[..., None]
        return torch.where(revealed, self.embed_tokens(glance_ids.clamp_min(0)), queries)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, context_lens: Tensor,
                glance_ids: Optional[Tensor] = None) -> Tensor:
        """Training forward: logits [B, n, k, V] for n blocks per row, all in one pass.

        input_ids/attention_mask [B, T] (right-padded), context_lens [B, n] (block m predicts the tokens at
        context_lens[m] + r, r < k = draft_len), glance_ids [B, n, k] (GLAT: token ids revealed to the queries,
        -1 elsewhere).
        """
        batch, length = input_ids.shape
        n, k = context_lens.shape[1], self.config.draft_len
        context = self._context(input_ids, attention_mask)
        queries = self._queries(glance_ids, (batch, n, k)).reshape(batch, n * k, -1)
        offsets = torch.arange(k, device=input_ids.device)
        positions = torch.cat([torch.arange(length, device=input_ids.device).expand(batch, -1),
                               (context_lens[..., None] + offsets).view(batch, n * k)], dim=1)
        mask = block_attention_mask(attention_mask, context_lens, k, context.dtype)
        hidden = self.decoder(inputs_embeds=torch.cat([context, queries.to(context.dtype)], dim=1),
                              attention_mask=mask, position_ids=positions).last_hidden_state
        return self.lm_head(hidden[:, length:]).view(batch, n, k, -1)

    def draft_logits(self, new_ids: Tensor, caches: "NARCaches") -> Tensor:
        """Decoding: feed new context tokens [t] after the cached ones, return the k queries' logits [k, V].

        Context keys/values stay cached; the queries' are dropped again, since the next step's queries will sit
        after a longer context.
        """
        past, t, k = caches.length, new_ids.numel(), self.config.draft_len
        length = past + t  # context length: the queries predict positions length .. length + k - 1
        context = self._context(new_ids.view(1, -1), None, caches.encoder)
        positions = torch.arange(past, length + k, device=new_ids.device)[None]
        rows = positions[0, :, None]  # absolute position of each row
        cols = torch.arange(length + k, device=new_ids.device)[None]
        allowed = (cols <= rows) | (rows >= length)  # [t+k, L+k]: context rows causal, query rows see everything
        mask = torch.zeros(allowed.shape, dtype=context.dtype, device=new_ids.device)
        mask = mask.masked_fill(~allowed, torch.finfo(context.dtype).min)[None, None]
        hidden = self.decoder(inputs_embeds=torch.cat([context, self.mask_embeds[None].to(context.dtype)], dim=1),
                              attention_mask=mask, position_ids=positions, past_key_values=caches.decoder,
                              use_cache=True).last_hidden_state
        caches.decoder.crop(-k)  # negative: drop the k query positions
        caches.length = length
        return self.lm_head(hidden[0, t:])

    @classmethod
    def from_target(cls, target: PreTrainedModel, num_layers: int, encoder_layers: int, draft_len: int) -> "SpecDrafter":
        """A Spec-Drafter cut from the target: its first num_layers layers (the first encoder_layers of them only
        read the context), its embeddings, final norm and LM head; fresh mask queries. Weights are copied."""
        total = target.config.num_hidden_layers
        if not 1 <= num_layers < total:
            raise ConfigError(f"drafter.path: truncated:N needs 1 <= N < {total} (the target's layers), got {num_layers}")
        drafter = cls(spec_config(target.config, num_layers, encoder_layers, draft_len)).to(target.dtype)
        layers, norm = target.get_decoder().layers, target.get_decoder().norm
        stacks = [(drafter.encoder, 0)] if drafter.encoder is not None else []
        for stack, first in stacks + [(drafter.decoder, encoder_layers)]:
            for i, layer in enumerate(stack.layers):
                layer.load_state_dict(layers[first + i].state_dict())
        drafter.decoder.norm.load_state_dict(norm.state_dict())
        drafter.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)
        drafter.lm_head.weight.data.copy_(target.get_output_embeddings().weight.data)
        # Queries start as the mean token embedding (a plausible input) plus noise that tells offsets apart.
        mean = drafter.embed_tokens.weight.data.float().mean(0)
        noise = torch.randn(draft_len, mean.numel()) * drafter.embed_tokens.weight.data.float().std() * 0.1
        drafter.mask_embeds.data.copy_(mean + noise.to(mean.device))
        return drafter.to(target.device)


def check_split(num_layers: int, encoder_layers: int) -> None:
    if not 0 <= encoder_layers < num_layers:
        raise ConfigError(f"drafter.encoder_layers: must be in [0, {num_layers}) (the queries need >= 1 decoder "
                          f"layer), got {encoder_layers}")


def spec_config(backbone: PretrainedConfig, num_layers: int, encoder_layers: int, draft_len: int) -> SpecDrafterConfig:
    """A SpecDrafterConfig on `backbone`'s architecture and vocabulary."""
    check_split(num_layers, encoder_layers)
    return SpecDrafterConfig(backbone=backbone.to_dict(), encoder_layers=encoder_layers,
                             decoder_layers=num_layers - encoder_layers, draft_len=draft_len,
                             vocab_size=backbone.vocab_size, eos_token_id=backbone.eos_token_id,
                             tie_word_embeddings=bool(getattr(backbone, "tie_word_embeddings", False)),
                             bos_token_id=backbone.bos_token_id, pad_token_id=getattr(backbone, "pad_token_id", None))


class NARCaches:
    """Both stacks' context KV caches for ONE sequence and how many context tokens they hold."""

    def __init__(self, model: SpecDrafter):
        # full caches, as the target's (cached_lm.py): a sliding layer's cache cannot be cropped back past its window
        self.encoder = DynamicCache() if model.encoder is not None else None
        self.decoder = DynamicCache()
        self.length = 0

    def crop(self, length: int) -> None:
        if length < self.length:
            for cache in (self.encoder, self.decoder):
                if cache is not None:
                    cache.crop(length - self.length)
            self.length = length


class NARDrafter:
    """The decoder-side Spec-Drafter: all drafts of a proposal from ONE forward pass.

    The k per-position distributions do not depend on each other's draws, so q_draft[r] is exactly the
    distribution draft r was drawn from, whatever was drawn before it: speculative sampling stays lossless.
    """

    feature_layers: Sequence[int] = ()

    def __init__(self, model: SpecDrafter):
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.caches = NARCaches(self.model)

    def propose(
        self, seq: Tensor, draft_len: int, params: SamplingParams, generator: Optional[torch.Generator]
    ) -> Proposal:
        if draft_len > self.model.draft_len:
            raise ConfigError(
                f"eval.draft_len: this Spec-Drafter has {self.model.draft_len} mask queries, cannot draft {draft_len}"
            )
        logits = self.model.draft_logits(seq[self.caches.length :], self.caches)  # [model draft_len, V]
        drafts = [choose_token(logits[r], params, generator) for r in range(draft_len)]
        q_draft = None if params.greedy else torch.stack([q for _, q in drafts])
        return Proposal(tokens=torch.stack([token for token, _ in drafts]), q_draft=q_draft)

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path=None) -> None:
        self.caches.crop(num_valid)  # drafts never enter the cache, so this only matters for shorter sequences

    # Trees: the one pass gives every block position's distribution, whatever was drafted before it, so a node's
    # children are the top-k (or samples) of the next position's distribution: no drafter call per depth.
    draft_ids: Optional[Tensor] = None

    def tree_root(self, seq: Tensor) -> Tensor:
        self.block = self.model.draft_logits(seq[self.caches.length :], self.caches)  # [model draft_len, V]
        return self.block[0]

    def tree_expand(self, pool: TreePool, nodes: list[int]) -> Tensor:
        positions = [pool.depths[node] for node in nodes]  # block position of the nodes' children (0-based)
        if max(positions) >= self.model.draft_len:
            raise ConfigError(f"eval.tree.depth: this Spec-Drafter has {self.model.draft_len} mask queries, cannot "
                              f"draft {max(positions) + 1} deep")
        return self.block[positions]


# ----------------------------------------------------------------------------------------------------------------
# The kind: build/load, training, decoding (registered in drafters/registry.py)


def build(cfg: DrafterConfig, ctx: BuildContext) -> SpecDrafter:
    """truncated:N (cut from the target), scratch (new, sized by the config) or a saved Spec-Drafter folder."""
    num_layers = parse_truncated(cfg.path)
    if num_layers is not None:
        drafter = SpecDrafter.from_target(ctx.target, num_layers, cfg.encoder_layers, cfg.draft_len)
    elif cfg.path == SCRATCH:
        spec = spec_config(scratch_config(cfg, ctx.target), cfg.num_layers, cfg.encoder_layers, cfg.draft_len)
        drafter = SpecDrafter(spec).to(dtype=ctx.target.dtype, device=ctx.target.device)
    else:
        drafter = load(cfg.path, ctx.dtype).to(ctx.target.device)
    if ctx.for_training and drafter.draft_len != cfg.draft_len:
        raise ConfigError(f"drafter.draft_len: {cfg.path} has {drafter.draft_len} mask queries; train it with "
                          f"drafter.draft_len={drafter.draft_len}")
    return drafter


def load(path: str, dtype: str) -> SpecDrafter:
    drafter = SpecDrafter.from_pretrained(path, dtype=getattr(torch, dtype)).eval()  # "float32" -> torch.float32
    return drafter.requires_grad_(False)  # as load_causal_lm: training turns gradients back on


def loss(module: nn.Module, target: PreTrainedModel, blocks: Batch, cfg: TrainJobConfig) -> LossOutput:
    return nar_distill_loss(module, target, blocks, cfg.loss, cfg.drafter)


KIND = register(DrafterKind(
    name="nar",
    description="a Spec-Drafter",
    model_type=MODEL_TYPE,
    config_class=NARDrafterConfig,
    build=build,
    load=load,
    decoder_drafter=NARDrafter,
    loss=loss,
    # A Spec-Drafter's own forward takes training inputs (draft blocks), so it is trained as it is.
    prepare_batch=lambda batch, records, cfg: to_blocks(batch, cfg.drafter),
    summary="A non-autoregressive Spec-Drafter (SpecDec): its mask queries predict a whole block of draft tokens in "
            "one forward pass.",
    card_tags=("spec-drafter", "non-autoregressive"),
))

# Importing this module lets transformers' Auto classes load saved Spec-Drafter folders.
AutoConfig.register(MODEL_TYPE, SpecDrafterConfig, exist_ok=True)
AutoModel.register(SpecDrafterConfig, SpecDrafter, exist_ok=True)
