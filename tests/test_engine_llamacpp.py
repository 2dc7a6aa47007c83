"""GGUF exports served by real llama.cpp (drafter_train/engines/check.py, the engine check, and drafter-eval
eval.engine=llamacpp): for EAGLE-3 (draft-eagle3), an AR drafter (draft-simple), DFlash (draft-dflash) and the product
(llama.cpp's n-gram cache ahead of EAGLE-3), each served drafter is checked against two references: the engine's
speculative output equals its own plain output, and its per-position acceptance equals our evaluator's on the same
prompts (in the product: EAGLE-3's own steps against the good export's). Broken exports of each (a copy of the good drafter.gguf with one thing
changed, written with the gguf package: wrong layer ids, a shuffled d2t, random weights, a dropped norm, shuffled
embeddings, a layer short) are caught.

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
from tests.test_gguf import STORIES_EAGLE3, gguf_export, train_on_stories

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
        # a reduced draft vocabulary (half of stories260K's 512): d2t, which llama.cpp's converter leaves to us
        "dflash-d2t": [*(o for o in STORIES_DFLASH if not o.startswith("drafter.draft_vocab_size=")),
                       "drafter.draft_vocab_size=256", "train.lr=3e-3", "loss=fkl"],
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
    # the settings it ran with stay in the record (benchmarks.engine_check's result file reads them)
    assert result["num_prompts"] == 6 and result["max_new_tokens"] == 32 and result["draft_len"], result
    if fields.get("baseline", True):
        same = result["llamacpp"]["same_output_as_plain"]
        assert same["prompts"] == 6 and same["differences"] == result["llamacpp"]["output_mismatches"]
    return (0 if result["ok"] else 1), result


def served_broken(root: Path, run: Path, good: Path, out: Path, edits: dict, **fields) -> dict:
    """Each edit (name -> rewrite_gguf's fields/tensors/drop) applied to a copy of the good export in `good`, served
    by the same check (no plain baseline): name -> the check's result."""
    results = {}
    ours = good.parent / "llamacpp_check.json"  # the good check's: our evaluator's figures, not decoded again
    for name, edit in edits.items():
        folder = out / name.replace(" ", "-")
        shutil.copytree(good, folder)
        rewrite_gguf(good / DRAFTER_FILE, folder / DRAFTER_FILE, **edit)
        results[name] = check(root, run, out / f"{folder.name}-out", exported=str(folder), baseline=False,
                              ours_from=str(ours) if ours.is_file() else None, **fields)[1]
    return results


def tensors_of(path: Path) -> dict:
    import gguf

    return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}


def shuffled(name: str):
    """A rewrite_gguf edit: the rows of tensor `name` in another order (a vocabulary mapping or embedding out of
    order)."""
    return lambda data: dict(tensors={name: np.random.default_rng(0).permutation(data[name])})


def random_fc(data: dict) -> dict:
    fc = data["fc.weight"]
    return dict(tensors={"fc.weight": np.random.default_rng(0).normal(0, fc.std(), fc.shape).astype(np.float32)})


# per kind: its run in `runs`, and a broken export its engine path must catch
ENGINE_PATH_BREAKS = {"eagle3": shuffled("d2t"), "ar": shuffled("token_embd.weight"), "dflash": random_fc}


def assert_lossless(engine: dict) -> None:
    """The reference every served drafter meets: the engine's greedy speculative output is its own plain output,
    token for token, on every prompt (f32 target and caches on stories260K: no near-tie flipped here)."""
    assert engine["output_equals_plain"], engine["output_mismatches"]


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
    assert_lossless(engine)
    # another target file for the same check: our figures reused (the broken exports below reuse them too)
    again = check(root, found["eagle3"], tmp_path / "again", exported=str(tmp_path / "ok" / "drafter"),
                  baseline=False, ours_from=str(tmp_path / "ok" / "llamacpp_check.json"))[1]
    assert again["ours"] == dict(ours, reused_from=str(tmp_path / "ok" / "llamacpp_check.json"))
    assert again["llamacpp"]["per_position_acceptance"] == engine["per_position_acceptance"]

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
    for name, result in served_broken(root, found["eagle3"], good, tmp_path, broken).items():
        assert not result["ok"] and not result["comparison"]["agree"], (name, result["comparison"])


def test_llamacpp_serves_a_q8_0_eagle3_export_with_our_acceptance(runs, tmp_path):
    """export.drafter_gguf_type=q8_0: EAGLE-3's matrices through llama-quantize (d2t, the norms and rows a 32-block
    cannot split kept as they are), served by llama-server as the f32 target's draft-eagle3: it drafts, its output
    equals plain, and its per-position acceptance stays within the check's tolerance of our float drafter's."""
    import gguf

    root, found = runs
    out = tmp_path / "q8_0"
    gguf_export(found["eagle3"], out, gguf_type="f32", drafter_gguf_type="q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / DRAFTER_FILE).tensors}
    assert types["fc.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q8_0", types
    assert types["blk.0.ffn_down.weight"] == "F16", types  # 172-wide rows do not split into q8_0's 32-blocks
    assert types["d2t"] == "I64" and types["enc.output_norm.weight"] == "F32", types
    status, result = check(root, found["eagle3"], tmp_path / "check", exported=str(out))
    assert result["llamacpp"]["drafting_steps"] > 0 and result["ours"]["per_position_acceptance"][0] > 0.3
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert_lossless(result["llamacpp"])


def test_llamacpp_serves_a_q8_0_dflash_export_with_our_acceptance(runs, tmp_path):
    """export.drafter_gguf_type=q8_0 for DFlash too: its matrices through llama-quantize, served by llama-server as
    the f32 target's draft-dflash: it drafts, its output equals plain, and its per-position acceptance stays within
    the check's tolerance of our float drafter's."""
    import gguf

    root, found = runs
    out = tmp_path / "q8_0"
    gguf_export(found["dflash"], out, gguf_type="f32", drafter_gguf_type="q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / DRAFTER_FILE).tensors}
    assert "Q8_0" in set(types.values()), types
    status, result = check(root, found["dflash"], tmp_path / "check", exported=str(out))
    assert result["llamacpp"]["drafting_steps"] > 0 and result["ours"]["per_position_acceptance"][0] > 0.1
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert_lossless(result["llamacpp"])


def test_llamacpp_serves_an_ar_drafter_with_our_acceptance_and_catches_broken_exports(runs, tmp_path):
    """The AR drafter (the target's first 4 layers) as draft-simple: our acceptance, lossless; a vocabulary out of
    order (shuffled embedding rows) and a layer lost in the export are caught."""
    root, found = runs
    status, result = check(root, found["ar"], tmp_path / "ok", draft_len=3)
    ours, engine = result["ours"], result["llamacpp"]
    assert result["method"] == "draft-simple" and ours["per_position_acceptance"][0] > 0.3 + TOLERANCE, ours
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert_lossless(engine)

    good = tmp_path / "ok" / "drafter"
    data = tensors_of(good / DRAFTER_FILE)
    last = max(int(name.split(".")[1]) for name in data if name.startswith("blk."))
    broken = {
        "shuffled embeddings": shuffled("token_embd.weight")(data),
        "a layer short": dict(fields={"llama.block_count": last}, drop=tuple(n for n in data
                                                                            if n.startswith(f"blk.{last}."))),
    }
    for name, result in served_broken(root, found["ar"], good, tmp_path, broken, draft_len=3).items():
        assert not result["ok"] and not result["comparison"]["agree"], (name, result["comparison"])


def test_llamacpp_serves_a_dflash_export_with_our_acceptance_and_catches_broken_exports(runs, tmp_path):
    """DFlash through the vendored converter (its DFlashDraftModel conversion, learned mask embedding included) as
    llama.cpp's dflash architecture: the same per-position acceptance as ours (measured equal at every position),
    lossless; a random fc is caught (the target layer ids without the engines' +1 were NOT caught:
    llama.cpp's acceptance did not move, measured)."""
    root, found = runs
    status, result = check(root, found["dflash"], tmp_path / "ok")
    ours, engine = result["ours"], result["llamacpp"]
    assert result["method"] == "draft-dflash" and engine["drafting_steps"] > 0
    assert ours["per_position_acceptance"][0] > 0.1, ours  # accepted (0.13 at 120 steps): a wrong export shows
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert_lossless(engine)

    good = tmp_path / "ok" / "drafter"
    broken = {
        "random fc": random_fc(tensors_of(good / DRAFTER_FILE)),
    }
    for name, result in served_broken(root, found["dflash"], good, tmp_path, broken).items():
        assert not result["ok"] and not result["comparison"]["agree"], (name, result["comparison"])


def test_llamacpp_serves_a_reduced_vocabulary_dflash_through_d2t_and_catches_a_shuffled_one(runs, tmp_path):
    """A DFlash drafter on a reduced draft vocabulary: its GGUF carries d2t (absolute target ids, added after the
    converter, which maps none for DFlash), llama.cpp scatters the draft logits through it: our per-position
    acceptance, lossless; the same file with d2t's rows shuffled is caught."""
    import gguf

    root, found = runs
    status, result = check(root, found["dflash-d2t"], tmp_path / "ok")
    ours, engine = result["ours"], result["llamacpp"]
    good = tmp_path / "ok" / "drafter"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(good / DRAFTER_FILE).tensors}
    assert types["d2t"] == "I64" and tensors_of(good / DRAFTER_FILE)["output.weight"].shape[0] == 256, types
    assert result["method"] == "draft-dflash" and engine["drafting_steps"] > 0
    assert ours["per_position_acceptance"][0] > 0.1, ours
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert_lossless(engine)
    broken = {"shuffled d2t": shuffled("d2t")(tensors_of(good / DRAFTER_FILE))}
    for name, result in served_broken(root, found["dflash-d2t"], good, tmp_path, broken).items():
        assert not result["ok"] and not result["comparison"]["agree"], (name, result["comparison"])


def test_llamacpp_runs_the_product_with_the_corpus_as_its_ngram_cache(runs, tmp_path):
    """--lookups ngram-cache --lookup-corpus: llama.cpp's n-gram cache (the corpus through llama-lookup-create) ahead
    of EAGLE-3 in one --spec-type list, our lookups ahead of ours. Lossless; the steps EAGLE-3 drafted inside the
    product (attributed by llama-server's per-step log) are accepted often, and a shuffled d2t halves that."""
    root, found = runs
    product = dict(lookups="ngram-cache", lookup_corpus=str(root / "data"))
    status, result = check(root, found["eagle3"], tmp_path / "product", **product)
    engine = result["llamacpp"]
    assert status == 0 and result["method"] == "ngram-cache,draft-eagle3"
    assert result["comparison"]["agree"] is None and engine["drafting_steps"] > 0
    assert (tmp_path / "product" / "corpus.lookup").stat().st_size > 0
    log = (tmp_path / "product" / "llamacpp_spec.log").read_text(errors="replace")
    assert "called impl ngram-cache" in log and "called impl draft-eagle3" in log
    assert_lossless(engine)
    drafters = engine["per_drafter"]
    assert set(drafters) == {"ngram-cache", "draft-eagle3"}, drafters
    assert sum(d["drafting_steps"] for d in drafters.values()) == engine["drafting_steps"]
    # EAGLE-3's own steps in the product are not the steps of ours alone (the lookups took others; 0.39 at the
    # first position here, outside 0.1 of ours alone), so the reference is the good export's product run: a shuffled d2t must fall below half of it
    eagle3 = drafters["draft-eagle3"]["per_position_acceptance"][0]
    assert eagle3 > 0.2, drafters

    good = tmp_path / "product" / "drafter"
    broken = served_broken(root, found["eagle3"], good, tmp_path, {
        "shuffled d2t": shuffled("d2t")(tensors_of(good / DRAFTER_FILE))}, **product)
    inside = broken["shuffled d2t"]["llamacpp"]["per_drafter"].get("draft-eagle3")
    assert inside is None or inside["per_position_acceptance"][0] < eagle3 / 2, inside


@pytest.mark.parametrize("kind", sorted(ENGINE_PATH_BREAKS))
def test_drafter_eval_in_llamacpp_agrees_with_ours_and_catches_a_broken_export(kind, runs, stories_path, tmp_path,
                                                                                monkeypatch):
    """drafter-eval eval.engine=llamacpp on each kind's run (the engine path: the drafter through its kind's gguf
    writer, the target's export cached by fingerprint, llama-server plain and speculative): llama.cpp's per-position
    acceptance agrees with ours on the same prompts and its speculative output equals its plain output; a broken
    drafter.gguf (ENGINE_PATH_BREAKS), written by the same path, is caught."""
    from drafter_train.engines import export
    from tests.stubs import engine_eval

    root, found = runs
    monkeypatch.setenv("DRAFTER_TRAIN_CACHE", str(tmp_path / "cache"))

    def evaluate(name: str) -> dict:
        return engine_eval("llamacpp", stories_path, found[kind] / "latest" / "drafter", root / "prompts.jsonl",
                           tmp_path / name)

    good = evaluate("ok")
    assert good["drafting_steps"] > 0 and good["ours"]["per_position_acceptance"][0] > 0.1, good
    assert all(abs(d) <= TOLERANCE for d in good["per_position_diff"]), good
    assert good["output_equals_plain"] and good["speedup"] > 0, good
    assert len(list((tmp_path / "cache").rglob("target.gguf"))) == 1

    written = export.export_llamacpp

    def broken_export(*args, **kwargs):
        files = written(*args, **kwargs)
        copy = files.drafter.with_name("good.gguf")
        shutil.move(files.drafter, copy)
        rewrite_gguf(copy, files.drafter, **ENGINE_PATH_BREAKS[kind](tensors_of(copy)))
        return files

    monkeypatch.setattr(export, "export_llamacpp", broken_export)
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


def test_near_tie_replay_reads_the_servers_own_log_probabilities(llamacpp_smoke, tmp_path):
    """On the smoke GGUF (SmolLM2, Q4_K_M): plain's answer decoded again 1 token a step reproduces it, every
    position's own token tops its log-probabilities, and a made-up difference on the runner-up at a position gets a
    margin from the 1-token step and from one pass over the prefix (a real model knows both tokens in both)."""
    from drafter_train.engines import near_ties
    from drafter_train.engines.llamacpp_server import (decode_prompts, free_port, near_tie_logprobs, server_bin,
                                                       server_command)
    from drafter_train.config import TargetConfig
    from drafter_train.targets import load_target_tokenizer

    bin_dir = server_bin(llamacpp_dir(), "test")
    tokenizer = load_target_tokenizer(TargetConfig(path="embedded:smollm2"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a robot."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    def command():
        return server_command(bin_dir, llamacpp_smoke, None, None, 0, 2, free_port(), False)

    reference = decode_prompts(command(), tmp_path / "plain.log", [prompt], 16)["tokens"][0]
    k = 8
    assert len(reference) > k, reference  # a chat answer: more than a few tokens
    [case] = near_tie_logprobs(command(), tmp_path / "ties.log", [{"prompt": prompt, "reference": reference,
                                                                     "position": k, "verify_sizes": [2, 3, 5]}], 10)
    # a verify step's shape: the server evaluated exactly the prefix's last m tokens, the rest from its cache
    assert [v["batch"] for v in case["verify"]] == [2, 3, 5]
    assert all(reference[k] in v["logprobs"] for v in case["verify"])
    assert case["stepwise_tokens"] == reference[:k + 1]
    assert all(max(logprobs, key=logprobs.get) == token for logprobs, token in zip(case["stepwise"], reference))
    runner_up = sorted(case["stepwise"][k], key=case["stepwise"][k].get, reverse=True)[1]
    tie = near_ties.near_tie(dict(case, other=reference[:k] + [runner_up], row=0, round=0, prompt_index=0))
    assert tie["reproduced"] and tie["other_rank"] == 2 and tie["margin_stepwise"] >= 0
    assert tie["margin_batched"] is not None and tie["median_margin_before"] is not None
    assert all(v["margin"] is not None for v in tie["margin_verify"])
