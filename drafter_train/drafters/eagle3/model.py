"""EAGLE-3 (Li et al., arXiv 2503.01840): a one-layer drafter that reads the target's own hidden states.

    features F_t  = target layers' outputs at position t (features.py), fused: g_t = fc(norm(F_t))   [n*H_t -> H]
                    (norm: one RMSNorm per layer with fc_norm, one over all n*H_t with norm_before_fc, or none)
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

from typing import Optional

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, PreTrainedModel

from drafter_train import draft_vocab
from drafter_train.config import DrafterConfig, TrainJobConfig
from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig
from drafter_train.data.batches import Batch
from drafter_train.decoding.draft_exit import draft_confidence
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.tree import TreePool, attention_mask
from drafter_train.drafters.common.distill import apply_loss, top_k_teacher
from drafter_train.drafters.common import conditioned
from drafter_train.drafters.eagle3 import export as eagle3_export, outside, outside_load
from drafter_train.drafters.registry import BuildContext, DrafterKind, register
from drafter_train.errors import ConfigError
from drafter_train.features import check_layers, default_layers, num_layers
from drafter_train.drafters.eagle3.modeling import MODEL_TYPE, Eagle3Config, Eagle3Model
from drafter_train.losses import LossOutput, SharedTeacher


# ----------------------------------------------------------------------------------------------------------------
# Decoding


class Eagle3Drafter:
    """The decoder-side EAGLE-3 drafter: chain or tree drafting on the target's verify-pass features."""

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

    def commit(self, num_valid: int, features: Optional[Tensor], path=None) -> None:
        drop = self.cache.get_seq_length() - self.length
        if drop > 0:
            self.cache.crop(-drop)  # the last proposal's draft steps (negative: drop that many)
        self.pending.append(features)
        held = self.length + sum(f.shape[0] for f in self.pending)
        if held != num_valid:
            raise RuntimeError(f"EAGLE-3 drafter out of step: features for {held} positions, {num_valid} verified")

    def _step0(self, seq: Tensor) -> Tensor:
        """Step 0 on the positions verified since the last proposal (their target features): their entries join the
        cache; returns the last row's output hidden [1, 1, H], the input of the first draft step."""
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
        return hidden

    @torch.inference_mode()
    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams,
                generator: Optional[torch.Generator]) -> Proposal:
        model, hidden = self.model, self._step0(seq)
        tokens, probs = [], []
        for i in range(draft_len):
            logits = model.draft_logits(hidden)[0, -1]
            draft, q = choose_token(logits, params, generator)
            if self.exit_below and draft_confidence(logits, q, params) < self.exit_below:
                break  # adaptive draft exit (decoding/draft_exit.py)
            tokens.append(self.draft_ids[draft])
            probs.append(q)
            if i + 1 < draft_len:
                position = torch.tensor([[self.length - 1 + i + 1]], device=seq.device)
                hidden = model.step(tokens[-1].view(1, 1), hidden, position, None, self.cache)
        if not tokens:  # the first draft was already unsure: a plain target step (as the loop's k == 0 step)
            return Proposal(seq.new_empty(0))
        return Proposal(torch.stack(tokens), None if params.greedy else self._full_vocab(torch.stack(probs)))

    # ---- trees: draft steps over one depth of nodes at once, each attending to the committed step-0 entries, its
    # ancestors' draft-step entries and itself; they are dropped at the next commit like a chain's ----

    @torch.inference_mode()
    def tree_root(self, seq: Tensor) -> Tensor:
        hidden = self._step0(seq)
        self.hidden, self.slots = {-1: hidden[0, -1]}, []  # node -> its step's output hidden; expanded nodes
        return self.model.draft_logits(hidden)[0, -1]

    @torch.inference_mode()
    def tree_expand(self, pool: TreePool, nodes: list[int]) -> Tensor:
        device = self.cache.layers[0].keys.device
        tokens = torch.tensor([[pool.tokens[n] for n in nodes]], device=device)
        hidden = torch.stack([self.hidden[pool.parents[n]] for n in nodes])[None]  # [1, n, H] the parents' outputs
        positions = torch.tensor([[self.length - 1 + pool.depths[n] for n in nodes]], device=device)
        mask = attention_mask(pool.visible(nodes, self.slots + nodes), self.length, hidden.dtype)
        out = self.model.step(tokens, hidden, positions, mask, self.cache)  # [1, n, H]
        self.hidden.update(zip(nodes, out[0]))
        self.slots += nodes
        return self.model.draft_logits(out)[0]

    def _full_vocab(self, probs: Tensor) -> Tensor:
        return conditioned.to_target_vocab(probs, self.draft_ids, self.draft_vocab.numel())


# ----------------------------------------------------------------------------------------------------------------
# Training


def eagle3_loss(module: nn.Module, target: PreTrainedModel, batch: Batch, cfg: TrainJobConfig) -> LossOutput:
    """Sum over TTT steps j of ttt_decay**j x the configured loss of step j, against the target's distribution
    restricted to the draft vocabulary (ce: against the data's tokens, those outside the draft vocabulary masked).
    Counted per response token (the batch's num_tokens)."""
    model = module.module if hasattr(module, "module") else module  # DDP wraps; buffers are read, not trained
    with conditioned.target_precision(batch.input_ids.device, cfg):
        features, target_hidden = conditioned.target_signals(target, batch, model.config.target_layers)
        teacher = conditioned.draft_teacher(model, target, target_hidden)
    student = module(batch.input_ids, features, batch.attention_mask, batch.resp_pos, cfg.drafter.ttt_steps,
                     cfg.drafter.feature_noise)
    labels = conditioned.draft_labels(model, batch.labels)
    total = torch.zeros((), device=batch.input_ids.device)
    # every step learns the same positions: its softmax once (restricted to loss.top_k here, once, too)
    teacher = SharedTeacher(top_k_teacher(teacher, cfg.loss), batch.resp_mask)
    for j, logits in enumerate(student):
        mask = batch.resp_mask & (batch.resp_pos - 1 - j >= 0)
        if cfg.loss.name == "ce":
            mask = mask & (labels >= 0)
        out = apply_loss(cfg.loss, logits.float(), labels.clamp(min=0), mask, lambda: teacher, cfg.drafter.draft_len)
        total = total + cfg.drafter.ttt_decay ** j * out.loss_sum
    return LossOutput(total, batch.resp_mask.sum())


def feature_layers(cfg: DrafterConfig, target: PreTrainedModel) -> list[int]:
    """drafter.target_layers, else EAGLE-3's low/mid/high default, checked against the target."""
    return check_layers(cfg.target_layers or default_layers(num_layers(target)), num_layers(target))


# ----------------------------------------------------------------------------------------------------------------
# The kind


def build(cfg: DrafterConfig, ctx: BuildContext) -> Eagle3Model:
    conditioned.check_new_or_saved(cfg, "EAGLE-3")
    if cfg.path != "new" and outside.layout(outside.read_config(cfg.path) or {}):
        return _outside(cfg.path, ctx)
    if cfg.path != "new":
        return conditioned.check_target(load(cfg.path, ctx.dtype).to(ctx.target.device), ctx.target, "EAGLE-3")
    layer_ids = feature_layers(cfg, ctx.target)
    draft_ids = conditioned.choose_draft_ids(cfg, ctx, "EAGLE-3")
    return Eagle3Model.from_target(ctx.target, layer_ids, draft_ids, cfg.fc_norm, cfg.draft_len, cfg.norm_before_fc,
                                   cfg.norm_output, cfg.init_from_target, cfg.num_layers, cfg.intermediate_size)


def _outside(path: str, ctx: BuildContext) -> Eagle3Model:
    """A speculators- or ModelOpt-format folder (outside.py), with the target's embeddings when it holds none."""
    model, has_embeddings = outside_load.load(path, ctx.dtype)
    if not has_embeddings:
        shared = ctx.target.get_input_embeddings().weight
        if shared.shape != model.embed_tokens.weight.shape:
            raise ConfigError(f"drafter.path: {path} has no token embeddings and the target's are "
                              f"{tuple(shared.shape)}, not {tuple(model.embed_tokens.weight.shape)}: another target's")
        model.embed_tokens.weight.data.copy_(shared.data)
    return conditioned.check_target(model.to(ctx.target.device), ctx.target, "EAGLE-3")


def load(path: str, dtype: str) -> Eagle3Model:
    return conditioned.load_checked(Eagle3Model, path, dtype, "EAGLE-3")


KIND = register(DrafterKind(
    name="eagle3",
    description="an EAGLE-3 drafter",
    model_type=MODEL_TYPE,
    config_class=Eagle3DrafterConfig,
    build=build,
    load=load,
    decoder_drafter=Eagle3Drafter,
    loss=eagle3_loss,
    prepare_data=conditioned.data_preparer(feature_layers),
    prepare_batch=conditioned.attach_cached_features,
    export_formats=eagle3_export.FORMATS,
    export_checks={"gguf": eagle3_export.check_gguf},
    outside_folder=lambda config: outside.layout(config) is not None,
    check_folder=outside.check_folder,
    engine_methods={"vllm": "eagle3", "sglang": "EAGLE3", "gguf": "draft-eagle3"},
    summary="An EAGLE-3 draft head: one decoder layer reading the target's own hidden states, with a reduced draft "
            "vocabulary.",
    card_tags=("eagle3", "target-conditioned"),
))

# Importing this module lets transformers' Auto classes load saved EAGLE-3 drafter folders.
AutoConfig.register(MODEL_TYPE, Eagle3Config, exist_ok=True)
AutoModel.register(Eagle3Config, Eagle3Model, exist_ok=True)
