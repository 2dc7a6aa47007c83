"""Encoder-decoder targets through transformers' seq2seq classes, and one request's decoder as a causal LM.

A request is a source (token ids for text models, `input_features` for Whisper). Its encoder runs ONCE
(`encode`); `BoundSeq2Seq` then calls the model's decoder with those encoder states fixed, with the call signature
of a causal LM (`input_ids`, `past_key_values`, `logits_to_keep`). So decoding/'s CachedLM, plain decoding and the
speculative loop run unchanged on the decoder side:

    CachedLM's DynamicCache  = the decoder's self-attention cache  (cropped on rejection, by position)
    BoundSeq2Seq's own cache = the cross-attention keys/values of the encoder states (filled on the first decoder
                               pass of the request, never cropped: the source does not change)

Draft trees (decoding/tree.py) need the decoder to take, through its public forward, per-token positions (prefix
length + depth) and a 4-D ancestor mask. In transformers 5.x every seq2seq decoder passes a prepared 4-D mask through
as-is (masking_utils.create_causal_mask), but only a model whose forward takes `decoder_position_ids` (Whisper) lets
the caller place its tokens; the others compute positions from the cache length inside the decoder (`tree_refusal`
says which way, per family), so a tree there is refused in one line before decoding starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import inspect

import torch
from torch import Tensor
from transformers import (AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, DynamicCache,
                          EncoderDecoderCache, PretrainedConfig, PreTrainedModel)
from transformers.models.auto.modeling_auto import (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
                                                    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
                                                    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)

from drafter_train.devices import default_device
from drafter_train.errors import ConfigError
from drafter_train.targets import has_sliding_window

# Config fields holding the encoder's and the decoder's layer counts, per family (T5 names them its own way).
LAYER_FIELDS = {"t5": ("num_layers", "num_decoder_layers"), "mt5": ("num_layers", "num_decoder_layers")}
DEFAULT_LAYER_FIELDS = ("encoder_layers", "decoder_layers")  # BART, Marian, M2M100/NLLB, Whisper, Pegasus ...


def layer_fields(config: PretrainedConfig) -> tuple[str, str]:
    return LAYER_FIELDS.get(config.model_type, DEFAULT_LAYER_FIELDS)


def num_layers(config: PretrainedConfig) -> tuple[int, int]:
    """(encoder layers, decoder layers) of a seq2seq config."""
    enc, dec = layer_fields(config)
    return getattr(config, enc), getattr(config, dec) or getattr(config, enc)


def model_class(config: PretrainedConfig):
    """transformers' Auto class for this encoder-decoder: speech (Whisper) or text (T5, BART, Marian, NLLB)."""
    if not getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"target.path: a {config.model_type} model is not an encoder-decoder; seq2seq targets are "
                          "T5, BART, Marian/NLLB, Whisper and other transformers seq2seq models")
    if config.model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return AutoModelForSpeechSeq2Seq
    return AutoModelForSeq2SeqLM


def load_seq2seq(path: str, dtype: str = "float32", device: Optional[torch.device] = None) -> PreTrainedModel:
    """A local seq2seq model folder -> the model in eval mode, gradients off, on `device` (default: accelerate's). One-line errors for a missing folder or
    a decoder-only model, before the weights load."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"target.path: {path} is not a model folder (no config.json)")
    config = AutoConfig.from_pretrained(path)
    model = model_class(config).from_pretrained(path, dtype=getattr(torch, dtype)).to(device or default_device()).eval()
    return model.requires_grad_(False)


def tree_refusal(model_or_config) -> Optional[str]:
    """Why this model's decoder cannot verify a draft tree through its public forward; None where it can (its forward
    takes `decoder_position_ids`; the 4-D mask goes in as `decoder_attention_mask`). A loaded model is read by its
    class, a config (preflight, no weights) by the class transformers' Auto mappings give it."""
    if isinstance(model_or_config, PretrainedConfig):
        config = model_or_config
        mapping = MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING if type(config) in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING \
            else MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING
        cls = mapping[type(config)] if type(config) in mapping else None
    else:
        config, cls = model_or_config.config, type(model_or_config)
    decoder = getattr(config, "decoder", None)  # T5Gemma: Gemma 2's decoder, sliding layers included
    if isinstance(decoder, PretrainedConfig) and has_sliding_window(decoder):
        return ("decoder has sliding-window attention layers, whose window a tree's own 4-D mask would override "
                "(and whose cache cannot be cropped back)")
    if cls is not None and "decoder_position_ids" in inspect.signature(cls.forward).parameters:
        return None
    if hasattr(config, "relative_attention_num_buckets"):  # T5, mT5, UMT5, LongT5
        return ("decoder's relative position bias is computed from the cache length (T5Attention.compute_bias: "
                "arange(query_length) + past_seen_tokens) and its forward takes no decoder positions")
    return ("decoder derives its positions from the cache length (position_ids = arange(seq_length) + "
            "cache_length) and its forward takes no decoder_position_ids")


def check_trees(model_or_config, field: str = "eval.tree") -> None:
    """Refuse draft trees in one line where the decoder cannot place a tree's tokens (`tree_refusal`)."""
    reason = tree_refusal(model_or_config)
    if reason is not None:
        config = getattr(model_or_config, "config", model_or_config)
        raise ConfigError(f"{field}: draft trees need per-token decoder positions, and a {config.model_type} "
                          f"{reason}; use chains")


@dataclass
class Source:
    """One request's encoder input, batch size 1: {input_ids, attention_mask} for text, {input_features} for speech;
    and the decoder tokens the request forces after the decoder start token (Whisper's language / task / no-timestamps
    tokens, NLLB's target-language token), which are not counted as generated."""

    inputs: dict[str, Tensor]
    decoder_prefix: tuple[int, ...] = ()

    @classmethod
    def text(cls, token_ids: Sequence[int], device: Optional[torch.device] = None, decoder_prefix: Sequence[int] = ()) -> "Source":
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device).view(1, -1)
        return cls({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tuple(decoder_prefix))

    @property
    def attention_mask(self) -> Optional[Tensor]:
        return self.inputs.get("attention_mask")


def encode(model: PreTrainedModel, source: Source):
    """The encoder's pass over the source (once per request): its BaseModelOutput."""
    return model.get_encoder()(**source.inputs)


def decoder_prompt(model: PreTrainedModel, source: Optional[Source] = None) -> list[int]:
    """What the decoder starts from: the decoder start token (what `generate` puts first), then the source's forced
    decoder prefix."""
    start = getattr(model.generation_config, "decoder_start_token_id", None)
    start = model.config.decoder_start_token_id if start is None else start
    if start is None:
        raise ConfigError(f"target.path: this {model.config.model_type} model has no decoder_start_token_id")
    return [int(start)] + list(source.decoder_prefix if source is not None else ())


def eos_ids(model: PreTrainedModel) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = model.config.eos_token_id if eos is None else eos
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class BoundSeq2Seq:
    """A seq2seq model bound to one request's encoder output, called like a causal LM (see the module doc)."""

    def __init__(self, model: PreTrainedModel, encoder_outputs, attention_mask: Optional[Tensor] = None):
        self.model, self.encoder_outputs, self.attention_mask = model, encoder_outputs, attention_mask
        self.device, self.dtype, self.config = model.device, model.dtype, model.config
        self.self_cache, self.cache = None, None
        self.takes_trees = False

    def __call__(self, input_ids: Tensor, past_key_values: DynamicCache, use_cache: bool = True,
                 logits_to_keep: int = 0, attention_mask: Optional[Tensor] = None,
                 position_ids: Optional[Tensor] = None):
        tree = {}
        if attention_mask is not None or position_ids is not None:  # a draft tree (CachedLM.forward_tree)
            if not self.takes_trees:  # checked once per binding: inside the timed passes
                check_trees(self.model)
                self.takes_trees = True
            tree = dict(decoder_attention_mask=attention_mask, decoder_position_ids=position_ids)
        if past_key_values is not self.self_cache:  # a new sequence (CachedLM.reset): a fresh cross-attention cache
            self.self_cache = past_key_values
            self.cache = EncoderDecoderCache(past_key_values, DynamicCache())
        out = self.model(encoder_outputs=self.encoder_outputs, attention_mask=self.attention_mask,
                         decoder_input_ids=input_ids, cache=self.cache, use_cache=True, **tree)
        return SimpleNamespace(logits=out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits)


def bind(model: PreTrainedModel, source: Source, encoder_outputs=None) -> BoundSeq2Seq:
    """`model` bound to `source`, encoding it unless its encoder output is given."""
    encoder_outputs = encode(model, source) if encoder_outputs is None else encoder_outputs
    return BoundSeq2Seq(model, encoder_outputs, source.attention_mask)
