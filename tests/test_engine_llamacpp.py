"""GGUF exports served by real llama.cpp (drafter_train/engines/check.py, the engine check): llama.cpp's per-position
acceptance agrees with our evaluator's on the same prompts (EAGLE-3 as draft-eagle3, an AR drafter as draft-simple),
and broken exports are caught: wrong layer ids, a shuffled d2t, random weights, a dropped norm (each a copy of the
good drafter.gguf with one thing changed, written with the gguf package).

Opt-in: runs where scripts/setup_llamacpp.sh built llama.cpp ($DRAFTER_TRAIN_LLAMACPP, default .llamacpp in the
repo) and stories260K is present; skips elsewhere. Each check starts llama-server twice (a second each on these
tiny models).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from drafter_train.llamacpp import DRAFTER_FILE, llamacpp_dir
from tests.gguf_edit import rewrite_gguf
from tests.test_gguf import STORIES_EAGLE3, train_on_stories

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("llamacpp_smoke"), pytest.mark.skipif(
    not (llamacpp_dir() / "build" / "bin" / "llama-server").is_file(),
    reason=f"llama.cpp is not built in {llamacpp_dir()} (scripts/setup_llamacpp.sh)")]
TOLERANCE = 0.05
# a DFlash drafter with Qwen3 layers (llama.cpp's dflash architecture) on two of stories260K's five layers
STORIES_DFLASH = ["drafter=dflash", "drafter.path=new", "drafter.draft_vocab_size=0", "drafter.draft_len=4",
                  "drafter.block_size=5", "drafter.fc_norm=false", "drafter.blocks_per_sequence=2",
                  "drafter.target_layers=[1,3]"]


@pytest.fixture(scope="module")
def runs(stories_path, tmp_path_factory):
    """An EAGLE-3 drafter trained long enough to be accepted often, and the target's first 4 of 5 layers as an AR
    drafter (accepted often from the start)."""
    root = tmp_path_factory.mktemp("llamacpp")
    found = train_on_stories(stories_path, root, {
        "eagle3": [*STORIES_EAGLE3, "train.lr=3e-3"],
        "ar": ["drafter=ar", "drafter.path=truncated:4"],
        "dflash": [*STORIES_DFLASH, "train.lr=3e-3", "loss=fkl"],
    }, steps=120, num_prompts=32)
    return root, found


def check(root: Path, run: Path, out: Path, **fields) -> tuple[int, dict]:
    """The engine check of `run`'s latest checkpoint in llama.cpp (fields: more CheckSpec fields): (0 when it passed,
    else 1; the result as written to llamacpp_check.json)."""
    from drafter_train.engines.check import CheckSpec, check_llamacpp

    check_llamacpp((run / "latest").resolve(), CheckSpec(
        prompts=str(root / "prompts.jsonl"), num_prompts=6, max_new_tokens=32, tolerance=TOLERANCE, output=str(out),
        **fields))
    result = json.loads((out / "llamacpp_check.json").read_text())
    return (0 if result["ok"] else 1), result


def test_llamacpp_serves_the_eagle3_export_with_our_acceptance_and_catches_broken_exports(runs, tmp_path):
    import gguf

    root, found = runs
    status, result = check(root, found["eagle3"], tmp_path / "ok")
    ours, engine = result["ours"], result["llamacpp"]
    assert result["method"] == "draft-eagle3" and engine["drafting_steps"] > 0
    # the check means something only if the drafter is accepted often: a broken export then shows
    assert ours["per_position_acceptance"][0] > 0.3 + TOLERANCE, ours
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert engine["plain_tokens_per_s"] > 0 and engine["spec_tokens_per_s"] > 0
    assert isinstance(engine["output_mismatches"], list)  # reported, whatever they are

    good = tmp_path / "ok" / "drafter"
    reader = gguf.GGUFReader(good / DRAFTER_FILE)
    data = {t.name: np.array(t.data) for t in reader.tensors}
    rng = np.random.default_rng(0)
    broken = {
        "layer ids without the +1": dict(fields={"eagle3.target_layers": [0, 2, 3]}),
        "shuffled d2t": dict(tensors={"d2t": rng.permutation(data["d2t"])}),
        "random fc": dict(tensors={"fc.weight": rng.normal(0, data["fc.weight"].std(),
                                                           data["fc.weight"].shape).astype(np.float32)}),
        "dropped norm": dict(fields={"eagle3.norm_before_fc": False}, drop=("enc.output_norm.weight",)),
    }
    for name, edit in broken.items():
        folder = tmp_path / name.replace(" ", "-")
        shutil.copytree(good, folder)
        rewrite_gguf(good / DRAFTER_FILE, folder / DRAFTER_FILE, **edit)
        status, result = check(root, found["eagle3"], tmp_path / f"{folder.name}-out", exported=str(folder),
                               baseline=False)
        assert status == 1 and not result["comparison"]["agree"], (name, result["comparison"])


def test_llamacpp_serves_an_ar_drafter_with_our_acceptance(runs, tmp_path):
    root, found = runs
    status, result = check(root, found["ar"], tmp_path / "ok", draft_len=3)
    ours, engine = result["ours"], result["llamacpp"]
    assert result["method"] == "draft-simple" and ours["per_position_acceptance"][0] > 0.3 + TOLERANCE, ours
    assert status == 0 and result["comparison"]["agree"], result["comparison"]


def test_llamacpp_serves_a_dflash_export_with_our_acceptance(runs, tmp_path):
    """DFlash through the vendored converter (its DFlashDraftModel conversion, learned mask embedding included) as
    llama.cpp's dflash architecture: the same per-position acceptance as ours (measured equal at every position)."""
    root, found = runs
    status, result = check(root, found["dflash"], tmp_path / "ok")
    ours, engine = result["ours"], result["llamacpp"]
    assert result["method"] == "draft-dflash" and engine["drafting_steps"] > 0
    assert ours["per_position_acceptance"][0] > 0.1, ours  # accepted (0.13 at 120 steps): a wrong export shows
    assert status == 0 and result["comparison"]["agree"], result["comparison"]


def test_llamacpp_runs_the_product_with_the_corpus_as_its_ngram_cache(runs, tmp_path):
    """--lookups ngram-cache --lookup-corpus: llama.cpp's n-gram cache (the corpus through llama-lookup-create) ahead
    of EAGLE-3 in one --spec-type list, our lookups ahead of ours; acceptance side by side, output equal to plain."""
    root, found = runs
    status, result = check(root, found["eagle3"], tmp_path / "product", lookups="ngram-cache",
                           lookup_corpus=str(root / "data"))
    assert status == 0 and result["method"] == "ngram-cache,draft-eagle3"
    assert result["comparison"]["agree"] is None and result["llamacpp"]["drafting_steps"] > 0
    assert (tmp_path / "product" / "corpus.lookup").stat().st_size > 0
    log = (tmp_path / "product" / "llamacpp_spec.log").read_text(errors="replace")
    assert "called impl ngram-cache" in log and "called impl draft-eagle3" in log


def test_drafter_eval_in_llamacpp_agrees_with_ours_and_catches_a_broken_export(runs, stories_path, tmp_path,
                                                                                monkeypatch):
    """drafter-eval eval.engine=llamacpp on the EAGLE-3 run (the engine path: the drafter through its kind's gguf
    writer, the target's export cached by fingerprint, llama-server plain and speculative): llama.cpp's per-position
    acceptance agrees with ours on the same prompts; a drafter.gguf with a shuffled d2t, written by the same path,
    is caught."""
    import gguf
    from omegaconf import OmegaConf

    from drafter_train.engines import export
    from drafter_train.recipes.evaluate import run_eval_job
    from tests.stubs import compose_cfg

    root, found = runs
    monkeypatch.setenv("DRAFTER_TRAIN_CACHE", str(tmp_path / "cache"))

    def evaluate(name: str) -> dict:
        return run_eval_job(OmegaConf.to_object(compose_cfg("eval", [
            f"target.path={stories_path}", "target.chat_template=false", "drafter=path",
            f"drafter.path={found['eagle3'] / 'latest' / 'drafter'}", f"eval.prompts={root / 'prompts.jsonl'}",
            "eval.num_prompts=6", "eval.max_new_tokens=32", "eval.draft_len=2", "eval.baseline_kernels=same",
            "eval.engine=llamacpp", f"eval.output={tmp_path / name / 'metrics.json'}"])))["engine"]

    good = evaluate("ok")
    assert good["drafting_steps"] > 0 and good["ours"]["per_position_acceptance"][0] > 0.3 + TOLERANCE, good
    assert all(abs(d) <= TOLERANCE for d in good["per_position_diff"]), good
    assert good["speedup"] > 0 and len(list((tmp_path / "cache").rglob("target.gguf"))) == 1

    written = export.export_llamacpp

    def shuffled_d2t(*args, **kwargs):
        files = written(*args, **kwargs)
        data = {t.name: np.array(t.data) for t in gguf.GGUFReader(files.drafter).tensors}
        copy = files.drafter.with_name("good.gguf")
        shutil.move(files.drafter, copy)
        rewrite_gguf(copy, files.drafter, tensors={"d2t": np.random.default_rng(0).permutation(data["d2t"])})
        return files

    monkeypatch.setattr(export, "export_llamacpp", shuffled_d2t)
    broken = evaluate("broken")
    assert any(abs(d) > TOLERANCE for d in broken["per_position_diff"]), broken
    assert len(list((tmp_path / "cache").rglob("target.gguf"))) == 1  # the target's export was reused


def test_two_checkpoints_ranked_in_llamacpp(stories_path, tmp_path, monkeypatch):
    """train.eval_engine=llamacpp train.best_by=engine on stories260K, two checkpoints: each checkpoint's
    metrics.json holds both decoders' figures, llama.cpp's agreeing with ours, and `best` is the checkpoint the
    engine's predicted served speedup ranks first."""
    from omegaconf import OmegaConf

    from drafter_train.recipes.train import train
    from tests.stubs import compose_cfg

    monkeypatch.setenv("DRAFTER_TRAIN_CACHE", str(tmp_path / "cache"))
    train_on_stories(stories_path, tmp_path, {}, steps=0, num_prompts=32)  # the data only
    train(OmegaConf.to_object(compose_cfg("train", [
        f"target.path={stories_path}", "target.chat_template=false", f"train.data_dir={tmp_path / 'data'}",
        f"train.output_root={tmp_path / 'runs'}", "train.max_steps=80", "train.save_every=40", "train.batch_size=4",
        "train.warmup_steps=0", "train.lr=3e-3", "train.eval_at_start=false", "train.run_name=e3",
        "train.eval_engine=llamacpp", "train.best_by=engine", *STORIES_EAGLE3, "eval.num_prompts=4",
        "eval.max_new_tokens=24", "eval.draft_len=2", "eval.warmup=0", "eval.baseline_kernels=same"])))
    run = tmp_path / "runs" / "e3"
    found = {n: json.loads((run / f"step-{n}" / "metrics.json").read_text()) for n in (40, 80)}
    for metrics in found.values():
        engine = metrics["engine"]
        assert engine["drafting_steps"] > 0 and engine["predicted_speedup"] > 0 and engine["measured_speedup"] > 0
        assert all(abs(d) <= TOLERANCE for d in engine["per_position_diff"]), engine
    best = max(found, key=lambda n: found[n]["engine"]["predicted_speedup"])
    assert (run / "best").resolve().name == f"step-{best}"
    assert len(list((tmp_path / "cache").rglob("target.gguf"))) == 1
