"""drafter-export on a tiny trained run: the folder loads and assists transformers losslessly, the card reports the
run's measured numbers without naming this machine, bad input is one line, and the push path at the HfApi boundary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafter_train.checkpoint import write_manifest
from drafter_train.recipes.datagen import run_datagen
from drafter_train.errors import ConfigError
from drafter_train.recipes import export as export_recipe
from drafter_train.recipes.export import (
    MARKER, ExportConfig, ExportLeakError, HubPushError, check_no_leaks, export, scrub,
)
from drafter_train.recipes.train import train
from tests.conftest import tiny_llama
from tests.stubs import SENTENCES, VOCAB, WORDS, compose_cfg, run_cli, save_tiny

DRAFT_LEN = 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 3-step drafter-train run (checkpoint + evaluation every step) with the .hydra/config.yaml Hydra writes."""
    root = tmp_path_factory.mktemp("export")
    save_tiny(tiny_llama(vocab_size=VOCAB, num_layers=3), root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{s} {w}"}) + "\n" for s in SENTENCES for w in WORDS[:4]))
    run_datagen(OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={root / 'target'}", "target.chat_template=false", f"datagen.prompts={prompts}",
        "datagen.num_prompts=12", "datagen.num_eval_prompts=2", "datagen.max_new_tokens=8",
        f"datagen.output_dir={root / 'data'}",
    ])), progress=False)
    cfg = compose_cfg("train", [
        f"target.path={root / 'target'}", "target.chat_template=false", "drafter.path=truncated:1",
        f"drafter.draft_len={DRAFT_LEN}", f"train.data_dir={root / 'data'}", f"train.output_root={root / 'runs'}",
        "train.run_name=run", "train.max_steps=3", "train.batch_size=4", "train.save_every=1", "train.keep_last=3",
        "train.lr=3e-3", "train.warmup_steps=0", "eval.num_prompts=1", "eval.max_new_tokens=6", "eval.warmup=0",
        "eval.prompts=null",  # datagen's held-out prompts in the tiny vocabulary (dev's would be mostly <unk>)
    ])
    run_dir = root / "runs" / "run"
    # What @hydra.main leaves in the run folder (hydra.run.dir = the run folder): the composed config, unresolved.
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    train(OmegaConf.to_object(cfg))
    return run_dir


def text_files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir() if p.suffix != ".safetensors"}


def copy_run(run_dir: Path, dest: Path, target_path: str) -> Path:
    """A copy of the run whose config names another target.path (the copy keeps its relative symlinks)."""
    shutil.copytree(run_dir, dest, symlinks=True)
    for path in (dest / "config.yaml", dest / ".hydra" / "config.yaml"):  # train() writes the first
        if path.exists():
            config = OmegaConf.load(path)
            config.target.path = target_path
            OmegaConf.save(config, path)
    return dest


# ---- the exported folder -------------------------------------------------------------------------------------------


def test_exported_drafter_assists_transformers_generate_losslessly(tiny_run, tmp_path):
    result = export(ExportConfig(run_dir=str(tiny_run), output_dir=str(tmp_path / "out")))
    out = tmp_path / "out"
    assert result.folder == out and result.checkpoint == (tiny_run / "best").resolve()
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= {
        p.name for p in out.iterdir()}
    drafter = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert drafter.generation_config.num_assistant_tokens == DRAFT_LEN
    assert drafter.generation_config.num_assistant_tokens_schedule == "constant"
    target = AutoModelForCausalLM.from_pretrained(tiny_run.parents[1] / "target").eval()
    drafter_calls = []
    drafter.register_forward_hook(lambda *args: drafter_calls.append(1))  # the drafter really drafts
    for prompt in ("the cat sat on", "a big red house and"):
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            plain = target.generate(**inputs, do_sample=False, max_new_tokens=12)
            assisted = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=12)
        assert assisted.tolist() == plain.tolist()
    assert drafter_calls


def test_card_reports_the_measured_numbers_and_names_no_local_path(tiny_run, tmp_path):
    out = tmp_path / "out"
    export(ExportConfig(run_dir=str(tiny_run), which="latest", output_dir=str(out)))
    card = (out / "README.md").read_text()
    metrics = json.loads((tiny_run / "step-3" / "metrics.json").read_text())
    for key in ("tau", "acceptance_rate", "speedup", "spec_tokens_per_s", "ar_tokens_per_s"):
        assert f"| `{key}` | {metrics[key]:.3f} |" in card
    rows = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    for row in (r for r in rows if "eval/tau" in r):  # the history table: untrained baseline + every checkpoint
        assert f"{row['eval/tau']:.3f} | {row['eval/acceptance_rate']:.3f} | {row['eval/speedup']:.3f}" in card
    assert "| **3** (exported) |" in card and "0 (untrained)" in card
    assert "`target` (a local folder)" in card and "`fkl`" in card and "`truncated:1`" in card
    assert "assistant_model=drafter" in card
    assert f"drafter=path drafter.path=path/to/out eval.draft_len={DRAFT_LEN}" in card
    base, home = str(tiny_run.parents[2]), str(Path.home())  # the pytest tmp root holds every path of the run
    for name, text in text_files(out).items():
        assert base not in text and home not in text and "/tmp" not in text, name


def test_target_as_given_repo_id_in_snippets_and_configs_scrubbed(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path / "run", "org/tiny-target")
    config_file = run / "step-2" / "drafter" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(_name_or_path=str(run), custom={"cache": str(Path.home() / "cache"), "keep": 1})
    config_file.write_text(json.dumps(config))
    write_manifest(run / "step-2")  # a checkpoint written with these values (an edited one is refused as damaged)
    out = tmp_path / "out"
    export(ExportConfig(run_dir=str(run), which="step-2", output_dir=str(out), repo_id="me/tiny-drafter"))
    card = (out / "README.md").read_text()
    assert "# Drafter for `org/tiny-target`" in card and "from checkpoint step 2" in card
    assert 'AutoModelForCausalLM.from_pretrained("org/tiny-target")' in card
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-drafter")' in card
    assert "drafter-eval target.path=org/tiny-target target.chat_template=false drafter=path" in card
    exported = json.loads((out / "config.json").read_text())
    assert "_name_or_path" not in exported and exported["custom"] == {"keep": 1}
    assert exported["vocab_size"] == VOCAB


def test_embedded_target_is_named_by_its_hub_id(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path / "run", "embedded:smollm2")
    export(ExportConfig(checkpoint=str(run / "latest"), output_dir=str(tmp_path / "out")))
    card = (tmp_path / "out" / "README.md").read_text()
    assert 'from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in card
    assert "drafter-eval target.path=embedded:smollm2" in card


def test_scrub_and_leak_check():
    home = str(Path.home())
    value = {"_name_or_path": "/x", "a": {"b": "~/y", "c": 1, "d": f"{home}/z"}, "l": ["/z", "ok"], "is_local": True}
    assert scrub(value) == {"a": {"c": 1}, "l": ["ok"]}
    assert scrub({"added": {"content": "/"}, "path": "/abs"}, recursive=False) == {"added": {"content": "/"}}


def test_a_surviving_local_path_stops_the_export(tmp_path):
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"note": "made in /srv/secret/run"}))
    with pytest.raises(ExportLeakError, match="special_tokens_map.json"):
        check_no_leaks(tmp_path, {"/srv/secret/run", "/"})


# ---- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, words", [
    ("missing_run", "export.run_dir: .*no such folder"),
    ("no_checkpoints", "export.which=best: .*no checkpoints yet"),
    ("no_best", r"export.which=best: .*no best checkpoint yet \(kept: step-1\)"),
    ("no_step", r"export.which=step-99: no such checkpoint .*kept: step-1, step-2, step-3"),
    ("not_a_step", "export.checkpoint: .*not a checkpoint"),
    ("neither", "export.run_dir: set export.run_dir"),
    ("not_empty", "export.output_dir: .*not empty"),
    ("not_writable", "export.output_dir: cannot write"),
    ("not_an_export", "export.output_dir: .*not an earlier drafter-export folder"),
    ("push_without_repo", "export.repo_id: export.push=true needs a repo id"),
    ("bad_which", "export.which: must be best, latest or step-N"),
])
def test_bad_input_is_one_clear_line(tiny_run, tmp_path, case, words):
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "unevaluated_run" / "step-1" / "drafter").mkdir(parents=True)  # saved, never marked best
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    run, out = str(tiny_run), str(tmp_path / "out")
    make = {
        "missing_run": lambda: ExportConfig(run_dir=str(tmp_path / "nope"), output_dir=out),
        "no_checkpoints": lambda: ExportConfig(run_dir=str(tmp_path / "empty_run"), output_dir=out),
        "no_best": lambda: ExportConfig(run_dir=str(tmp_path / "unevaluated_run"), output_dir=out),
        "no_step": lambda: ExportConfig(run_dir=run, which="step-99", output_dir=out),
        "not_a_step": lambda: ExportConfig(checkpoint=run, output_dir=out),
        "neither": lambda: ExportConfig(output_dir=out),
        "not_empty": lambda: ExportConfig(run_dir=run, output_dir=str(tmp_path / "full")),
        "not_writable": lambda: ExportConfig(run_dir=run, output_dir="/proc/forbidden/out"),
        "not_an_export": lambda: ExportConfig(run_dir=run, output_dir=str(tmp_path / "full"), overwrite=True),
        "push_without_repo": lambda: ExportConfig(run_dir=run, output_dir=out, push=True),
        "bad_which": lambda: ExportConfig(run_dir=run, which="newest", output_dir=out),
    }[case]
    with pytest.raises(ConfigError, match=words) as err:
        export(make())
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_an_earlier_export(tiny_run, tmp_path):
    out = tmp_path / "out"
    export(ExportConfig(run_dir=str(tiny_run), which="step-1", output_dir=str(out)))
    export(ExportConfig(run_dir=str(tiny_run), which="step-3", output_dir=str(out), overwrite=True))
    assert MARKER + " from checkpoint step 3" in (out / "README.md").read_text()
    assert not list(tmp_path.glob(".*"))  # no temporary folder left behind


# ---- push ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def hub_calls(monkeypatch):
    """HfApi's network methods replaced by recorders; whoami succeeds unless a test says otherwise."""
    calls = {"whoami": [], "create_repo": [], "upload_folder": []}

    def record(name, result=None):
        def method(self, *args, **kwargs):
            if name == "upload_folder":  # what would be uploaded, as it is at that moment
                kwargs["files"] = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
            calls[name].append((args, kwargs))
            return result
        return method

    monkeypatch.setattr(HfApi, "whoami", record("whoami", {"name": "me"}))
    monkeypatch.setattr(HfApi, "create_repo", record("create_repo", "https://huggingface.co/me/tiny-drafter"))
    monkeypatch.setattr(HfApi, "upload_folder", record("upload_folder"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return calls


def test_push_creates_the_repo_and_uploads_the_folder_once(tiny_run, tmp_path, hub_calls, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SentinelTokenValue")
    out = tmp_path / "out"
    result = export(ExportConfig(run_dir=str(tiny_run), output_dir=str(out), repo_id="me/tiny-drafter", push=True))
    assert result.url == "https://huggingface.co/me/tiny-drafter"
    assert len(hub_calls["whoami"]) == 1 and len(hub_calls["create_repo"]) == 1
    args, kwargs = hub_calls["create_repo"][0]
    assert args == ("me/tiny-drafter",) and kwargs["private"] is True and kwargs["exist_ok"] is True
    [(_, upload)] = hub_calls["upload_folder"]
    assert upload["repo_id"] == "me/tiny-drafter" and Path(upload["folder_path"]) == out
    assert {"README.md", "model.safetensors", "generation_config.json"} <= set(upload["files"])
    assert not any("hf_SentinelTokenValue" in text for text in text_files(out).values())


def test_offline_push_fails_at_once_without_uploading(tiny_run, tmp_path, hub_calls, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_writing(*args):
        raise AssertionError("the export was written before the push was refused")

    monkeypatch.setattr(export_recipe, "write_format", no_writing)  # "at once": before any of the export's work
    with pytest.raises(HubPushError, match="HF_HUB_OFFLINE") as err:
        export(ExportConfig(run_dir=str(tiny_run), output_dir=str(tmp_path / "out"), repo_id="me/x", push=True))
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    assert hub_calls["upload_folder"] == [] and hub_calls["create_repo"] == [] and hub_calls["whoami"] == []


def test_push_without_a_token_is_one_line(tiny_run, tmp_path, hub_calls, monkeypatch):
    monkeypatch.undo()  # the real whoami: with no token anywhere it raises before any request
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(HfApi, "upload_folder", lambda *a, **k: pytest.fail("uploaded without credentials"))
    with pytest.raises(HubPushError, match="no Hub token") as err:
        export(ExportConfig(run_dir=str(tiny_run), output_dir=str(tmp_path / "out"), repo_id="me/x", push=True))
    assert "\n" not in str(err.value)


def test_a_refused_upload_is_one_line_and_keeps_the_folder(tiny_run, tmp_path, hub_calls, monkeypatch):
    def refuse(self, **kwargs):
        raise OSError("403 Forbidden: you cannot write to me/x\nmore details")

    monkeypatch.setattr(HfApi, "upload_folder", refuse)
    with pytest.raises(HubPushError, match="upload to me/x failed .*403 Forbidden") as err:
        export(ExportConfig(run_dir=str(tiny_run), output_dir=str(tmp_path / "out"), repo_id="me/x", push=True))
    assert "\n" not in str(err.value) and (tmp_path / "out" / "README.md").exists()


# ---- command line --------------------------------------------------------------------------------------------------


def test_cli_exports_and_reports_errors_in_one_line(tiny_run, tmp_path):
    ok = run_cli("drafter-export", f"export.run_dir={tiny_run}", f"export.output_dir={tmp_path / 'cli'}",
                 cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "cli" / "README.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli"]  # no Hydra outputs/ or .hydra/ next to it
    bad = run_cli("drafter-export", f"export.run_dir={tmp_path / 'nope'}", f"export.output_dir={tmp_path / 'x'}",
                  cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    errors = [line for line in bad.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"drafter-export: error: export.run_dir: {tmp_path / 'nope'}: no such folder"]


def test_card_names_the_precision_auto_resolved_to(tiny_run, tmp_path):
    """train.mixed_precision=auto is saved as auto (a resume compares equal); the card says what it ran in, which
    drafter-train logs at launch."""
    rows = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["launch/mixed_precision"] for r in rows if "launch/mixed_precision" in r] == ["no"]
    export(ExportConfig(run_dir=str(tiny_run), output_dir=str(tmp_path / "plain")))
    assert "mixed precision no |" in (tmp_path / "plain" / "README.md").read_text()
    run = copy_run(tiny_run, tmp_path / "run", str(tiny_run.parents[1] / "target"))
    config = OmegaConf.load(run / "config.yaml")
    config.train.mixed_precision = "auto"
    OmegaConf.save(config, run / "config.yaml")
    with (run / "metrics.jsonl").open("a") as log:  # a resume on a machine where auto took bf16
        log.write(json.dumps({"step": 2, "launch/num_processes": 1, "launch/mixed_precision": "bf16"}) + "\n")
    export(ExportConfig(run_dir=str(run), output_dir=str(tmp_path / "out")))
    assert "mixed precision auto (bf16 as trained) |" in (tmp_path / "out" / "README.md").read_text()


def test_the_run_info_reads_metrics_jsonl_once(tmp_path, monkeypatch):
    """read_run_info takes the eval history and the launch's precision from one read of metrics.jsonl (it holds
    every step of a long run; it was read and parsed twice); a resumed run's repeated step and launch: the last."""
    from drafter_train import model_card

    step_dir = tmp_path / "run" / "step-4"
    step_dir.mkdir(parents=True)
    (step_dir / "metrics.json").write_text(json.dumps({"draft_len": 3}))
    lines = [{"step": 0, "launch/mixed_precision": "no"}, {"step": 2, "eval/tau": 1.1},
             {"step": 2, "eval/tau": 1.2}, {"step": 2, "launch/mixed_precision": "bf16"}, {"step": 4, "eval/tau": 1.3}]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "ev')
    reads = []
    real_read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (reads.append(self.name), real_read_text(self, *a,
                                                                                                        **k))[1])
    info = model_card.read_run_info(step_dir)
    assert reads.count("metrics.jsonl") == 1
    assert [(row["step"], row["tau"]) for row in info.history] == [(2, 1.2), (4, 1.3)]
    assert info.ran_in == "bf16" and info.step == 4 and info.draft_len == 3
