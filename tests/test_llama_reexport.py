"""The qwen2 -> llama re-export (llama_reexport.py): the row permutation against the two ropes written out in torch,
a tiny qwen2 GGUF re-exported (keys renamed, q/k rows and biases permuted, quantised rows moved whole, the rest
copied), the same logits through transformers' own llama GGUF loader, and (opt-in, where llama.cpp is built) the same
greedy text from llama.cpp on both files."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from drafter_train.errors import ConfigError
from drafter_train.llamacpp_http import complete, free_port, running_server
from drafter_train.llama_reexport import neox_to_norm_rows, reexport_as_llama
from tests.gguf_edit import save_gguf
from tests.test_targets import add_tiny_header, write_tiny_gguf

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16

# ---------------------------------------------------------------------------------------------------------------
# The permutation against the two ropes, written out here as references


def rope_neox(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x [T, heads, d]: dimension i rotates with i + d/2 (qwen2 in llama.cpp; HF's rotate_half)."""
    d = x.shape[-1]
    angle = pos[:, None, None] * base ** (-torch.arange(d // 2) * 2 / d)  # [T, 1, d/2]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)


def rope_norm(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x [T, heads, d]: dimension 2i rotates with 2i + 1 (llama in llama.cpp)."""
    d = x.shape[-1]
    angle = pos[:, None, None] * base ** (-torch.arange(d // 2) * 2 / d)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1).flatten(-2)


def test_permuted_rows_under_the_norm_rope_give_the_neox_ropes_attention_scores():
    torch.manual_seed(0)
    hidden, tokens = 32, 7
    x, pos = torch.randn(tokens, hidden, dtype=torch.float64), torch.arange(tokens, dtype=torch.float64) * 3
    wq, bq = torch.randn(HEADS * HEAD_DIM, hidden, dtype=torch.float64), torch.randn(HEADS * HEAD_DIM, dtype=torch.float64)
    wk, bk = torch.randn(KV_HEADS * HEAD_DIM, hidden, dtype=torch.float64), torch.randn(KV_HEADS * HEAD_DIM, dtype=torch.float64)

    def scores(q_rows, q_bias, k_rows, k_bias, rope):
        q = rope((x @ q_rows.T + q_bias).view(tokens, HEADS, HEAD_DIM), pos)
        k = rope((x @ k_rows.T + k_bias).view(tokens, KV_HEADS, HEAD_DIM), pos)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    def permuted(rows, heads):
        return torch.from_numpy(neox_to_norm_rows(rows.numpy(), heads))

    neox = scores(wq, bq, wk, bk, rope_neox)
    norm = scores(permuted(wq, HEADS), permuted(bq, HEADS), permuted(wk, KV_HEADS), permuted(bk, KV_HEADS), rope_norm)
    torch.testing.assert_close(norm, neox, rtol=1e-10, atol=1e-10)
    # Without the permutation the norm rope computes something else: the test can tell.
    assert not torch.allclose(scores(wq, bq, wk, bk, rope_norm), neox, atol=1e-3)


def test_the_permutation_is_llamacpps_converter_permutation():
    """LlamaModel.permute in convert_hf_to_gguf.py, as transformers' GGUF loader reverses it."""
    rows = np.arange(HEADS * HEAD_DIM * 3).reshape(HEADS * HEAD_DIM, 3)
    out = neox_to_norm_rows(rows, HEADS)
    head = out[:HEAD_DIM, 0] // 3
    assert head.tolist() == [i // 2 + (HEAD_DIM // 2) * (i % 2) for i in range(HEAD_DIM)]
    back = out.reshape(HEADS, HEAD_DIM // 2, 2, 3).swapaxes(2, 1).reshape(rows.shape)  # transformers' reverse
    assert (back == rows).all()
    with pytest.raises(ConfigError, match="do not split into 3 heads"):
        neox_to_norm_rows(rows, 3)


# ---------------------------------------------------------------------------------------------------------------
# A tiny qwen2 GGUF, re-exported

QWEN2_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_qwen2(vocab: int) -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=vocab, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_theta=10000.0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases as trained models have them (random init leaves them at zero)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
        # Wide logit margins: llama.cpp's f16 KV cache sums q.k over a head's dimensions in another order under the
        # two ropes, which a random model's near-ties (margins ~0.003) would turn into a different greedy token.
        model.lm_head.weight.mul_(40)
    return model


def write_tiny_qwen2_gguf(path: Path, quantise_q: bool = False) -> Qwen2ForCausalLM:
    """A qwen2 GGUF the way llama.cpp's converter writes one (no q/k permutation: qwen2 runs the NEOX rope); with
    `quantise_q` the q weights are Q8_0, to check that quantised rows move whole."""
    tokens = list(bytes_to_unicode().values()) + ["<|endoftext|>", "<|im_end|>"]
    model = tiny_qwen2(len(tokens))
    cfg, state = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "qwen2")
    add_tiny_header(writer, "tiny qwen2", cfg, tokens)
    writer.add_tokenizer_pre("qwen2")
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in QWEN2_NAMES.items():
            data = state[f"model.layers.{i}.{hf_name}"]
            if quantise_q and gguf_name == "attn_q.weight":
                writer.add_tensor(f"blk.{i}.{gguf_name}", gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(f"blk.{i}.{gguf_name}", data)
    save_gguf(writer)
    return model


@pytest.fixture(scope="module")
def qwen2_pair(tmp_path_factory) -> tuple[Path, Path, Qwen2ForCausalLM]:
    folder = tmp_path_factory.mktemp("reexport")
    model = write_tiny_qwen2_gguf(folder / "qwen2.gguf")
    reexport_as_llama(folder / "qwen2.gguf", folder / "llama.gguf")
    return folder / "qwen2.gguf", folder / "llama.gguf", model


def test_the_reexport_renames_keys_permutes_q_and_k_and_copies_the_rest(qwen2_pair):
    src, dst, _ = qwen2_pair
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert after.fields["general.architecture"].contents() == "llama"
    assert not [k for k in after.fields if k.startswith("qwen2.")]
    renamed = {k.replace("qwen2.", "llama.", 1): f.contents() for k, f in before.fields.items()
               if not k.startswith("GGUF.") and k != "general.architecture"}
    assert {k: after.fields[k].contents() for k in renamed} == renamed
    old = {t.name: t for t in before.tensors}
    assert [t.name for t in after.tensors] == list(old)
    for tensor in after.tensors:
        original = np.asarray(old[tensor.name].data)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            heads = HEADS if ".attn_q." in tensor.name else KV_HEADS
            assert np.array_equal(tensor.data, neox_to_norm_rows(original, heads)), tensor.name
            assert not np.array_equal(tensor.data, original)
        else:
            assert np.array_equal(tensor.data, original), tensor.name
        assert tensor.tensor_type == old[tensor.name].tensor_type


def test_quantised_rows_move_whole(tmp_path):
    write_tiny_qwen2_gguf(tmp_path / "q.gguf", quantise_q=True)
    reexport_as_llama(tmp_path / "q.gguf", tmp_path / "l.gguf")
    [q_before] = [t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors if t.name == "blk.0.attn_q.weight"]
    [q_after] = [t for t in gguf.GGUFReader(tmp_path / "l.gguf").tensors if t.name == "blk.0.attn_q.weight"]
    assert q_after.tensor_type == gguf.GGMLQuantizationType.Q8_0
    # Dequantising the moved rows gives exactly the permuted dequantised rows: no value was requantised.
    assert np.array_equal(gguf.quants.dequantize(q_after.data, q_after.tensor_type),
                          neox_to_norm_rows(gguf.quants.dequantize(q_before.data, q_before.tensor_type), HEADS))


def test_transformers_reads_the_same_model_from_both_files(qwen2_pair):
    """transformers' GGUF loader undoes llama's permutation (and not qwen2's): both files load to the same logits as
    the source model."""
    src, dst, model = qwen2_pair
    ids = torch.tensor([[5, 70, 33, 120, 8, 99, 41]])
    from_qwen2 = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    from_llama = AutoModelForCausalLM.from_pretrained(dst.parent, gguf_file=dst.name, dtype=torch.float32,
                                                      attention_bias=True)
    assert from_llama.config.model_type == "llama" and from_qwen2.config.model_type == "qwen2"
    with torch.no_grad():
        reference = model(ids).logits
        torch.testing.assert_close(from_qwen2(ids).logits, reference, atol=1e-4, rtol=0)
        torch.testing.assert_close(from_llama(ids).logits, reference, atol=1e-4, rtol=0)


def test_only_qwen2_files_are_reexported_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "llama.gguf")
    with pytest.raises(ConfigError, match="architecture is 'llama'; only qwen2 GGUFs are re-exported"):
        reexport_as_llama(tmp_path / "llama.gguf", tmp_path / "out" / "x.gguf")
    write_tiny_qwen2_gguf(tmp_path / "qwen2.gguf")
    monkeypatch.setattr("drafter_train.llama_reexport._write", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        reexport_as_llama(tmp_path / "qwen2.gguf", tmp_path / "out" / "x.gguf")
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Opt-in: llama.cpp's own greedy output on both files

LLAMACPP = Path(os.environ.get("DRAFTER_TRAIN_LLAMACPP", Path(__file__).resolve().parents[1] / ".llamacpp"))


def _greedy(model: Path, prompts: list[list[int]], log: Path) -> list[list[int]]:
    """llama-server's greedy tokens (token ids in and out: llama-completion's piped stdout loses text at random)."""
    command = [str(LLAMACPP / "build" / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port",
               str(free_port()), "-t", "2", "-c", "512", "-np", "1"]
    with running_server(command, log) as url:
        return [complete(url, ids, 24)["tokens"] for ids in prompts]


@pytest.mark.slow
@pytest.mark.skipif(not (LLAMACPP / "build" / "bin" / "llama-server").is_file(),
                    reason="llama.cpp not built (scripts/setup_llamacpp.sh; $DRAFTER_TRAIN_LLAMACPP)")
def test_llamacpp_decodes_both_files_to_the_same_greedy_tokens(qwen2_pair, tmp_path):
    src, dst, _ = qwen2_pair
    prompts = [[71, 68, 75, 75, 78], [64, 65, 66, 220, 67, 68, 69], [83, 71, 68, 220, 80, 84, 72, 66, 74]]
    original = _greedy(src, prompts, tmp_path / "qwen2.log")
    assert all(len(tokens) == 24 for tokens in original)
    assert _greedy(dst, prompts, tmp_path / "llama.log") == original
