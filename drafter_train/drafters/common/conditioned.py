"""What the drafter kinds that read the target's own hidden states share (EAGLE-3, DFlash).

- Building: a new drafter chooses its reduced draft vocabulary from the training data (draft_vocab.py); a saved one
  is loaded with its d2t/t2d mapping checked, and refused for a target of another shape.
- Training: the target's features at the kind's layers and its final hidden states at the response positions, from
  one no-grad forward (online) or from the offline feature cache (data/feature_cache.py); the teacher is the target's
  distribution restricted to the draft vocabulary, the labels are draft ids.
- Decoding: drafts over the draft vocabulary are mapped to target ids, and their distributions spread over the
  target's vocabulary (zero outside the draft vocabulary), so speculative sampling stays exact.

Each kind names its feature layers (`layers_for`); the rest is here, once.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Callable, Sequence

import datasets
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from drafter_train import draft_vocab
from drafter_train.config import DrafterConfig, TrainJobConfig
from drafter_train.cpu_kernels import stock_kernels
from drafter_train.data import feature_cache
from drafter_train.data.batches import Batch
from drafter_train.drafters.registry import BuildContext
from drafter_train.drafters.common.truncated import parse_truncated
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.features import FeatureTap, check_layers, num_layers
from drafter_train.targets import model_identity

# (drafter config, target) -> the target layers a kind fuses (checked against the target)
LayersFor = Callable[[DrafterConfig, PreTrainedModel], list[int]]


# ----------------------------------------------------------------------------------------------------------------
# The model parts


class TargetFeaturesModel(PreTrainedModel):
    """What EAGLE-3 and DFlash models share: the target's token embeddings, the fused input from the target's
    features (fc, after a per-layer RMSNorm with fc_norm, or one RMSNorm over the whole concatenation with
    norm_before_fc) and an LM head over the draft vocabulary with its d2t / t2d mapping. Their configs carry
    target_layers, target_hidden_size, fc_norm, draft_vocab_size and vocab_size (EAGLE-3's also norm_before_fc)."""

    def _add_inputs(self, config, norm_class: type, eps: float, hidden: int, vocab: int) -> None:
        target_hidden = config.target_hidden_size or hidden
        n = len(config.target_layers)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.fc_norm = nn.ModuleList([norm_class(target_hidden, eps=eps) for _ in range(n)]) if config.fc_norm else None
        # llama.cpp's `norm_before_fc`: one RMSNorm over all n * H_t features (its `enc_output_norm` tensor)
        self.input_norm = norm_class(n * target_hidden, eps=eps) if getattr(config, "norm_before_fc", False) else None
        self.fc = nn.Linear(n * target_hidden, hidden, bias=False)

    def _add_head(self, config, hidden: int, vocab: int) -> None:
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size or vocab, bias=False)
        rows = self.lm_head.out_features
        self.register_buffer("d2t", torch.zeros(rows, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool) if rows == vocab else
                             torch.zeros(vocab, dtype=torch.bool))

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def target_vocab_size(self) -> int:
        """The vocabulary its tokens and drafts live in (the LM head covers only the draft vocabulary)."""
        return self.embed_tokens.num_embeddings

    def fused_input(self, features: Tensor, noise: float = 0.0) -> Tensor:
        """[..., n * H_t] target features -> [..., H]: fc over them (each layer's feature normalised first with
        fc_norm; the whole concatenation with norm_before_fc). noise > 0: U(-noise, noise) added to the normalised
        features (EAGLE's feature augmentation; training only, the callers decide)."""
        features = features.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        if self.input_norm is not None:
            features = self.input_norm(features)
        if noise:
            if self.fc_norm is None and self.input_norm is None:
                raise ConfigError("drafter.feature_noise: needs the features normalised (drafter.fc_norm=true or "
                                  "drafter.norm_before_fc=true): one scale means nothing on the raw residual stream")
            features = features + feature_noise(features, noise)
        return self.fc(features)

    def copy_from_target(self, target: PreTrainedModel, draft_ids: Tensor) -> None:
        """The draft vocabulary mapping (and its fingerprint), and copies of the target's embeddings, of its LM head
        rows of the draft vocabulary and of its final norm."""
        d2t, t2d = draft_vocab.mapping(draft_ids, self.target_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.config.draft_vocab_fingerprint = draft_vocab.fingerprint(d2t)
        self.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)
        self.lm_head.weight.data.copy_(target.get_output_embeddings().weight.data[draft_ids])
        self.norm.load_state_dict(target.get_decoder().norm.state_dict())


def feature_noise(features: Tensor, scale: float) -> Tensor:
    """U(-scale, scale) noise shaped like `features`. Drawn from torch's CPU generator whatever the device (train.seed
    sets it and checkpoints keep it, not a GPU's), so a resumed run draws what an uninterrupted one would, on a GPU
    too. Added after the feature norm, never to the raw residual stream: SmolLM2's reaches ~25,000 in a few
    massive channels and ~1 elsewhere, so no one scale fits it raw, while after an RMSNorm (weight 1 at init) every
    channel is ~1 and `scale` means a fraction of a typical feature, as EAGLE's U(-0.2, 0.2) on normed states does."""
    noise = (torch.rand(features.shape, dtype=torch.float32) * 2 - 1) * scale
    return noise.to(device=features.device, dtype=features.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Building and loading


def check_new_or_saved(cfg: DrafterConfig, name: str) -> None:
    """These kinds are built new for their target or loaded from a saved folder, never cut from it. `name`: the kind
    in messages ("EAGLE-3", "DFlash")."""
    if parse_truncated(cfg.path) is not None or cfg.path == "scratch":
        raise ConfigError(f"drafter.path: {name} drafters are built new for their target (drafter.path=new) or "
                          f"loaded from a saved folder, not {cfg.path!r}")


def choose_draft_ids(cfg: DrafterConfig, ctx: BuildContext, name: str) -> Tensor:
    """The draft vocabulary of a new drafter: the drafter.draft_vocab_size most frequent response tokens of the
    training data, EOS ids always included; the whole vocabulary for draft_vocab_size = 0."""
    target = ctx.target
    vocab = target.get_input_embeddings().num_embeddings
    draft_vocab.check_size(cfg.draft_vocab_size, vocab)
    if not 0 < cfg.draft_vocab_size < vocab:
        return torch.arange(vocab)
    if ctx.token_counts is None:
        raise ConfigError(f"drafter.draft_vocab_size: a new {name} drafter chooses its draft "
                          "vocabulary from training data; evaluate a trained one, or use drafter.draft_vocab_size=0")
    eos = target.config.eos_token_id
    return draft_vocab.select_draft_ids(ctx.token_counts(), cfg.draft_vocab_size,
                                        eos if isinstance(eos, list) else [eos] if eos is not None else [])


def load_checked(model_class: type, path: str, dtype: str, name: str) -> PreTrainedModel:
    """A saved drafter folder of `model_class`, in eval mode without gradients, its draft vocabulary mapping checked."""
    if not Path(path).is_dir():
        raise ModelNotFoundError(f"drafter.path: {path}: no such folder (a {name} drafter folder, or new)")
    try:
        # .to(): transformers 5 loads a sub-config that names its own dtype (the backbone layer of a drafter trained
        # on a bf16 target) in that dtype, whatever dtype= says; seen as a bf16 layer in an fp32 evaluation
        model = model_class.from_pretrained(path, dtype=getattr(torch, dtype)).to(getattr(torch, dtype)).eval()
    except RuntimeError as err:  # transformers: tensors whose shapes do not fit the folder's config
        raise ConfigError(f"drafter.path: {path}: its weights do not fit its config.json ({str(err).splitlines()[0]})"
                          ) from None
    draft_vocab.check_mapping(model.d2t, model.t2d, model.lm_head.out_features, model.config.draft_vocab_fingerprint)
    return model.requires_grad_(False)


def check_target(model: PreTrainedModel, target: PreTrainedModel, name: str) -> PreTrainedModel:
    """A saved drafter only works with the target (shape) it was trained on: refuse another in one line."""
    cfg = model.config
    if cfg.target_hidden_size != target.config.hidden_size:
        raise ConfigError(f"drafter.path: this {name} drafter reads features of hidden size "
                          f"{cfg.target_hidden_size}, the target's is {target.config.hidden_size} (it was trained "
                          "for another target)")
    check_layers(cfg.target_layers, num_layers(target), "drafter.path (its target_layers)")
    return model


# ----------------------------------------------------------------------------------------------------------------
# Training signals


def restricted_logits(target: PreTrainedModel, hidden: Tensor, draft_ids: Tensor) -> Tensor:
    """The target's logits over the draft vocabulary only: its LM head rows `draft_ids` on final hidden states."""
    logits = F.linear(hidden, target.get_output_embeddings().weight[draft_ids])
    cap = getattr(target.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
@stock_kernels()  # training data: the same bits whatever `auto` timed (cpu_kernels.py)
def target_signals(target: PreTrainedModel, batch: Batch, layer_ids: Sequence[int], causal_only: bool = True
                   ) -> tuple[Tensor, Tensor]:
    """(features [B, T, n*H], final hidden states [B, R, H] at the response positions) from one no-grad target
    forward: what the offline feature cache stores, and what training computes online.

    A right-padded batch (collate's) runs without its attention mask (causal_only): a row's real tokens never attend
    to the padding after them, so their outputs are the masked pass's (the same bits, measured on SmolLM2), while
    attention takes its causal kernel instead of a masked one and no mask is built: 1.3-1.5x faster on a 2-core EPYC
    (docs/lab-notes/benchmarks.md, "The feature pass against the matmul peak"). Padded positions then hold other
    values; nothing reads them (the cache stores real positions only, the drafter masks padding).
    causal_only=False: always the masked pass (what benchmarks/throughput.py compares against)."""
    if batch.features is not None:
        return batch.features, batch.target_hidden
    mask = None if causal_only and right_padded(batch.attention_mask) else batch.attention_mask
    decoder = _compiled.get(target)
    decoder = target.get_decoder() if decoder is None else decoder
    with FeatureTap(target, layer_ids) as tap:
        last = decoder(input_ids=batch.input_ids, attention_mask=mask).last_hidden_state
        features = tap.features
    index = batch.resp_pos[..., None].expand(-1, -1, last.shape[-1])
    return features, torch.gather(last, 1, index)


# target -> its decoder under torch.compile, for target_signals only (train.compile_target)
_compiled: "weakref.WeakKeyDictionary[PreTrainedModel, nn.Module]" = weakref.WeakKeyDictionary()


def compile_feature_pass(target: PreTrainedModel) -> None:
    """train.compile_target: target_signals runs the target's decoder compiled (torch.compile, dynamic shapes: one
    graph for every batch and length, not one per shape). Its elementwise work (RMSNorm, rotary, SiLU, casts: ~40 %
    of an eager bf16 pass on a 2-core EPYC) is fused; the same weights, so features match eager's to float rounding.
    Only this pass: decoding and every other use of the target stay eager (an in-place compile would change what
    every speedup is measured on)."""
    _compiled[target] = torch.compile(target.get_decoder(), dynamic=True)


def right_padded(attention_mask: Tensor) -> bool:
    """Whether every row is real tokens (at least one) then padding: collate's layout."""
    lengths = attention_mask.sum(1)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return torch.equal(attention_mask.bool(), positions[None] < lengths[:, None]) and bool(lengths.min() > 0)


def target_precision(device: torch.device, cfg: TrainJobConfig):
    """train.mixed_precision=bf16: the target's no-grad work in training on `device` (features, teacher logits) under
    bf16 autocast like the drafter's own (on an AMX CPU ~3x float32's speed); no: in the target's dtype."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.train.mixed_precision == "bf16")


def draft_teacher(model: PreTrainedModel, target: PreTrainedModel, target_hidden: Tensor) -> Tensor:
    """[..., Vd] float32: the target's logits over the drafter's draft vocabulary, from its final hidden states."""
    draft_ids = draft_vocab.draft_to_target(model.d2t)
    return restricted_logits(target, target_hidden.to(target.dtype), draft_ids).float()


def draft_labels(model: PreTrainedModel, labels: Tensor) -> Tensor:
    """Target token ids -> the drafter's draft ids, -1 for tokens outside its draft vocabulary (ce masks them)."""
    return draft_vocab.target_to_draft(model.d2t, model.t2d.numel())[labels]


# ----------------------------------------------------------------------------------------------------------------
# The offline feature cache


def feature_spec(cfg: TrainJobConfig, target: PreTrainedModel, response_key: str,
                 layers: Sequence[int]) -> feature_cache.CacheSpec:
    return feature_cache.CacheSpec(target=model_identity(cfg.target), layers=tuple(layers),
                                   hidden_size=target.config.hidden_size, response_key=response_key,
                                   max_seq_len=cfg.train.max_seq_len, dtype=cfg.drafter.feature_dtype,
                                   compute=cfg.train.mixed_precision)


def feature_root(cfg: TrainJobConfig, spec: feature_cache.CacheSpec) -> Path:
    """drafter.feature_cache, else a folder next to the data named by what the features depend on."""
    if cfg.drafter.feature_cache:
        return Path(cfg.drafter.feature_cache)
    return feature_cache.cache_dir(cfg.train.data_dir, spec)


def data_preparer(layers_for: LayersFor) -> Callable:
    """A kind's `prepare_data`: drafter.features=offline extracts the target's features at the kind's layers over the
    whole dataset once (all ranks share the work, shard by shard), then training reads records that carry them;
    online: the records as they are."""

    def prepare_data(cfg: TrainJobConfig, data, response_key: str, target: PreTrainedModel, tokenizer, accelerator):
        if cfg.drafter.features != "offline":
            return data
        spec = feature_spec(cfg, target, response_key, layers_for(cfg.drafter, target))
        root = feature_root(cfg, spec)
        feature_cache.check_manifest(root, spec)
        digests = feature_cache.record_digests(data, response_key)
        if accelerator.is_main_process:
            dropped = feature_cache.drop_stale(root, spec, digests)
            if dropped:
                print(f"feature cache: {dropped} shard(s) of {root} were made from other records than the data holds "
                      "now (datagen run again?): extracted again", file=sys.stderr)
        accelerator.wait_for_everyone()
        if feature_cache.needs_building(root, len(data)):
            def extract(batch: Batch) -> tuple[Tensor, Tensor]:
                with target_precision(accelerator.device, cfg):
                    return target_signals(target, batch.to(accelerator.device), spec.layers)

            feature_cache.build_cache(root, spec, data, extract, tokenizer.pad_token_id, cfg.train.batch_size,
                                      accelerator.process_index, accelerator.num_processes,
                                      progress=accelerator.is_main_process, digests=digests)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                manifest = feature_cache.finish_cache(root, spec, len(data))
                print(f"feature cache: {manifest['records']} records, {manifest['bytes'] / 2**20:.0f} MiB -> {root}",
                      file=sys.stderr)
            accelerator.wait_for_everyone()
        cached = feature_cache.load_cache(root, spec, len(data))
        return datasets.concatenate_datasets([data, cached], axis=1)

    return prepare_data


def attach_cached_features(batch: Batch, records: list, cfg: TrainJobConfig) -> Batch:
    """drafter.features=offline: the batch with the cached features of its records; online: unchanged."""
    if cfg.drafter.features != "offline":
        return batch
    return feature_cache.attach_features(batch, records, feature_cache._DTYPES[cfg.drafter.feature_dtype])


# ----------------------------------------------------------------------------------------------------------------
# Decoding


def to_target_vocab(probs: Tensor, draft_ids: Tensor, target_vocab: int) -> Tensor:
    """[k, Vd] draft probabilities -> [k, V]: zero outside the draft vocabulary (such tokens are never drafted)."""
    full = probs.new_zeros(probs.shape[0], target_vocab)
    return full.index_copy_(1, draft_ids, probs)
