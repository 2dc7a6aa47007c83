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

import copy
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, DynamicCache, LlamaConfig, PretrainedConfig, PreTrainedModel

from drafter_train import draft_vocab
from drafter_train.config import DrafterConfig, TrainJobConfig
from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig
from drafter_train.data.batches import Batch
from drafter_train.decoding.draft_exit import draft_confidence
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.tree import TreePool, attention_mask
from drafter_train.drafters.common.backbone import plain_layer_config
from drafter_train.drafters.common.distill import apply_loss
from drafter_train.drafters.common import conditioned
from drafter_train.drafters.eagle3 import export as eagle3_export, outside
from drafter_train.drafters.registry import BuildContext, DrafterKind, register
from drafter_train.errors import ConfigError
from drafter_train.features import check_layers, default_layers, num_layers
from drafter_train.losses import LossOutput

MODEL_TYPE = "eagle3_drafter"


class Eagle3Config(PretrainedConfig):
    """`backbone`: the target's config as a dict (the layer's architecture); target_layers: the fused target layers
    (features.py convention) of a target with target_num_layers layers; draft_vocab_size: rows of the LM head."""

    model_type = MODEL_TYPE

    def __init__(self, backbone: Optional[dict] = None, target_layers: Sequence[int] = (), target_num_layers: int = 0,
                 target_hidden_size: int = 0, draft_vocab_size: int = 0, fc_norm: bool = True, draft_len: int = 4,
                 draft_vocab_fingerprint: Optional[str] = None, norm_before_fc: bool = False,
                 target_sliding_window: Optional[int] = None, norm_output: bool = False, **kwargs):
        self.backbone = backbone or {}
        self.target_layers, self.target_num_layers = list(target_layers), target_num_layers
        self.target_hidden_size, self.draft_vocab_size = target_hidden_size, draft_vocab_size
        self.fc_norm, self.draft_len = fc_norm, draft_len
        self.norm_before_fc = norm_before_fc  # one RMSNorm over the concatenated features (llama.cpp's layout)
        # EAGLE 3.1 (speculators' default): each step hands the next its output after the final norm
        self.norm_output = norm_output
        self.draft_vocab_fingerprint = draft_vocab_fingerprint  # draft_vocab.fingerprint of d2t, checked at load
        # the target's model-wide window (export.py: vLLM would apply it to the drafter's layer too)
        self.target_sliding_window = target_sliding_window
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


def layer_backbone(target_config: PretrainedConfig) -> dict:
    """The drafter layer's architecture: a Llama layer (what vLLM and SGLang serve EAGLE-3 with), the target's own
    config for a Llama target, else a Llama config of the target's sizes (drafters/common/backbone.py)."""
    if target_config.model_type == "llama":
        return target_config.to_dict()
    return plain_layer_config(target_config, LlamaConfig)


def model_wide_window(target_config: PretrainedConfig) -> Optional[int]:
    """The target's sliding window when it holds for the whole model (a sliding_window and no layer_types, or only
    sliding ones: Mistral), else None (full attention, or per-layer windows as Gemma 2/3 and gpt-oss have)."""
    config = target_config.get_text_config()
    window, kinds = getattr(config, "sliding_window", None), getattr(config, "layer_types", None) or []
    return window if window and all(kind == "sliding_attention" for kind in kinds) else None


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


class Eagle3Model(conditioned.TargetFeaturesModel):
    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _no_split_modules = []

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        layer_config = config.layer_config()
        base = AutoModel.from_config(layer_config)  # the target architecture's modules, one layer
        hidden, vocab = layer_config.hidden_size, layer_config.vocab_size
        norm_class, eps = type(base.norm), layer_config.rms_norm_eps
        self._add_inputs(config, norm_class, eps, hidden, vocab)
        layer = base.layers[0]
        attn, bias = layer.self_attn, getattr(layer_config, "attention_bias", False)
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding; hidden]: 2H wide
            setattr(attn, name, nn.Linear(2 * hidden, getattr(attn, name).out_features, bias=bias))
        layer.hidden_norm = norm_class(hidden, eps=eps)
        self.layers = nn.ModuleList([layer])
        self.norm, self.rotary_emb = base.norm, base.rotary_emb
        self._add_head(config, hidden, vocab)
        self.post_init()

    # ---- the pieces shared by training and decoding ----

    def fuse(self, features: Tensor) -> Tensor:
        """[..., n * H_t] target features -> [..., H] (each layer's feature normalised first with fc_norm)."""
        return self.fused_input(features)

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
        out = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(out) if self.config.norm_output else out  # norm_output: the next step reads it normed

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] step outputs -> [..., Vd] logits over the draft vocabulary (norm_output: already normed)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

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
                    draft_len: int, norm_before_fc: bool = False, norm_output: bool = False) -> "Eagle3Model":
        """A new drafter for `target`: frozen copy of its embeddings, LM head rows and final norm of the draft
        vocabulary; fc and the layer freshly initialised."""
        config = new_config(target, layer_ids, draft_ids.numel(), fc_norm, draft_len, norm_before_fc)
        config.norm_output = norm_output
        drafter = cls(config).to(target.dtype)
        drafter.copy_from_target(target, draft_ids)
        return drafter.to(target.device)


def new_config(target: PreTrainedModel, layer_ids: Sequence[int], draft_vocab_size: int, fc_norm: bool,
               draft_len: int, norm_before_fc: bool = False) -> Eagle3Config:
    """The config of a new drafter for `target` (read from its config and module shapes only: a target on the meta
    device will do, drafter_train/memory.py sizes GPU runs that way)."""
    tconfig = target.config
    return Eagle3Config(backbone=layer_backbone(tconfig), target_layers=list(layer_ids),
                        target_num_layers=num_layers(target), target_hidden_size=tconfig.hidden_size,
                        draft_vocab_size=draft_vocab_size, fc_norm=fc_norm, draft_len=draft_len,
                        norm_before_fc=norm_before_fc, vocab_size=target.get_input_embeddings().num_embeddings,
                        eos_token_id=tconfig.eos_token_id, bos_token_id=tconfig.bos_token_id,
                        pad_token_id=getattr(tconfig, "pad_token_id", None), tie_word_embeddings=False,
                        target_sliding_window=model_wide_window(tconfig))


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
    features, target_hidden = conditioned.target_signals(target, batch, model.config.target_layers)
    student = module(batch.input_ids, features, batch.attention_mask, batch.resp_pos, cfg.drafter.ttt_steps)
    teacher = conditioned.draft_teacher(model, target, target_hidden)
    labels = conditioned.draft_labels(model, batch.labels)
    total = torch.zeros((), device=batch.input_ids.device)
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
                                   cfg.norm_output)


def _outside(path: str, ctx: BuildContext) -> Eagle3Model:
    """A speculators- or ModelOpt-format folder (outside.py), with the target's embeddings when it holds none."""
    from drafter_train.drafters.eagle3 import outside_load  # imports this module: loaded on use

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
