"""EAGLE-3's trainable model: its transformers config (Eagle3Config), the module (Eagle3Model: fc, the one layer,
the draft LM head, training-time test) and a new one's config for a target. The math: model.py's docstring; the
kind (decoding, loss, registration) lives there too."""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, DynamicCache, LlamaConfig, PretrainedConfig, PreTrainedModel

from drafter_train.drafters.common.backbone import plain_layer_config
from drafter_train.drafters.common import conditioned
from drafter_train.errors import ConfigError
from drafter_train.features import num_layers


MODEL_TYPE = "eagle3_drafter"


class Eagle3Config(PretrainedConfig):
    """`backbone`: the target's config as a dict (the layer's architecture); target_layers: the fused target layers
    (features.py convention) of a target with target_num_layers layers; draft_vocab_size: rows of the LM head;
    num_layers: decoder layers (the first reads [embedding; hidden], the rest are plain layers on its output);
    intermediate_size: their MLP width (0: the backbone's, i.e. the target's)."""

    model_type = MODEL_TYPE

    def __init__(self, backbone: Optional[dict] = None, target_layers: Sequence[int] = (), target_num_layers: int = 0,
                 target_hidden_size: int = 0, draft_vocab_size: int = 0, fc_norm: bool = True, draft_len: int = 4,
                 draft_vocab_fingerprint: Optional[str] = None, norm_before_fc: bool = False,
                 target_sliding_window: Optional[int] = None, norm_output: bool = False, num_layers: int = 1,
                 intermediate_size: int = 0, **kwargs):
        self.backbone = backbone or {}
        self.target_layers, self.target_num_layers = list(target_layers), target_num_layers
        self.target_hidden_size, self.draft_vocab_size = target_hidden_size, draft_vocab_size
        self.fc_norm, self.draft_len = fc_norm, draft_len
        self.norm_before_fc = norm_before_fc  # one RMSNorm over the concatenated features (llama.cpp's layout)
        # EAGLE 3.1 (speculators' default): each step hands the next its output after the final norm
        self.norm_output = norm_output
        self.draft_vocab_fingerprint = draft_vocab_fingerprint  # draft_vocab.fingerprint of d2t, checked at load
        self.num_layers, self.intermediate_size = num_layers, intermediate_size  # capacity (drafter.num_layers ...)
        # the target's model-wide window (export.py: vLLM would apply it to the drafter's layer too)
        self.target_sliding_window = target_sliding_window
        # transformers' default initialisation (linear, embedding, norms and the rotary buffers a load recomputes)
        self.initializer_range = self.backbone.get("initializer_range", 0.02)
        super().__init__(**kwargs)

    def layer_config(self) -> PretrainedConfig:
        """The backbone architecture with num_layers layers (at intermediate_size): what the drafter's decoder layers
        are built from."""
        config = AutoConfig.for_model(**copy.deepcopy(self.backbone))
        config.num_hidden_layers = self.num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1] * self.num_layers
        if self.intermediate_size:
            config.intermediate_size = self.intermediate_size
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
        self.layers = base.layers  # the first as above; any further one a plain layer of the backbone
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
        position_embeddings = self.rotary_emb(hidden, position_ids)
        attn_out, _ = layer.self_attn(hidden_states=attn_in, position_embeddings=position_embeddings,
                                      attention_mask=mask, past_key_values=cache)
        hidden = hidden + attn_out
        out = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for later in self.layers[1:]:  # drafter.num_layers > 1: plain layers, their own entries in the cache
            out = later(out, attention_mask=mask, position_embeddings=position_embeddings, past_key_values=cache)
        return self.norm(out) if self.config.norm_output else out  # norm_output: the next step reads it normed

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] step outputs -> [..., Vd] logits over the draft vocabulary (norm_output: already normed)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config.layer_config())

    # ---- training ----

    def forward(self, input_ids: Tensor, features: Tensor, attention_mask: Tensor, gather_pos: Tensor,
                steps: int, feature_noise: float = 0.0) -> list[Tensor]:
        """Training-time test: `steps` unrolled steps over whole sequences, in one module call (so DDP / DeepSpeed
        hooks run). input_ids/attention_mask [B, T], features [B, T, n*H_t], gather_pos [B, R] target positions p
        whose distribution is learned. Returns, per step j, the draft logits [B, R, Vd] of row p - 1 - j (the row
        whose step j predicts the token after position p; rows < 0 are clamped, the loss masks them).
        feature_noise: drafter.feature_noise, applied in training mode only (decoding calls fuse, never this)."""
        batch, length = input_ids.shape
        hidden, outputs = self.fused_input(features, feature_noise if self.training else 0.0), []
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
                    draft_len: int, norm_before_fc: bool = False, norm_output: bool = False,
                    init_from_target: bool = False, num_layers: int = 1, intermediate_size: int = 0
                    ) -> "Eagle3Model":
        """A new drafter for `target`: frozen copy of its embeddings, LM head rows and final norm of the draft
        vocabulary; fc freshly initialised, the layers too unless init_from_target (copy_target_layers)."""
        config = new_config(target, layer_ids, draft_ids.numel(), fc_norm, draft_len, norm_before_fc)
        config.norm_output, config.num_layers, config.intermediate_size = norm_output, num_layers, intermediate_size
        drafter = cls(config).to(target.dtype)
        drafter.copy_from_target(target, draft_ids)
        if init_from_target:
            drafter.copy_target_layers(target)
        return drafter.to(target.device)

    @torch.no_grad()
    def copy_target_layers(self, target: PreTrainedModel) -> None:
        """drafter.init_from_target: the drafter's layers start as the target's last ones (one layer: its last).

        The first layer's q/k/v read [normed embedding; normed hidden] (2H): the hidden half gets the target's
        weights and the embedding half zeros, so at the start the layer is exactly the target's layer on the hidden
        input (its residual stream), at the target's own attention scale; the same weights on both halves would
        instead add two unrelated inputs and roughly double the attention logits. Zeros still learn (their gradient
        is the embedding times the output's), so the token's contribution grows from there. hidden_norm gets the
        target's input_layernorm (it normalises what the target's layer normalised); input_layernorm, on the token
        embedding whose columns start at zero, keeps its init. o_proj, the MLP and post_attention_layernorm are copied
        as they are, and any further layer is the next target layer whole."""
        width, mine = target.config.get_text_config().hidden_size, self.config.layer_config().hidden_size
        if width != mine:
            raise ConfigError(f"drafter.init_from_target: the target's hidden size is {width}, the drafter's {mine}")
        sources = target.get_decoder().layers
        if len(sources) < len(self.layers):
            raise ConfigError(f"drafter.init_from_target: the target has {len(sources)} layers, the drafter "
                              f"{len(self.layers)} to start from its last ones")
        sources = sources[-len(self.layers):]
        for i, (layer, source) in enumerate(zip(self.layers, sources)):
            _copy_layer(layer, dict(source.named_parameters()), first=i == 0)


def _copy_layer(layer: nn.Module, theirs: dict, first: bool) -> None:
    """One target decoder layer's parameters `theirs` into a drafter layer (first: EAGLE-3's 2H-wide one, see
    Eagle3Model.copy_target_layers); a parameter either side lacks, or of another shape, is refused in one line."""
    mine = dict(layer.named_parameters())
    extra = sorted(set(theirs) - set(mine))
    if extra:  # q/k/v biases (Qwen2), q/k norms (Qwen3): the drafter's Llama layer would drop what they do
        raise ConfigError(f"drafter.init_from_target: the target's layer has {extra}, which the drafter's Llama layer "
                          "has no place for: leave drafter.init_from_target=false for this target")
    for name, param in mine.items():
        if first and name == "input_layernorm.weight":
            continue
        value = theirs["input_layernorm.weight" if first and name == "hidden_norm.weight" else name]
        if first and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") and name.endswith("weight"):
            value = torch.cat([torch.zeros_like(value), value], dim=1)  # [embedding half; hidden half]
        if value.shape != param.shape:
            raise ConfigError(f"drafter.init_from_target: the target's {name} is {tuple(value.shape)}, the drafter's "
                              f"{tuple(param.shape)}")
        param.copy_(value)


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
