"""llama.cpp: the norm_before_fc EAGLE-3 variant (the layout stock llama.cpp runs; its lossless decoding is in
test_eagle3.py with the other layouts), export.format=gguf and its refusals.

The first part needs no llama.cpp. The GGUF files themselves are written by llama.cpp's own converter: those tests
run where scripts/setup_llamacpp.sh unpacked it ($DRAFTER_TRAIN_LLAMACPP, default .llamacpp in the repo) and on the
real stories260K target (a SentencePiece vocabulary the converter knows), and skip elsewhere. Serving the files in
llama.cpp is checked by tests/test_engine_llamacpp.py where the tools are built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from drafter_train import draft_vocab
from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig
from drafter_train.errors import ConfigError
from drafter_train.llamacpp import llamacpp_dir
from drafter_train.recipes.export import ExportConfig, export
from drafter_train.recipes.train import train
from tests.stubs import compose_cfg
from tests.test_eagle3 import eagle3_cfg, random_eagle3

needs_converter = pytest.mark.skipif(
    not (llamacpp_dir() / "llama.cpp" / "convert_hf_to_gguf.py").is_file(),
    reason=f"no llama.cpp source in {llamacpp_dir()} (scripts/setup_llamacpp.sh)")


# ---------------------------------------------------------------------------------------------------------------
# The norm_before_fc variant


def test_norm_before_fc_is_one_rmsnorm_over_the_whole_concatenation(make_tiny_llama):
    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target, norm_before_fc=True)
    assert model.fc_norm is None and model.input_norm.weight.shape == (3 * 64,)
    features = torch.randn(2, 5, 3 * 64) * torch.tensor([1.0, 30.0, 1000.0]).repeat_interleave(64)  # massive layer
    eps = target.config.rms_norm_eps
    normed = features / torch.sqrt(features.pow(2).mean(-1, keepdim=True) + eps) * model.input_norm.weight
    torch.testing.assert_close(model.fuse(features), normed @ model.fc.weight.T, rtol=1e-5, atol=1e-5)
    # not the per-layer norm: there the small first layer's feature would be scaled up on its own
    per_layer = torch.cat([c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps) for c in features.chunk(3, -1)], -1)
    assert not torch.allclose(model.fuse(features), (per_layer * model.input_norm.weight) @ model.fc.weight.T,
                              rtol=1e-3, atol=1e-3)


def test_norm_before_fc_replaces_fc_norm_in_the_config():
    with pytest.raises(ConfigError, match="drafter.norm_before_fc: .*drafter.fc_norm=false"):
        Eagle3DrafterConfig(norm_before_fc=True)
    assert Eagle3DrafterConfig(norm_before_fc=True, fc_norm=False).norm_before_fc


@pytest.fixture(scope="module")
def nbf_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("nbf")
    cfg = eagle3_cfg(tiny_data, out, "train.max_steps=3", "train.save_every=3", "drafter.fc_norm=false",
                     "drafter.norm_before_fc=true", "loss=fkl")
    train(cfg)
    return out / cfg.train.run_name


def test_a_norm_before_fc_drafter_trains_its_input_norm_and_loads_back(nbf_run):
    from drafter_train.drafters.eagle3.model import load

    saved = load_file(nbf_run / "latest" / "drafter" / "model.safetensors")
    assert not any(k.startswith("fc_norm") for k in saved)
    assert not torch.equal(saved["input_norm.weight"], torch.ones(3 * 64))  # trained, not left at its init
    config = json.loads((nbf_run / "latest" / "drafter" / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["fc_norm"] is False
    model = load(str(nbf_run / "latest" / "drafter"), "float32")
    assert torch.equal(model.input_norm.weight, saved["input_norm.weight"])
    metrics = json.loads((nbf_run / "latest" / "metrics.json").read_text())
    assert metrics["greedy_match"] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# Refusals (no llama.cpp needed: each comes before the converter is looked for, or is about its absence)


def gguf_export(run: Path, out: Path, **fields) -> None:
    export(ExportConfig(run_dir=str(run), which="latest", output_dir=str(out), format="gguf", **fields))


def test_gguf_export_refuses_per_layer_fc_norm_and_other_layer_counts(tiny_data, tmp_path):
    runs = tmp_path / "runs"
    per_layer = eagle3_cfg(tiny_data, runs, "train.max_steps=1", "train.save_every=1", "drafter.fc_norm=true",
                           "train.run_name=per-layer")
    train(per_layer)
    with pytest.raises(ConfigError, match="export.format=gguf: llama.cpp's EAGLE-3 has no per-layer fc_norm"):
        gguf_export(runs / "per-layer", tmp_path / "x")
    two = eagle3_cfg(tiny_data, runs, "train.max_steps=1", "train.save_every=1", "drafter.fc_norm=false",
                     "drafter.target_layers=[0,2]", "train.run_name=two")
    train(two)
    with pytest.raises(ConfigError, match="fuses exactly 3 target layers, this drafter fuses 2"):
        gguf_export(runs / "two", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_norm_before_fc_goes_to_vllm_and_gguf_not_sglang_and_gguf_needs_the_llamacpp_build(nbf_run, tmp_path):
    with pytest.raises(ConfigError, match="norm_before_fc"):
        export(ExportConfig(run_dir=str(nbf_run), which="latest", output_dir=str(tmp_path / "sglang"), format="sglang"))
    with pytest.raises(ConfigError, match="export.format=gguf: no llama.cpp converter in .*scripts/setup_llamacpp.sh"):
        gguf_export(nbf_run, tmp_path / "gguf", llamacpp=str(tmp_path / "nowhere"))
    assert not (tmp_path / "gguf").exists() and not list(tmp_path.glob(".gguf*"))


def test_norm_before_fc_vllm_export_states_it_where_vllm_reads_it(nbf_run, tmp_path):
    """vLLM's speculators reader (transformers_utils/configs/speculators/algos.py, update_eagle3) takes
    norm_before_fc and fc_norm from the top level of config.json, defaulting both to false; its Eagle3 Llama model
    then loads `input_norm.weight` and applies it to the whole concatenation before fc (llama_eagle3.py)."""
    out = tmp_path / "vllm"
    export(ExportConfig(run_dir=str(nbf_run), which="latest", output_dir=str(out), format="vllm"))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_fc"] is True and config["fc_norm"] is False
    assert "norm_before_fc" not in config["transformer_layer_config"]  # the layer config is the Llama layer's only
    exported = load_file(out / "model.safetensors")
    trained = load_file(nbf_run / "latest" / "drafter" / "model.safetensors")
    assert torch.equal(exported["input_norm.weight"], trained["input_norm.weight"])
    assert exported["input_norm.weight"].shape == (config["target_hidden_size"] * 3,)
    assert not any(k.startswith("fc_norm") for k in exported)


def test_bad_gguf_type_fails_in_one_line():
    with pytest.raises(ConfigError, match="export.gguf_type: must be one of"):
        ExportConfig(format="gguf", gguf_type="q3_x")
    with pytest.raises(ConfigError, match="export.drafter_gguf_type: must be one of") as err:
        ExportConfig(format="gguf", drafter_gguf_type="int4")
    assert "\n" not in str(err.value)


def test_the_drafters_gguf_type_defaults_to_float_beside_the_target():
    from drafter_train.llamacpp import GgufJob

    assert GgufJob(Path("."), Path("."), "f32").drafter_type == "f32"  # auto: f32 with an f32 target
    assert GgufJob(Path("."), Path("."), "q8_0").drafter_type == "f16"  # else f16
    assert GgufJob(Path("."), Path("."), "f16", drafter_gguf_type="q4_k_m").drafter_type == "q4_k_m"


def fake_converter(root: Path, log: Path) -> Path:
    """A llama.cpp folder whose converter writes its --outtype into the out file and whose llama-quantize logs its
    arguments and copies its input."""
    import stat

    (root / "llama.cpp").mkdir(parents=True)
    (root / "llama.cpp" / "convert_hf_to_gguf.py").write_text(
        "import sys\nargs = sys.argv\nopen(args[args.index('--outfile') + 1], 'w').write(args[args.index('--outtype') + 1])\n")
    (root / "build" / "bin").mkdir(parents=True)
    quantize = root / "build" / "bin" / "llama-quantize"
    quantize.write_text(f'#!/bin/sh\necho "$(cat "$1") $3" >> {log}\ncp "$1" "$2"\n')
    quantize.chmod(quantize.stat().st_mode | stat.S_IXUSR)
    return root


def test_an_ar_drafter_is_quantised_by_llama_quantize_from_an_f16_file(tmp_path):
    """export.drafter_gguf_type=q4_k_m on the AR kind: converted in f16, then llama-quantize to Q4_K_M; the f16
    intermediate is gone. Float types convert directly."""
    from drafter_train.drafters.ar.export import write_gguf
    from drafter_train.llamacpp import GgufJob

    log = tmp_path / "quantize.log"
    root = fake_converter(tmp_path / "llcpp", log)
    out = tmp_path / "out"
    write_gguf(tmp_path, out, 3, "t", False, GgufJob(root, tmp_path, "f16", with_target=False,
                                                     drafter_gguf_type="q4_k_m"))
    assert log.read_text() == "f16 Q4_K_M\n" and (out / "drafter.gguf").read_text() == "f16"
    assert sorted(p.name for p in out.iterdir()) == ["drafter.gguf"]
    write_gguf(tmp_path, out, 3, "t", False, GgufJob(root, tmp_path, "f32", with_target=False))
    assert (out / "drafter.gguf").read_text() == "f32" and log.read_text() == "f16 Q4_K_M\n"


def test_a_quantised_drafter_is_converted_in_f16_then_quantised_and_refused_without_llama_quantize(tmp_path):
    """convert_staged (EAGLE-3's and DFlash's): export.drafter_gguf_type=q8_0 converts the staged folder in f16,
    then llama-quantize makes Q8_0 and the f16 file is gone; a float type converts directly; a build without
    llama-quantize is one line before the staging folder is written."""
    from drafter_train.llamacpp import GgufJob, convert_staged

    log = tmp_path / "quantize.log"
    root = fake_converter(tmp_path / "llcpp", log)
    out = tmp_path / "out"
    out.mkdir()
    staged = []
    convert_staged(GgufJob(root, tmp_path, "f16", with_target=False, drafter_gguf_type="q8_0"), out, "eagle3",
                   lambda staging: staged.append(staging.mkdir()))
    assert log.read_text() == "f16 Q8_0\n" and sorted(p.name for p in out.iterdir()) == ["drafter.gguf"]
    convert_staged(GgufJob(root, tmp_path, "f32", with_target=False), out, "eagle3",
                   lambda staging: staging.mkdir())
    assert (out / "drafter.gguf").read_text() == "f32" and log.read_text() == "f16 Q8_0\n"
    (root / "build" / "bin" / "llama-quantize").unlink()
    with pytest.raises(ConfigError, match="export.drafter_gguf_type=q4_k_m: llama-quantize is not built") as err:
        convert_staged(GgufJob(root, tmp_path, "f16", with_target=False, drafter_gguf_type="q4_k_m"), out, "eagle3",
                       lambda staging: pytest.fail("wrote the folder"))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# The files llama.cpp's converter writes from our exports (read back with the gguf package)


def train_on_stories(stories_path: Path, root: Path, runs: dict, steps: int, num_prompts: int = 15) -> dict:
    """drafter-datagen data on stories260K and one run per entry of `runs` (name -> drafter overrides), `steps`
    steps each; returns name -> run folder."""
    from drafter_train.recipes.datagen import run_datagen

    starts = ["Once upon a time", "The little dog", "Lily went to the park", "Tom had a ball", "One day, a cat",
              "The sun was hot", "Mom made a cake", "A bird sat on a tree"]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a} {b}"}) + "\n" for b in ("and", "so", "but", "then")
                               for a in starts))
    run_datagen(OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={stories_path}", "target.chat_template=false", f"datagen.prompts={prompts}",
        f"datagen.num_prompts={num_prompts}", "datagen.num_eval_prompts=3", "datagen.max_new_tokens=24",
        f"datagen.output_dir={root / 'data'}", "datagen.store_topk=8"])), progress=False)
    common = [f"target.path={stories_path}", "target.chat_template=false", f"train.data_dir={root / 'data'}",
              f"train.output_root={root / 'runs'}", f"train.max_steps={steps}", f"train.save_every={steps}",
              "train.batch_size=4", "train.warmup_steps=0", "eval.num_prompts=1", "eval.max_new_tokens=4",
              "eval.warmup=0"]
    for name, extra in runs.items():
        train(OmegaConf.to_object(compose_cfg("train", [*common, *extra, f"train.run_name={name}"])))
    return {name: root / "runs" / name for name in runs}


# drafter overrides of an EAGLE-3 drafter stock llama.cpp runs, on stories260K (5 layers)
STORIES_EAGLE3 = ["drafter=eagle3", "drafter.path=new", "drafter.draft_vocab_size=64", "drafter.target_layers=[0,2,3]",
                  "drafter.fc_norm=false", "drafter.norm_before_fc=true", "loss=fkl"]


@pytest.fixture(scope="module")
def stories_runs(stories_path, tmp_path_factory):
    """A norm_before_fc EAGLE-3 run and a cut 2-layer AR run on stories260K (a few steps: their files matter here,
    not their acceptance)."""
    return train_on_stories(stories_path, tmp_path_factory.mktemp("stories-gguf"),
                            {"eagle3": STORIES_EAGLE3, "ar": ["drafter=ar", "drafter.path=truncated:2"]}, steps=2)


def read_gguf(path: Path):
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    return fields, {t.name: t for t in reader.tensors}, tokens


@needs_converter
def test_eagle3_gguf_is_llamacpps_eagle3_with_our_weights_layers_and_norm(stories_runs, tmp_path):
    run = stories_runs["eagle3"]
    out = tmp_path / "gguf"
    gguf_export(run, out, gguf_type="f32")
    fields, tensors, tokens = read_gguf(out / "drafter.gguf")
    trained = load_file(run / "latest" / "drafter" / "model.safetensors")
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == [1, 3, 4]  # ours + 1: llama.cpp captures the input of its layer i
    assert fields["eagle3.norm_before_fc"] is True and fields["eagle3.norm_before_residual"] is False
    assert fields["eagle3.target_hidden_size"] == 64 and fields["eagle3.block_count"] == 1
    for ours, theirs in {"input_norm.weight": "enc.output_norm.weight", "fc.weight": "fc.weight",
                         "lm_head.weight": "output.weight", "norm.weight": "output_norm.weight",
                         "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
                         "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight"}.items():
        assert torch.equal(torch.from_numpy(tensors[theirs].data.copy()), trained[ours]), ours
    # llama.cpp's d2t holds target ids (ours offsets: target id - draft id); the converter translates
    assert torch.equal(torch.from_numpy(tensors["d2t"].data.copy()), draft_vocab.draft_to_target(trained["d2t"]))
    assert "token_embd.weight" not in tensors  # frozen copies of the target's: llama.cpp shares the target's
    target_fields, target_tensors, target_tokens = read_gguf(out / "target.gguf")
    assert target_fields["general.architecture"] == "llama" and target_fields["llama.block_count"] == 5
    assert tokens == target_tokens and len(tokens) == 512
    strings = [v for v in [*fields.values(), *target_fields.values()] if isinstance(v, str)]
    assert not any(str(tmp_path) in s or "/" in s for s in strings), strings  # no local path in the metadata
    assert "--spec-type draft-eagle3" in (out / "README.md").read_text()


@needs_converter
def test_ar_gguf_is_a_llama_draft_model_on_the_targets_vocabulary(stories_runs, tmp_path):
    out = tmp_path / "gguf"
    gguf_export(stories_runs["ar"], out, gguf_type="f16", gguf_target=False)
    fields, tensors, tokens = read_gguf(out / "drafter.gguf")
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "F16" and not (out / "target.gguf").exists()
    trained = load_file(stories_runs["ar"] / "latest" / "drafter" / "model.safetensors")
    torch.testing.assert_close(torch.from_numpy(tensors["blk.1.ffn_down.weight"].data.copy()).float(),
                               trained["model.layers.1.mlp.down_proj.weight"], rtol=1e-3, atol=1e-3)
    assert len(tokens) == 512 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert "--spec-type draft-simple" in (out / "README.md").read_text()


@needs_converter
@pytest.mark.skipif(not (llamacpp_dir() / "build" / "bin" / "llama-server").is_file(),
                    reason=f"llama.cpp is not built in {llamacpp_dir()} (scripts/setup_llamacpp.sh)")
@pytest.mark.usefixtures("llamacpp_smoke")
def test_a_quantised_ar_drafter_loads_and_drafts_in_llama_server(stories_runs, tmp_path):
    """export.drafter_gguf_type=q4_0: the drafter's 64-wide matrices are Q4_0 (ffn_down's 172-wide rows do not split
    into q4_0's 32-blocks: llama-quantize keeps them F16), and llama-server serves it as the f32 target's draft model:
    it drafts, and greedy output equals plain."""
    from drafter_train.engines.llamacpp_server import LlamaServer

    out = tmp_path / "gguf"
    gguf_export(stories_runs["ar"], out, gguf_type="f32", drafter_gguf_type="q4_0")
    _, tensors, _ = read_gguf(out / "drafter.gguf")
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "Q4_0"
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "F16"
    server = LlamaServer(llamacpp_dir() / "build" / "bin", out / "target.gguf", out / "drafter.gguf", "draft-simple",
                         3, 2, tmp_path / "logs", f32_cache=True)
    prompts = [[1, 403, 261, 379, 374, 306], [1, 349, 450, 284]]  # ids inside stories260K's 512
    plain = server.decode(prompts, 24, speculative=False)
    spec = server.decode(prompts, 24, speculative=True)
    assert sum(d for _, d in spec.steps) > 0 and spec.tokens == plain.tokens
