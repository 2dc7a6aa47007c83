"""Drafters for encoder-decoder targets, and the rule for sharing the target's encoder output.

AR drafter (Leviathan et al. 2023's T5-small-for-T5-XXL setting): a seq2seq model of the target's own class with
fewer layers, cut from the target (`cut_from_target`: its encoder and first decoder layers, embeddings and head) or
built small with fresh weights (`small_from_target`). It drafts through decoding/drafter.py's ARDrafter, on its
decoder bound to the request's encoder output (target.py), so its cache is cropped by position like any AR drafter's.

NAR drafter (SpecDec's Spec-Drafter, Xia et al. 2022): an encoder-decoder whose decoder reads the accepted prefix
and then k = draft_len learned [MASK] queries, and drafts k tokens in ONE pass; deep encoder, shallow decoder by
default (`SpecDrafter.from_target`: the target's whole encoder, its first decoder layer):

    source -> encoder (deep)                                      (once per request)
    [start, y_1 .. y_L, MASK_0 .. MASK_{k-1}] -> decoder (shallow, causal) -> head on the k query rows -> q_1 .. q_k

Query r sits at decoder position L + 1 + r, where the token it predicts would sit, and never sees that token (it is
not in the input). The prefix is re-read every proposal (no drafter KV cache: the decoder is one layer and the
prefixes of translation-length outputs are short; a cached variant is the decoder-only kind's, drafters/nar).
Trees: the same one pass per tree. Query d does not see the drafts before it, so every node at depth d gets query d's
distribution as its children's (`tree_expand`); a tree is at most draft_len deep. The AR drafter grows trees through
ARDrafter's own tree calls, on a decoder that takes tree positions (target.py `check_trees`).

Sharing the encoder (the rule): a drafter uses the target's encoder output exactly when its encoder IS the target's
encoder, weight for weight (`same_encoder`); cutting from the target gives that, and training then freezes the
encoder so it stays so. Such a drafter costs no encoder pass of its own (the target pays its one pass per request in
both plain and speculative decoding), and its size is reported with the encoder counted as shared. Any other drafter
encodes the source itself, once per request, and that time is counted in the drafter's seconds (decoding.py).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from drafter_train.decoding.drafter import ARDrafter, Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.tree import TreePool, TreeSpec
from drafter_train.errors import ConfigError
from drafter_train.seq2seq.target import (Source, bind, check_trees, encode, layer_fields, model_class,
                                          num_layers)


def with_layers(config: PretrainedConfig, encoder: Optional[int] = None, decoder: Optional[int] = None):
    """A copy of a seq2seq config with other layer counts (None: keep)."""
    config = copy.deepcopy(config)
    enc_field, dec_field = layer_fields(config)
    enc, dec = num_layers(config)
    setattr(config, enc_field, enc if encoder is None else encoder)
    setattr(config, dec_field, dec if decoder is None else decoder)
    return config


def cut_from_target(target: PreTrainedModel, decoder_layers: int) -> PreTrainedModel:
    """The target with only its first `decoder_layers` decoder layers (weights copied; the encoder is the target's)."""
    total = num_layers(target.config)[1]
    if not 1 <= decoder_layers < total:
        raise ConfigError(f"drafter.decoder_layers: must be in [1, {total}) (the target's decoder layers), "
                          f"got {decoder_layers}")
    drafter = type(target)(with_layers(target.config, decoder=decoder_layers)).to(target.dtype)
    missing = drafter.load_state_dict(target.state_dict(), strict=False).missing_keys
    if missing:
        raise ValueError(f"cut_from_target: no target weights for {missing[:3]}")
    drafter.generation_config = copy.deepcopy(target.generation_config)
    return drafter.to(target.device)


def small_from_target(target: PreTrainedModel, encoder_layers: int, decoder_layers: int) -> PreTrainedModel:
    """A new seq2seq model of the target's class and width with fewer layers and fresh weights."""
    drafter = type(target)(with_layers(target.config, encoder_layers, decoder_layers)).to(target.dtype)
    drafter.generation_config = copy.deepcopy(target.generation_config)
    return drafter.to(target.device)


def same_encoder(drafter: PreTrainedModel, target: PreTrainedModel) -> bool:
    """Whether the drafter's encoder is the target's, weight for weight (the sharing rule)."""
    mine, theirs = drafter.get_encoder().state_dict(), target.get_encoder().state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k].to(mine[k].device)) for k in mine)


def parameter_counts(drafter: PreTrainedModel, shares_encoder: bool) -> dict:
    """The drafter's parameters, with its encoder's apart (counted as the target's when shared)."""
    total = sum(p.numel() for p in drafter.parameters())
    encoder = sum(p.numel() for p in drafter.get_encoder().parameters())
    return {"parameters": total, "encoder_parameters": encoder, "encoder_shared": shares_encoder}


# ----------------------------------------------------------------------------------------------------------------
# NAR: SpecDec's Spec-Drafter


class SpecDrafterConfig(PretrainedConfig):
    """`backbone`: the seq2seq config (as a dict) of the encoder-decoder under the queries; draft_len: mask queries."""

    model_type = "seq2seq_spec_drafter"

    def __init__(self, backbone: Optional[dict] = None, draft_len: int = 4, **kwargs):
        self.backbone, self.draft_len = backbone or {}, draft_len
        super().__init__(**kwargs)


class SpecDrafter(PreTrainedModel):
    """An encoder-decoder (`seq2seq`, the backbone's own class) plus draft_len learned mask queries."""

    config_class = SpecDrafterConfig
    base_model_prefix = "spec_drafter"

    def __init__(self, config: SpecDrafterConfig):
        super().__init__(config)
        backbone = AutoConfig.for_model(**copy.deepcopy(config.backbone))
        self.seq2seq = model_class(backbone).from_config(backbone)
        self.mask_embeds = nn.Parameter(torch.zeros(config.draft_len, backbone.d_model))  # one query per offset
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if module is self:
            nn.init.normal_(self.mask_embeds, std=0.02)

    @property
    def draft_len(self) -> int:
        return self.config.draft_len

    def get_encoder(self):
        return self.seq2seq.get_encoder()

    @classmethod
    def from_target(cls, target: PreTrainedModel, draft_len: int, decoder_layers: int = 1) -> "SpecDrafter":
        """Deep encoder, shallow decoder: the target's encoder and first `decoder_layers` decoder layers (copied),
        its embeddings and head, and fresh queries (the mean embedded token plus noise that tells offsets apart)."""
        seq2seq = cut_from_target(target, decoder_layers)
        drafter = cls(SpecDrafterConfig(seq2seq.config.to_dict(), draft_len)).to(target.device, target.dtype)
        drafter.seq2seq.load_state_dict(seq2seq.state_dict())  # after construction, which initialises every weight
        drafter.seq2seq.generation_config = seq2seq.generation_config
        with torch.no_grad():  # in the space the queries live in: the decoder's token embeddings (block_logits)
            vocab = torch.arange(seq2seq.config.vocab_size, device=target.device)
            table = drafter.seq2seq.get_decoder().embed_tokens(vocab).float()
        noise = torch.randn(draft_len, table.shape[1], generator=torch.Generator().manual_seed(0)) * table.std() * 0.1
        drafter.mask_embeds.data.copy_(table.mean(0) + noise.to(table.device))
        return drafter

    def block_logits(self, encoder_outputs, attention_mask: Optional[Tensor], prefix_ids: Tensor,
                     prefix_lens: Tensor) -> Tensor:
        """prefix_ids [B, P] (decoder start + accepted tokens, right-padded), prefix_lens [B] -> logits [B, k, V] of
        the k queries placed right after each row's prefix (what is after them, padding, the causal mask hides)."""
        batch, k = prefix_ids.shape[0], self.draft_len
        ids = torch.cat([prefix_ids, prefix_ids.new_zeros(batch, k)], dim=1)  # room for the queries
        embeds = self.seq2seq.get_decoder().embed_tokens(ids)  # [B, P + k, H]: what input_ids would become
        slots = prefix_lens[:, None] + torch.arange(k, device=ids.device)  # [B, k] the queries' positions
        queries = self.mask_embeds.to(embeds.dtype).expand(batch, -1, -1)
        embeds = embeds.scatter(1, slots[..., None].expand(-1, -1, embeds.shape[-1]), queries)
        logits = self.seq2seq(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                              decoder_inputs_embeds=embeds, use_cache=False).logits  # [B, P + k, V]
        return logits.gather(1, slots[..., None].expand(-1, -1, logits.shape[-1]))


class NARSession:
    """One request's Spec-Drafter on the decoder side (decoding/drafter.py's Drafter): all drafts of a proposal from
    one pass. The k distributions do not depend on each other's draws, so q_draft[r] is exactly what draft r was
    drawn from: speculative sampling stays lossless."""

    feature_layers = ()
    draft_ids = None

    def __init__(self, model: SpecDrafter, encoder_outputs, attention_mask: Optional[Tensor]):
        self.model, self.encoder_outputs, self.attention_mask = model, encoder_outputs, attention_mask

    def reset(self) -> None:
        pass  # nothing is cached across proposals but the encoder output, which belongs to the request

    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams,
                generator: Optional[torch.Generator]) -> Proposal:
        if draft_len > self.model.draft_len:
            raise ConfigError(f"eval.draft_len: this Spec-Drafter has {self.model.draft_len} mask queries, cannot "
                              f"draft {draft_len}")
        lens = torch.tensor([seq.numel()], device=seq.device)
        logits = self.model.block_logits(self.encoder_outputs, self.attention_mask, seq.view(1, -1), lens)[0]
        drafts = [choose_token(logits[r], params, generator) for r in range(draft_len)]
        q_draft = None if params.greedy else torch.stack([q for _, q in drafts])
        return Proposal(tokens=torch.stack([token for token, _ in drafts]), q_draft=q_draft)

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path=None) -> None:
        pass  # drafts never enter a cache

    def tree_root(self, seq: Tensor) -> Tensor:
        """One pass over the prefix and every query (module doc): query 0's logits now, the others for tree_expand."""
        lens = torch.tensor([seq.numel()], device=seq.device)
        self.rows = self.model.block_logits(self.encoder_outputs, self.attention_mask, seq.view(1, -1), lens)[0]
        return self.rows[0]

    def tree_expand(self, pool: TreePool, nodes: list[int]) -> Tensor:
        """The children of depth-d nodes: query d's distribution, the same for every parent (it never saw them)."""
        return self.rows[pool.depths[nodes[0]]].expand(len(nodes), -1)


# ----------------------------------------------------------------------------------------------------------------
# What the seq2seq decoder calls: a drafter per request


class Seq2SeqDrafter:
    """A trained AR or NAR drafter model -> its decoder-side Drafter for one request (`for_source`)."""

    def __init__(self, model: PreTrainedModel, target: PreTrainedModel):
        self.model = model
        self.shares_encoder = same_encoder(model, target)  # the sharing rule (module doc)

    def check_tree(self, spec: TreeSpec, target: PreTrainedModel) -> None:
        """Refuse, in one line and before decoding, a tree this drafter and target cannot grow and verify."""
        check_trees(target)
        if isinstance(self.model, SpecDrafter) and spec.depth > self.model.draft_len:
            raise ConfigError(f"eval.tree.depth: this Spec-Drafter has {self.model.draft_len} mask queries, cannot "
                              f"draft a tree {spec.depth} deep")

    def for_source(self, source: Source, target_encoding):
        """The drafter for one request: on the target's encoder output when shared, else after its own encoder pass."""
        encoding = target_encoding if self.shares_encoder else encode(self.model, source)
        if isinstance(self.model, SpecDrafter):
            return NARSession(self.model, encoding, source.attention_mask)
        return ARDrafter(bind(self.model, source, encoding))
