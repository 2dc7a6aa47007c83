"""The target matrix (docs/targets.md): every architecture family of tests/archs.py x every trainable drafter kind.

Per cell: the captured features are transformers' hidden states at the configured ids, a few training steps lower
the kind's own loss, greedy speculative decoding equals greedy decoding computed WITHOUT a KV cache (so a cache that
forgets a sliding window's keys cannot hide behind a baseline that forgets them too), and so does greedy decoding with
draft trees on every target without sliding layers, and the export formats write what their engine reads. Sampling
is checked by chi-square on one cell per kind. Cells that are refused are refused in one line at start-up, and tested
as such.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.data.batches import collate
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative
from drafter_train.decoding.tree import TreeSpec
from drafter_train.decoding.verify import make_tree_verifier, make_verifier
from drafter_train.drafters.common.conditioned import target_signals
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.registry import get_kind, make_drafter
from drafter_train.errors import ConfigError
from drafter_train.features import FeatureTap
from tests.archs import ARCHS, MOES, QK_NORM, SLIDING, TIED, tiny_target
from tests.stubs import compose_cfg, word_tokenizer
from tests.test_sampling_exactness import chi2_pvalue, enumerate_marginals, sampled_counts
from tests.test_tree_sampling import tree_counts

GREEDY = make_verifier("greedy", SamplingParams())
PROMPT = [1, 5, 9, 12, 7, 4]  # + 24 new tokens: far past the sliding window (4)
NEW_TOKENS = 24
KINDS = {
    "ar": ["drafter.path=truncated:1"],
    "nar": ["drafter=nar", "drafter.path=truncated:1", "drafter.blocks_per_sequence=2"],
    # online features: these batches are made here, not read from a feature cache (the recipe's offline)
    "eagle3": ["drafter=eagle3", "drafter.draft_vocab_size=0", "drafter.ttt_steps=2", "drafter.features=online"],
    "dflash": ["drafter=dflash", "drafter.draft_vocab_size=0", "drafter.draft_len=4", "drafter.block_size=5",
               "drafter.blocks_per_sequence=2"],
    "layerskip": ["drafter=layerskip", "drafter.skip_attn=[2]", "drafter.skip_mlp=[1]"],
}
TRAINED = ("ar", "nar", "eagle3", "dflash")  # layerskip's skip set is searched, not trained (test_layerskip.py)
# cell -> the start-up refusal's reason (docs/targets.md)
REFUSED = {(arch, "layerskip"): "needs a full KV cache" for arch in SLIDING}
CELLS = [(arch, kind) for arch in ARCHS for kind in KINDS]
TREE = TreeSpec(2, 3, 6)
TREE_CELLS = [(arch, kind) for arch in ARCHS if arch not in SLIDING for kind in KINDS]
# cells whose sampling is checked by chi-square -> the sampled tree (None: a chain)
SAMPLED = {("gpt_oss", "eagle3"): None, ("gemma2", "nar"): None, ("phi3", "ar"): None,
           ("qwen3", "dflash"): TreeSpec(2, 2, 4), ("olmo2", "eagle3"): TreeSpec(3, 2, None, "iid"),
           ("qwen3_moe", "layerskip"): TreeSpec(2, 2, 4)}


@functools.lru_cache(maxsize=None)
def target(arch: str):
    return tiny_target(arch)


def job(kind: str, *extra: str):
    return OmegaConf.to_object(compose_cfg("train", ["target.path=/unused", "train.max_seq_len=64", *KINDS[kind],
                                                     *extra]))


def drafter(arch: str, kind: str, for_training: bool = False, *extra: str):
    return load_drafter(job(kind, *extra).drafter, target(arch), word_tokenizer(), "float32", for_training)


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def uncached_greedy(arch: str) -> list[int]:
    """Greedy decoding by full forwards over the whole sequence (no KV cache at all)."""
    model, seq = target(arch), list(PROMPT)
    for _ in range(NEW_TOKENS):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(PROMPT):]


# ---- features ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_features_are_the_hidden_states_at_the_configured_ids(arch):
    """features.py: layer i's feature is hidden_states[i + 1], through MoE blocks, sinks and sliding layers alike;
    the kinds' own capture (target_signals at their configured layers) gives the same."""
    model, ids = target(arch), torch.tensor([PROMPT + PROMPT[::-1]])
    layer_ids = [0, 1, 2]  # the last layer's hidden state is taken after the final norm by transformers
    with torch.no_grad(), FeatureTap(model, layer_ids) as tap:
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        features = tap.features.chunk(len(layer_ids), dim=-1)
    for i, feature in zip(layer_ids, features):
        torch.testing.assert_close(feature, hidden[i + 1])
    batch = collate([{"prompt_ids": PROMPT, "response_ids": PROMPT[::-1]}], "response_ids", 64, 0)
    for kind in ("eagle3", "dflash"):
        layers = drafter(arch, kind).config.target_layers
        captured, _ = target_signals(model, batch, layers)
        torch.testing.assert_close(captured, torch.cat([hidden[i + 1] for i in layers], dim=-1))


# ---- greedy is lossless, or the cell is refused at start-up -----------------------------------------------------


@pytest.mark.parametrize("arch,kind", TREE_CELLS)
def test_greedy_tree_decoding_equals_greedy_decoding(arch, kind):
    """Draft trees (EAGLE-2's top-k trees: one target pass over a 4-D tree mask, then the cache keeps one path) on
    every target that supports them (sliding-window ones refuse trees: test_sliding_window_targets_refuse_...)."""
    out = generate_tree_speculative(target(arch), make_drafter(drafter(arch, kind).eval()), PROMPT, TREE,
                                    make_tree_verifier("greedy", SamplingParams()), NEW_TOKENS)
    assert out.tokens == uncached_greedy(arch)
    assert out.stats.target_forward_passes + out.stats.accepted == NEW_TOKENS  # each pass: its path + 1 token


@pytest.mark.parametrize("arch,kind", CELLS)
def test_greedy_speculative_decoding_equals_greedy_decoding(arch, kind):
    if (arch, kind) in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[arch, kind]) as err:
            drafter(arch, kind)
        assert "\n" not in str(err.value)
        return
    out = generate_speculative(target(arch), make_drafter(drafter(arch, kind).eval()), PROMPT, 4, GREEDY, NEW_TOKENS)
    assert out.tokens == uncached_greedy(arch)
    assert out.stats.proposed > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_cached_decoding_equals_uncached_decoding(arch):
    """The baseline every speedup is measured against keeps every layer's window right, too."""
    assert generate_autoregressive(target(arch), PROMPT, NEW_TOKENS).tokens == uncached_greedy(arch)


# ---- training ------------------------------------------------------------------------------------------------------


def training_batch(arch: str, kind: str, cfg):
    model = target(arch)
    records = [{"prompt_ids": PROMPT[: 2 + i], "response_ids": uncached_greedy(arch)[i: i + 10]} for i in range(3)]
    batch = collate(records, "response_ids", cfg.train.max_seq_len, 0, topk=False)
    return get_kind(kind).prepare_batch(batch, records, cfg).to(model.device)


@pytest.mark.parametrize("arch,kind", [(a, k) for a in ARCHS for k in TRAINED])
def test_a_few_training_steps_lower_the_loss(arch, kind):
    torch.manual_seed(0)
    cfg, spec = job(kind), get_kind(kind)
    module = spec.training_module(drafter(arch, kind, True))
    before = {name: p.clone() for name, p in target(arch).named_parameters()}
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(6):
        batch = training_batch(arch, kind, cfg)  # nar/dflash draw their blocks anew each time, as training does
        out = spec.loss(module, target(arch), batch, cfg)
        (out.loss_sum / out.num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss_sum / out.num_tokens))
    assert losses[-1] < losses[0], losses
    # the target is never trained, tied embeddings included
    assert all(torch.equal(p, before[name]) for name, p in target(arch).named_parameters())


@pytest.mark.parametrize("arch", TIED)
@pytest.mark.parametrize("kind", TRAINED)
def test_tied_embeddings_the_drafter_trains_its_own_copies(arch, kind):
    """A tied target (one tensor for embeddings and LM head) lends the drafter copies, never the tensor itself."""
    model = target(arch)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    target_storage = {p.data_ptr() for p in model.parameters()}
    trainable = [p for p in drafter(arch, kind, True).parameters() if p.requires_grad]
    assert trainable and not target_storage & {p.data_ptr() for p in trainable}


# ---- sliding-window and hybrid attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_window_targets_refuse_trees_and_layerskip_in_one_line(arch):
    """A tree's own 4-D mask would override the window of the sliding layers; layer skipping drafts on the target's
    cache. Both refuse at start-up; chains are lossless (test_greedy_speculative_decoding_equals_greedy_decoding)."""
    model = target(arch)
    assert generate_autoregressive(model, PROMPT, 1).tokens  # loads and decodes
    with pytest.raises(ConfigError, match="sliding-window") as err:
        generate_tree_speculative(model, make_drafter(drafter(arch, "ar")), PROMPT, TreeSpec(2, 2),
                                  make_tree_verifier("greedy", SamplingParams()), 8)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="sliding-window"):
        drafter(arch, "layerskip")


@pytest.mark.parametrize("arch", SLIDING)
def test_the_sliding_window_really_cuts(arch):
    """Sequences longer than the window: the same weights without the window decode differently, so the lossless
    chains above are checked where the window matters."""
    model = target(arch)
    unwindowed = tiny_target(arch)
    unwindowed.config.sliding_window = 10_000
    assert generate_autoregressive(unwindowed, PROMPT, NEW_TOKENS).tokens != uncached_greedy(arch)
    assert model.config.sliding_window < len(PROMPT) + NEW_TOKENS


# ---- MoE blocks and attention variants -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [a for a in MOES if a not in SLIDING])
def test_moe_blocks_layerskip_skips_them_and_stays_lossless(arch):
    """Skipping an MoE block (router and experts) drafts differently from the target, and verification keeps the
    output the target's."""
    model = target(arch)
    skipping = make_drafter(drafter(arch, "layerskip", False, "drafter.skip_attn=[]", "drafter.skip_mlp=[1,2]"))
    out = generate_speculative(model, skipping, PROMPT, 4, GREEDY, NEW_TOKENS)
    assert out.tokens == uncached_greedy(arch) and out.stats.acceptance_rate < 1.0


@pytest.mark.parametrize("arch,attr", [*((a, "q_norm") for a in QK_NORM), ("phi3", "partial_rotary_factor"),
                                       ("gpt_oss", "sinks")])
def test_attention_variants_are_present_in_the_tiny_targets(arch, attr):
    """The matrix exercises what it claims: q/k norms (Qwen3, Qwen3-MoE, OLMo-2), Phi-3's partial rotary, gpt-oss's
    attention sinks."""
    model = target(arch)
    if attr == "partial_rotary_factor":
        assert model.config.partial_rotary_factor < 1.0
        return
    assert hasattr(model.model.layers[0].self_attn, attr)


@pytest.mark.parametrize("arch,kind", list(SAMPLED))
def test_speculative_sampling_passes_the_chi_square_test(arch, kind):
    """Speculative samples follow the target's own distribution (exact marginals of the first two tokens by
    enumeration), one cell per kind, chains and both kinds of sampled trees: the riskiest target (gpt-oss: sliding +
    full layers, attention sinks, MoE) with EAGLE-3, and the other traits with the other kinds."""
    model, tree = target(arch), SAMPLED[arch, kind]
    params, prompt, num_tokens, vocab = SamplingParams(temperature=1.0), [1, 5, 3, 8, 9, 4], 2, model.config.vocab_size
    model_d = drafter(arch, kind).eval()
    if tree is None:
        counts = sampled_counts(model, model_d, prompt, vocab, make_verifier("sample", params), params, 400,
                                num_tokens, 2)
    else:
        counts = tree_counts(model, lambda: make_drafter(model_d), prompt, vocab, "sample", tree, params, 400,
                             num_tokens)
    exact = enumerate_marginals(model, prompt, num_tokens, vocab, params)
    pvalues = [chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)]
    assert min(pvalues) > 1e-3, pvalues


# ---- exports -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle3_exports_carry_engine_layer_ids_and_norm_flags(arch, tmp_path):
    """vLLM: eagle_aux_hidden_state_layer_ids at the top level, norm_before_fc / fc_norm stated; SGLang:
    eagle_config; both in the engines' 'input of layer i' convention (ours + 1), on a Llama layer config."""
    from drafter_train.drafters.eagle3.export import FORMATS

    model = drafter(arch, "eagle3", False, "drafter.target_layers=[0,1,2]", "drafter.fc_norm=false")
    model.save_pretrained(tmp_path / "drafter")
    target(arch).save_pretrained(tmp_path / "target")  # its config.json names its architecture
    for name, write in FORMATS.items():
        if name == "gguf":  # llama.cpp's converter: tests/test_gguf.py (it needs the setup script's build)
            continue
        write(tmp_path / "drafter", tmp_path / name, 4, str(tmp_path / "target"), False)
    vllm = json.loads((tmp_path / "vllm" / "config.json").read_text())
    sglang = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert vllm["norm_before_fc"] is False and vllm["fc_norm"] is False
    assert vllm["transformer_layer_config"]["model_type"] == "llama"
    # the verifier is the target's architecture (speculators refuses a config without one), not the drafter layer's
    assert vllm["speculators_config"]["verifier"]["architectures"] == [type(target(arch)).__name__]
    assert vllm["transformer_layer_config"]["hidden_size"] == target(arch).config.hidden_size
    # vLLM would give the drafter layer Mistral's model-level window (no layer_types): a window as long as the
    # context keeps it full; hybrid targets (per-layer windows) and full ones need nothing
    window = {"layer_types": ["sliding_attention"], "sliding_window": 256} if arch == "mistral" else {}
    assert {k: vllm["transformer_layer_config"].get(k) for k in window} == window
    assert arch == "mistral" or "sliding_window" not in vllm["transformer_layer_config"]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_dflash_vllm_export_is_a_qwen3_draft_model_with_our_layer_ids(arch, tmp_path):
    """DFlash's target_layer_ids are 'output of layer i', ours, written as they are."""
    from drafter_train.drafters.dflash.export import FORMATS

    model = drafter(arch, "dflash")
    model.save_pretrained(tmp_path / "drafter")
    FORMATS["vllm"](tmp_path / "drafter", tmp_path / "vllm", 4, "target", False)
    spec = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert spec["model_type"] == "qwen3" and spec["architectures"] == ["DFlashDraftModel"]
    assert spec["dflash_config"]["target_layer_ids"] == model.config.target_layers
    assert spec["num_target_layers"] == 4 and spec["target_hidden_size"] == 64


# ---- the plumbing, once: datagen -> drafter-train -> checkpoint evaluation on a non-Llama target --------------------


def test_drafter_train_runs_end_to_end_on_a_tied_hybrid_gemma3_target(tmp_path):
    """Saving and loading the target folder, datagen, EAGLE-3 training and the checkpoint's speculative evaluation
    (chains on a target with sliding and full layers)."""
    from drafter_train.recipes.train import train
    from tests.conftest import write_tiny_data
    from tests.test_train import losses, train_cfg

    root = write_tiny_data(tmp_path, tiny_target("gemma3_text"))
    cfg = train_cfg(root, tmp_path / "runs", "drafter=eagle3", "drafter.path=new", "drafter.draft_vocab_size=0",
                    "train.max_steps=6", "train.save_every=6")
    metrics = train(cfg)
    by_step = losses(tmp_path / "runs" / cfg.train.run_name)
    assert by_step[6] < by_step[1]
    assert metrics["greedy_match"] == 1.0 and metrics["tau"] >= 1.0
