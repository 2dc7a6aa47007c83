"""EAGLE-3 (Li et al., arXiv 2503.01840): a one-layer drafter that reads the target's own hidden states.

    features F_t  = target layers' outputs at position t (features.py), fused: g_t = fc(norm(F_t))   [n*H_t -> H]
    step 0, row t: h0_t = Layer([embed(x_{t+1}); g_t])     -> LM head(norm(h0_t)) ~ p_target(. | x_<=t+1)
    step j, row t: hj_t = Layer([embed(x_{t+1+j}); h(j-1)_t]) -> predicts the token after x_{t+1+j}

The layer is one decoder layer of the target's architecture (transformers' own modules) whose attention reads
[normed token embedding; normed hidden] (2H wide) and whose residual stream is the hidden input; the LM head covers a
reduced draft vocabulary (draft_vocab.py). Positions: row t of step j sits at position t + j.

Training-time test (TTT): training unrolls `ttt_steps` steps; step j consumes step j-1's outputs (the drafter's own
hidden states, as when decoding) and the data's tokens. Attention: step 0 is causal over rows; a step-j query of row
t also sees the keys of row t in steps 1..j (`ttt_mask`), exactly what a decoding query sees in the drafter's cache.

Decoding: the drafter's KV cache holds step-0 entries of verified positions, computed from the target's verify-pass
features (no extra target forward); a proposal runs step 0 on the newly verified positions, then one single-token
step per further draft, and the draft steps' entries are dropped at the next commit.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Optional, Sequence

import datasets

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, DynamicCache, PretrainedConfig, PreTrainedModel

from drafter_train import draft_vocab
from drafter_train.config import DrafterConfig, Eagle3DrafterConfig, TrainJobConfig
from drafter_train.data import feature_cache
from drafter_train.data.batches import Batch
from drafter_train.decoding.draft_exit import draft_confidence
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.distill import apply_loss
from drafter_train.drafters import eagle3_export
from drafter_train.drafters.registry import BuildContext, DrafterKind
from drafter_train.drafters.truncated import parse_truncated
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.features import FeatureTap, check_layers, default_layers, num_layers
from drafter_train.losses import LossOutput
from drafter_train.targets import model_identity

MODEL_TYPE = "eagle3_drafter"


class Eagle3Config(PretrainedConfig):
    """`backbone`: the target's config as a dict (the layer's architecture); target_layers: the fused target layers
    (features.py convention) of a target with target_num_layers layers; draft_vocab_size: rows of the LM head."""

    model_type = MODEL_TYPE

    def __init__(self, backbone: Optional[dict] = None, target_layers: Sequence[int] = (), target_num_layers: int = 0,
                 target_hidden_size: int = 0, draft_vocab_size: int = 0, fc_norm: bool = True, draft_len: int = 4,
                 draft_vocab_fingerprint: Optional[str] = None, **kwargs):
        self.backbone = backbone or {}
        self.target_layers, self.target_num_layers = list(target_layers), target_num_layers
        self.target_hidden_size, self.draft_vocab_size = target_hidden_size, draft_vocab_size
        self.fc_norm, self.draft_len = fc_norm, draft_len
        self.draft_vocab_fingerprint = draft_vocab_fingerprint  # draft_vocab.fingerprint of d2t, checked at load
        # transformers' default initialisation (linear, embedding, norms and the rotary buffers a load recomputes)
        self.initializer_range = self.backbone.get("initializer_range", 0.02)
        super().__init__(**kwargs)

    def layer_config(self) -> PretrainedConfig:
        """The backbone architecture with one layer: what the drafter's decoder layer is built from."""
        config = AutoConfig.for_model(**copy.deepcopy(self.backbone))
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1]
        config.tie_word_embeddings = False
        return config


def ttt_mask(attention_mask: Tensor, rows: Tensor, step: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [B, 1, W, T + step * W] of step `step`'s queries over the keys of steps 0..step.

    attention_mask [B, T] (1 = real token); rows [B, W]: the position of each query row (step 0: all T positions;
    later steps: the rows a loss still needs, the same W rows in every step >= 1). Row t sees the step-0 keys s <= t
    of real tokens, and its own keys of steps 1..step (its earlier drafts).
    """
    batch, length = attention_mask.shape
    pos = torch.arange(length, device=attention_mask.device)
    causal = (pos[None, None, :] <= rows[:, :, None]) & attention_mask[:, None, :].bool()  # [B, W, T]
    width = rows.shape[1]
    diagonal = torch.eye(width, dtype=torch.bool, device=rows.device).expand(batch, -1, -1)
    allowed = torch.cat([causal] + [diagonal] * step, dim=2)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def later_rows(gather_pos: Tensor, length: int, steps: int) -> Tensor:
    """[B, W] the rows steps >= 1 must compute: from the first row whose later step still predicts a learned
    position (gather_pos[:, 0] - steps) to the end. Prompt rows before it matter only as step-0 keys, so later steps
    skip them. Rows past the end repeat the last one (their outputs are never read)."""
    start = (gather_pos[:, :1] - steps).clamp(min=0)  # [B, 1]
    width = length - int(start.min())
    return (start + torch.arange(width, device=gather_pos.device)).clamp(max=length - 1)


class Eagle3Model(PreTrainedModel):
    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _no_split_modules = []

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        layer_config = config.layer_config()
        base = AutoModel.from_config(layer_config)  # the target architecture's modules, one layer
        hidden, vocab = layer_config.hidden_size, layer_config.vocab_size
        target_hidden = config.target_hidden_size or hidden
        norm_class, eps = type(base.norm), layer_config.rms_norm_eps
        self.embed_tokens = nn.Embedding(vocab, hidden)
        n = len(config.target_layers)
        self.fc_norm = nn.ModuleList([norm_class(target_hidden, eps=eps) for _ in range(n)]) if config.fc_norm else None
        self.fc = nn.Linear(n * target_hidden, hidden, bias=False)
        layer = base.layers[0]
        attn, bias = layer.self_attn, getattr(layer_config, "attention_bias", False)
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding; hidden]: 2H wide
            setattr(attn, name, nn.Linear(2 * hidden, getattr(attn, name).out_features, bias=bias))
        layer.hidden_norm = norm_class(hidden, eps=eps)
        self.layers = nn.ModuleList([layer])
        self.norm, self.rotary_emb = base.norm, base.rotary_emb
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size or vocab, bias=False)
        rows = self.lm_head.out_features
        self.register_buffer("d2t", torch.zeros(rows, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool) if rows == vocab else
                             torch.zeros(vocab, dtype=torch.bool))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def target_vocab_size(self) -> int:
        """The vocabulary its tokens and drafts live in (the LM head covers only the draft vocabulary)."""
        return self.embed_tokens.num_embeddings

    # ---- the pieces shared by training and decoding ----

    def fuse(self, features: Tensor) -> Tensor:
        """[..., n * H_t] target features -> [..., H] (each layer's feature normalised first with fc_norm)."""
        features = features.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def step(self, token_ids: Tensor, hidden: Tensor, position_ids: Tensor, mask: Optional[Tensor], cache) -> Tensor:
        """One drafter step: tokens [B, n], hidden inputs [B, n, H] -> hidden outputs [B, n, H] (before the norm).

        EAGLE-3's first layer on transformers' modules: the attention reads the normed token embedding and the normed
        hidden input side by side; the residual stream starts from the hidden input.
        """
        layer = self.layers[0]
        embeds = self.embed_tokens(token_ids).to(hidden.dtype)
        attn_in = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        attn_out, _ = layer.self_attn(hidden_states=attn_in, position_embeddings=self.rotary_emb(hidden, position_ids),
                                      attention_mask=mask, past_key_values=cache)
        hidden = hidden + attn_out
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] step outputs -> [..., Vd] logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config.layer_config())

    # ---- training ----

    def forward(self, input_ids: Tensor, features: Tensor, attention_mask: Tensor, gather_pos: Tensor,
                steps: int) -> list[Tensor]:
        """Training-time test: `steps` unrolled steps over whole sequences, in one module call (so DDP / DeepSpeed
        hooks run). input_ids/attention_mask [B, T], features [B, T, n*H_t], gather_pos [B, R] target positions p
        whose distribution is learned. Returns, per step j, the draft logits [B, R, Vd] of row p - 1 - j (the row
        whose step j predicts the token after position p; rows < 0 are clamped, the loss masks them)."""
        batch, length = input_ids.shape
        hidden, outputs = self.fuse(features), []
        rows = torch.arange(length, device=input_ids.device).expand(batch, -1)  # step 0: every position
        cache = self.new_cache()
        for j in range(steps):
            if j == 1:  # later steps: only the rows a loss still reads (see later_rows)
                rows = later_rows(gather_pos, length, steps)
                hidden = torch.gather(hidden, 1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
            # row t reads token x_{t+1+j} (the data's own: drafts are only kept while they equal it)
            tokens = torch.gather(F.pad(input_ids, (0, steps), value=0), 1, rows + 1 + j)
            hidden = self.step(tokens, hidden, rows + j, ttt_mask(attention_mask, rows, j, hidden.dtype), cache)
            # step j learns target position p at row p - 1 - j: its index among this step's rows
            index = (gather_pos - 1 - j - rows[:, :1]).clamp(min=0, max=rows.shape[1] - 1)
            picked = torch.gather(hidden, 1, index[..., None].expand(-1, -1, hidden.shape[-1]))
            outputs.append(self.draft_logits(picked))
        return outputs

    # ---- construction ----

    @classmethod
    def from_target(cls, target: PreTrainedModel, layer_ids: Sequence[int], draft_ids: Tensor, fc_norm: bool,
                    draft_len: int) -> "Eagle3Model":
        """A new drafter for `target`: frozen copy of its embeddings, LM head rows and final norm of the draft
        vocabulary; fc and the layer freshly initialised."""
        tconfig = target.config
        vocab = target.get_input_embeddings().num_embeddings
        config = Eagle3Config(backbone=tconfig.to_dict(), target_layers=list(layer_ids),
                              target_num_layers=num_layers(target), target_hidden_size=tconfig.hidden_size,
                              draft_vocab_size=draft_ids.numel(), fc_norm=fc_norm, draft_len=draft_len,
                              vocab_size=vocab, eos_token_id=tconfig.eos_token_id, bos_token_id=tconfig.bos_token_id,
                              pad_token_id=getattr(tconfig, "pad_token_id", None), tie_word_embeddings=False)
        drafter = cls(config).to(target.dtype)
        d2t, t2d = draft_vocab.mapping(draft_ids, vocab)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        drafter.config.draft_vocab_fingerprint = draft_vocab.fingerprint(d2t)
        drafter.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)
        drafter.lm_head.weight.data.copy_(target.get_output_embeddings().weight.data[draft_ids])
        drafter.norm.load_state_dict(target.get_decoder().norm.state_dict())
        return drafter.to(target.device)


# ----------------------------------------------------------------------------------------------------------------
# Decoding


class Eagle3Drafter:
    """The decoder-side EAGLE-3 drafter: chain drafting on the target's verify-pass features."""

    def __init__(self, model: Eagle3Model):
        self.model = model
        self.feature_layers = list(model.config.target_layers)
        self.draft_ids = draft_vocab.draft_to_target(model.d2t)  # draft id -> target id
        self.draft_vocab = model.t2d  # [V] bool: the evaluator reports how much of the output lies outside
        self.exit_below = 0.0  # adaptive draft exit's threshold γ for the next proposal (0 = off)
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.length = 0  # verified positions whose step-0 entries are in the cache
        self.pending: list[Tensor] = []  # target features [n, F] of verified positions not yet in the cache

    def commit(self, num_valid: int, features: Optional[Tensor]) -> None:
        drop = self.cache.get_seq_length() - self.length
        if drop > 0:
            self.cache.crop(-drop)  # the last proposal's draft steps (negative: drop that many)
        self.pending.append(features)
        held = self.length + sum(f.shape[0] for f in self.pending)
        if held != num_valid:
            raise RuntimeError(f"EAGLE-3 drafter out of step: features for {held} positions, {num_valid} verified")

    @torch.inference_mode()
    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams,
                generator: Optional[torch.Generator]) -> Proposal:
        model, start = self.model, self.length
        features = torch.cat(self.pending)  # positions start .. start + n - 1, each reads the token after it
        n = features.shape[0]
        positions = torch.arange(start, start + n, device=seq.device)[None]
        rows, cols = positions[0, :, None], torch.arange(start + n, device=seq.device)[None]
        mask = torch.zeros(n, start + n, dtype=model.fc.weight.dtype, device=seq.device)
        mask = mask.masked_fill(cols > rows, torch.finfo(mask.dtype).min)[None, None]  # causal over the new rows
        hidden = model.step(seq[start + 1: start + n + 1][None], model.fuse(features)[None], positions, mask,
                            self.cache)[:, -1:]
        self.length, self.pending = start + n, []
        tokens, probs = [], []
        for i in range(draft_len):
            logits = model.draft_logits(hidden)[0, -1]
            draft, q = choose_token(logits, params, generator)
            if self.exit_below and draft_confidence(logits, q, params) < self.exit_below:
                break  # adaptive draft exit (decoding/draft_exit.py)
            tokens.append(self.draft_ids[draft])
            probs.append(q)
            if i + 1 < draft_len:
                position = torch.tensor([[start + n - 1 + i + 1]], device=seq.device)
                hidden = model.step(tokens[-1].view(1, 1), hidden, position, None, self.cache)
        if not tokens:
            return Proposal(seq.new_empty(0), None if params.greedy else self._full_vocab(logits.new_empty(0, logits.numel())))
        return Proposal(torch.stack(tokens), None if params.greedy else self._full_vocab(torch.stack(probs)))

    def _full_vocab(self, probs: Tensor) -> Tensor:
        """[k, Vd] draft probabilities -> [k, V]: zero outside the draft vocabulary (such tokens are never drafted)."""
        full = probs.new_zeros(probs.shape[0], self.draft_vocab.numel())
        return full.index_copy_(1, self.draft_ids, probs)


# ----------------------------------------------------------------------------------------------------------------
# Training


def restricted_logits(target: PreTrainedModel, hidden: Tensor, draft_ids: Tensor) -> Tensor:
    """The target's logits over the draft vocabulary only: its LM head rows `draft_ids` on final hidden states."""
    logits = F.linear(hidden, target.get_output_embeddings().weight[draft_ids])
    cap = getattr(target.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def target_signals(target: PreTrainedModel, batch: Batch, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(features [B, T, n*H], final hidden states [B, R, H] at the response positions) from one no-grad target
    forward: what the offline feature cache stores, and what training computes online."""
    if batch.features is not None:
        return batch.features, batch.target_hidden
    with FeatureTap(target, layer_ids) as tap:
        last = target.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        features = tap.features
    index = batch.resp_pos[..., None].expand(-1, -1, last.shape[-1])
    return features, torch.gather(last, 1, index)


def eagle3_loss(module: nn.Module, target: PreTrainedModel, batch: Batch, cfg: TrainJobConfig) -> LossOutput:
    """Sum over TTT steps j of ttt_decay**j x the configured loss of step j, against the target's distribution
    restricted to the draft vocabulary (ce: against the data's tokens, those outside the draft vocabulary masked).
    Counted per response token (the batch's num_tokens)."""
    model = module.module if hasattr(module, "module") else module  # DDP wraps; buffers are read, not trained
    d2t = model.d2t
    draft_ids = draft_vocab.draft_to_target(d2t)
    features, target_hidden = target_signals(target, batch, model.config.target_layers)
    student = module(batch.input_ids, features, batch.attention_mask, batch.resp_pos, cfg.drafter.ttt_steps)
    teacher = restricted_logits(target, target_hidden.to(target.dtype), draft_ids).float()
    labels = draft_vocab.target_to_draft(d2t, model.t2d.numel())[batch.labels]
    total = torch.zeros((), device=batch.input_ids.device)
    for j, logits in enumerate(student):
        mask = batch.resp_mask & (batch.resp_pos - 1 - j >= 0)
        if cfg.loss.name == "ce":
            mask = mask & (labels >= 0)
        out = apply_loss(cfg.loss, logits.float(), labels.clamp(min=0), mask, lambda: teacher, cfg.drafter.draft_len)
        total = total + cfg.drafter.ttt_decay ** j * out.loss_sum
    return LossOutput(total, batch.resp_mask.sum())


def feature_spec(cfg: TrainJobConfig, target: PreTrainedModel, response_key: str) -> feature_cache.CacheSpec:
    layers = check_layers(cfg.drafter.target_layers or default_layers(num_layers(target)), num_layers(target))
    return feature_cache.CacheSpec(target=model_identity(cfg.target), layers=tuple(layers),
                                   hidden_size=target.config.hidden_size, response_key=response_key,
                                   max_seq_len=cfg.train.max_seq_len, dtype=cfg.drafter.feature_dtype)


def feature_root(cfg: TrainJobConfig, spec: feature_cache.CacheSpec) -> Path:
    """drafter.feature_cache, else a folder next to the data named by what the features depend on."""
    if cfg.drafter.feature_cache:
        return Path(cfg.drafter.feature_cache)
    return feature_cache.cache_dir(cfg.train.data_dir, spec)


def prepare_data(cfg: TrainJobConfig, data, response_key: str, target: PreTrainedModel, tokenizer, accelerator):
    """drafter.features=offline: extract the target's features over the whole dataset once (all ranks share the
    work, shard by shard), then train on records that carry them; online: the records as they are."""
    if cfg.drafter.features != "offline":
        return data
    spec = feature_spec(cfg, target, response_key)
    root = feature_root(cfg, spec)
    feature_cache.check_manifest(root, spec)
    if not (root / feature_cache.MANIFEST).is_file():
        def extract(batch: Batch) -> tuple[Tensor, Tensor]:
            return target_signals(target, batch.to(accelerator.device), spec.layers)

        feature_cache.build_cache(root, spec, data, extract, tokenizer.pad_token_id, cfg.train.batch_size,
                                  accelerator.process_index, accelerator.num_processes,
                                  progress=accelerator.is_main_process)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            manifest = feature_cache.finish_cache(root, spec, len(data))
            print(f"feature cache: {manifest['records']} records, {manifest['bytes'] / 2**20:.0f} MiB -> {root}",
                  file=sys.stderr)
        accelerator.wait_for_everyone()
    cached = feature_cache.load_cache(root, spec, len(data))
    return datasets.concatenate_datasets([data, cached], axis=1)


def prepare_batch(batch: Batch, records: list, cfg: TrainJobConfig) -> Batch:
    if cfg.drafter.features != "offline":
        return batch
    spec_dtype = feature_cache._DTYPES[cfg.drafter.feature_dtype]
    return feature_cache.attach_features(batch, records, spec_dtype)


# ----------------------------------------------------------------------------------------------------------------
# The kind


def build(cfg: DrafterConfig, ctx: BuildContext) -> Eagle3Model:
    target = ctx.target
    if parse_truncated(cfg.path) is not None or cfg.path == "scratch":
        raise ConfigError(f"drafter.path: an EAGLE-3 drafter is built new for its target (drafter.path=new) or "
                          f"loaded from a saved folder, not {cfg.path!r}")
    if cfg.path != "new":
        return check_target(load(cfg.path, ctx.dtype).to(target.device), target)
    vocab = target.get_input_embeddings().num_embeddings
    layer_ids = check_layers(cfg.target_layers or default_layers(num_layers(target)), num_layers(target))
    draft_vocab.check_size(cfg.draft_vocab_size, vocab)
    if 0 < cfg.draft_vocab_size < vocab:
        if ctx.token_counts is None:
            raise ConfigError("drafter.draft_vocab_size: a new EAGLE-3 drafter chooses its draft vocabulary from "
                              "training data; evaluate a trained one, or use drafter.draft_vocab_size=0")
        eos = target.config.eos_token_id
        draft_ids = draft_vocab.select_draft_ids(ctx.token_counts(), cfg.draft_vocab_size,
                                                 eos if isinstance(eos, list) else [eos] if eos is not None else [])
    else:
        draft_ids = torch.arange(vocab)
    return Eagle3Model.from_target(target, layer_ids, draft_ids, cfg.fc_norm, cfg.draft_len)


def load(path: str, dtype: str) -> Eagle3Model:
    if not Path(path).is_dir():
        raise ModelNotFoundError(f"drafter.path: {path}: no such folder (an EAGLE-3 drafter folder, or new)")
    try:
        model = Eagle3Model.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    except RuntimeError as err:  # transformers: tensors whose shapes do not fit the folder's config
        raise ConfigError(f"drafter.path: {path}: its weights do not fit its config.json ({str(err).splitlines()[0]})"
                          ) from None
    draft_vocab.check_mapping(model.d2t, model.t2d, model.lm_head.out_features, model.config.draft_vocab_fingerprint)
    return model.requires_grad_(False)


def check_target(model: Eagle3Model, target: PreTrainedModel) -> Eagle3Model:
    """A saved drafter only works with the target (shape) it was trained on: refuse another in one line."""
    cfg = model.config
    if cfg.target_hidden_size != target.config.hidden_size:
        raise ConfigError(f"drafter.path: this EAGLE-3 drafter reads features of hidden size {cfg.target_hidden_size},"
                          f" the target's is {target.config.hidden_size} (it was trained for another target)")
    check_layers(cfg.target_layers, num_layers(target), "drafter.path (its target_layers)")
    return model


KIND = DrafterKind(
    name="eagle3",
    description="an EAGLE-3 drafter",
    model_type=MODEL_TYPE,
    config_class=Eagle3DrafterConfig,
    build=build,
    load=load,
    decoder_drafter=Eagle3Drafter,
    loss=eagle3_loss,
    prepare_data=prepare_data,
    prepare_batch=prepare_batch,
    export_formats=eagle3_export.FORMATS,
    engine_methods={"vllm": "eagle3", "sglang": "EAGLE3"},
    summary="An EAGLE-3 draft head: one decoder layer reading the target's own hidden states, with a reduced draft "
            "vocabulary.",
    card_tags=("eagle3", "target-conditioned"),
)

# Importing this module lets transformers' Auto classes load saved EAGLE-3 drafter folders.
AutoConfig.register(MODEL_TYPE, Eagle3Config, exist_ok=True)
AutoModel.register(Eagle3Config, Eagle3Model, exist_ok=True)
