"""Tiny random targets of every architecture family users bring (tests/test_arch_matrix.py, docs/targets.md).

Each is built in-process from its transformers config class: 4 layers, hidden 64, 4 heads of head_dim 16 (2 KV
heads), the word tokenizer's vocabulary (tests/stubs.py), and each family's own traits kept small: MoE blocks with
4 experts, tied embeddings where the family ties them (Gemma, small Qwen), sliding-window / hybrid layer types where
the family has them (window 4, shorter than the tests' sequences so that the window really cuts), q/k norms,
partial rotary, attention sinks.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

from tests.stubs import SENTENCES, SPECIALS, VOCAB, WORDS, word_tokenizer

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
WINDOW = 4
HYBRID = ["sliding_attention", "full_attention"] * 2
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)

# name -> (config class, family-specific settings)
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # small Qwen2 models tie their embeddings
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),  # q/k norms; tied like Qwen3-0.6B
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE, decoder_sparse_step=1, mlp_only_layers=[])),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, layer_types=HYBRID, query_pre_attn_scalar=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=WINDOW, layer_types=HYBRID, query_pre_attn_scalar=16)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    "olmo2": ("Olmo2Config", {}),  # q/k norms
    "granite": ("GraniteConfig", dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0,
                                      attention_multiplier=0.25)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                     layer_types=HYBRID)),  # attention sinks, hybrid layers, MoE
}
SLIDING = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
MOES = ("qwen3_moe", "mixtral", "gpt_oss")
TIED = ("qwen2", "qwen3", "gemma2", "gemma3_text")
QK_NORM = ("qwen3", "qwen3_moe", "olmo2")
# Gemma multiplies its embeddings by sqrt(hidden) = 8: at the common init they drown every layer and greedy repeats
# one token (then no window could change the output); (weight scale, embedding factor) that give varied text.
INIT = {"gemma2": (0.1, 1 / 8), "gemma3_text": (0.1, 1 / 8)}


def arch_config(name: str, **overrides):
    class_name, extra = ARCHS[name]
    config = getattr(transformers, class_name)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"  # what the decoders' tree masks are checked against (RECIPES.md)
    return config


def tiny_target(name: str, seed: int = 0, **overrides):
    """A random `name` target in eval mode, its weights drawn larger than the default init so that greedy has few
    near-ties and a random drafter sometimes agrees with it. `overrides`: config fields (vLLM's CPU attention needs
    head_dim >= 32, say)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch_config(name, **overrides), dtype=torch.float32)
    scale, embedding_factor = INIT.get(name, (0.3, 1.0))
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() > 1 and "norm" not in param_name:
                p.normal_(0.0, scale)
        model.get_input_embeddings().weight.mul_(embedding_factor)
    return model.eval().requires_grad_(False)


def folder_tokenizer(name: str):
    """The tokenizer a saved `name` target folder holds: the word tokenizer (VOCAB ids), except for Qwen2, whose
    folders transformers always loads with Qwen2Tokenizer (a byte-level BPE: it rebuilds the word tokenizer into
    one that reads every word as unknown and adds an <|endoftext|> pad past the VOCAB rows). Qwen2 gets a byte-level
    BPE trained on the tests' words instead, <unk> <s> </s> first like the word tokenizer; the model must then have
    len(tokenizer) rows."""
    if name != "qwen2":
        return word_tokenizer()
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = sorted(set("".join(WORDS)) | {"Ġ"})  # ByteLevel writes a space as Ġ
    bpe.train_from_iterator([" ".join(WORDS)] * 3 + SENTENCES, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False))
    trained = json.loads(bpe.to_str())["model"]
    return Qwen2Tokenizer(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]], unk_token="<unk>",
                          bos_token="<s>", eos_token="</s>", pad_token="</s>")
