"""The decoder-layer architecture of drafters that are not cut from their target (EAGLE-3, DFlash).

Serving engines run these drafters with one fixed layer type whatever the target is: Llama layers for EAGLE-3
(vLLM / SGLang `LlamaForCausalLMEagle3`), Qwen3 layers (q/k norms) for DFlash. A drafter built from the target's own
modules would not be what the engine runs, and many families' layers cannot be reused as is (Phi-3's fused qkv,
OLMo-2's post-norm, Gemma 3's per-layer-type rotary, gpt-oss's router outputs): so every target other than the
engine's own family gets the engine's layer at the target's sizes.
"""

from __future__ import annotations

from transformers import PretrainedConfig


def plain_layer_config(target: PretrainedConfig, config_class: type) -> dict:
    """A `config_class` (LlamaConfig, Qwen3Config) config dict with the target's sizes, norm epsilon, rope base and
    special ids: full attention, rope without scaling, SiLU MLP, no biases."""
    rope = dict(getattr(target, "rope_parameters", None) or {})
    rope = dict(rope.get("full_attention", rope))  # hybrid models (Gemma 3) keep one rope per layer type
    heads = target.num_attention_heads
    return config_class(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
        head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads, hidden_act="silu",
        max_position_embeddings=target.max_position_embeddings,
        initializer_range=getattr(target, "initializer_range", 0.02),
        rms_norm_eps=getattr(target, "rms_norm_eps", None) or 1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)},
        attention_bias=False, bos_token_id=target.bos_token_id, eos_token_id=target.eos_token_id,
        pad_token_id=getattr(target, "pad_token_id", None),
    ).to_dict()
