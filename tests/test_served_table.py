"""The served table (benchmarks/engines.py with targets and drafters named by label, drafter_train/engines/table.py):
which llama.cpp decoders a set of targets and drafter GGUFs gives (plain at every precision, the free n-gram modes,
each drafter by its header's architecture, the product), one-line refusals of malformed labels, each request's own
steps and timings split out of llama-server's log (a stand-in server), the per-category figures and their speedups
by hand, the driver end to end on the stand-in, and make_results' rendering of a synthetic served result file.
Nothing here runs llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import make_results
from benchmarks.common import write_result
from drafter_train.engines import near_ties, table
from drafter_train.engines.llamacpp_server import decode_prompts, free_port, server_command
from drafter_train.errors import ConfigError
from tests.gguf_edit import save_gguf

FAKE = Path(__file__).resolve().parent / "fake_llamacpp" / "build" / "bin"


def drafter_gguf(path: Path, architecture: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    save_gguf(writer)
    return path


def test_served_decoders_for_targets_and_labelled_drafters(tmp_path):
    """Plain at every target; the n-gram modes at the first target; each drafter with its precision's target and its
    header's --spec-type; the product after its drafter, with the static cache."""
    targets = {"q4_k_m": tmp_path / "q4.gguf", "q4_k_m-llama": tmp_path / "llama.gguf", "q8_0": tmp_path / "q8.gguf"}
    eagle = drafter_gguf(tmp_path / "eagle.gguf", "eagle3")
    small = drafter_gguf(tmp_path / "small.gguf", "qwen2")
    drafters = []
    for label, path, precision in [table.parse_labelled(f"0.5B={small}", "--draft-gguf"),
                                   table.parse_labelled(f"e3={eagle}@q4_k_m-llama", "--draft-gguf")]:
        spec_type, decoder = table.drafter_spec_type(path, "--draft-gguf")
        drafters.append({"label": label, "file": path, "precision": precision, "spec_type": spec_type,
                         "decoder": decoder})
    cache = tmp_path / "corpus.lookup"
    decoders = table.served_decoders(targets, drafters, ["ngram-simple", "ngram-map-k"], 3, products=["e3"],
                                     lookup_cache=cache)
    got = [(d["precision"], d["decoder"], d["spec_type"], d.get("label")) for d in decoders]
    assert got == [("q4_k_m", "plain", None, None), ("q4_k_m-llama", "plain", None, None),
                   ("q8_0", "plain", None, None), ("q4_k_m", "free n-gram", "ngram-simple", None),
                   ("q4_k_m", "free n-gram", "ngram-map-k", None), ("q4_k_m", "AR drafter", "draft-simple", "0.5B"),
                   ("q4_k_m-llama", "EAGLE-3", "draft-eagle3", "e3"),
                   ("q4_k_m-llama", "product", "ngram-cache,draft-eagle3", "e3")]
    product = decoders[-1]
    assert product["target"] == targets["q4_k_m-llama"] and product["drafter"] == eagle
    assert product["lookup_cache"] == cache and product["draft_len"] == 3
    assert table._row(product)["setting"] == ("--spec-type ngram-cache,draft-eagle3 --spec-draft-n-max 3 "
                                              "--lookup-cache-static corpus.lookup")
    assert table.drafter_spec_type(drafter_gguf(tmp_path / "df.gguf", "dflash"), "x") == ("draft-dflash", "DFlash")
    # the n-gram modes at the precisions asked
    again = table.served_decoders(targets, [], ["ngram-mod"], 2, spec_precisions=["q8_0", "q4_k_m"])
    assert [(d["precision"], d["spec_type"]) for d in again if d["spec_type"]] == [("q8_0", "ngram-mod"),
                                                                                  ("q4_k_m", "ngram-mod")]
    # the product without a drafter: its n-gram modes and the corpus cache, at the first n-gram precision
    lookups = table.served_decoders(targets, [], [], 2, spec_precisions=["q4_k_m-llama"], products=["lookups"],
                                    product_ngram="ngram-simple,ngram-cache", lookup_cache=cache)[-1]
    assert (lookups["precision"], lookups["decoder"], lookups["label"], lookups.get("drafter")) == (
        "q4_k_m-llama", "product", "lookups", None)
    assert table._row(lookups)["setting"] == "--spec-type ngram-simple,ngram-cache --lookup-cache-static corpus.lookup"
    assert table.cost_key(lookups) == "ngram"  # its steps cost what an n-gram mode's do
    # a product whose modes leave out ngram-cache gets no static cache: only ngram-cache reads it
    simple = table.served_decoders(targets, drafters, [], 1, products=["e3"], product_ngram="ngram-simple",
                                   lookup_cache=cache)[-1]
    assert simple["decoder"] == "product" and simple.get("lookup_cache") is None
    assert table._row(simple)["setting"] == "--spec-type ngram-simple,draft-eagle3 --spec-draft-n-max 1"
    # a target label served with --no-repack: every row at that precision, and its setting says so
    nr = table.served_decoders(targets, drafters, ["ngram-simple"], 2, spec_precisions=["q4_k_m-llama"],
                               no_repack=["q4_k_m-llama"])
    assert [d.get("repack", True) for d in nr] == [True, False, True, False, True, False]
    assert table._row(nr[3])["setting"] == "--spec-type ngram-simple --no-repack"
    with pytest.raises(ConfigError, match="--no-repack: q5: no target of that label"):
        table.served_decoders(targets, [], [], 2, no_repack=["q5"])


def test_bad_labels_are_one_line(tmp_path):
    real = drafter_gguf(tmp_path / "d.gguf", "llama")
    for value, words in [("nolabel", "expected LABEL=PATH"), (f"a:b={real}", "expected LABEL=PATH"),
                         ("x=/no/such.gguf", "x: no such file")]:
        with pytest.raises(ConfigError, match=words) as err:
            table.parse_labelled(value, "--draft-gguf")
        assert "\n" not in str(err.value)
    drafter = {"label": "d", "file": real, "precision": "f16", "spec_type": "draft-simple", "decoder": "AR drafter"}
    with pytest.raises(ConfigError, match="--draft-gguf: d: no target at its precision"):
        table.served_decoders({"q4": real}, [drafter], [], 2)
    with pytest.raises(ConfigError, match="--product: e3: no --draft-gguf of that label"):
        table.served_decoders({"q4": real}, [], [], 2, products=["e3"])
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(ConfigError, match="--draft-gguf: .*text.gguf: not a GGUF file"):
        table.drafter_spec_type(tmp_path / "text.gguf", "--draft-gguf")


def test_each_request_keeps_its_own_steps_and_timings(tmp_path):
    """The stand-in server logs sum(prompt) % 3 + 1 verify steps per request: decode_prompts splits the log by
    request, and the totals stay what they were."""
    prompts = [[1, 1], [1, 2], [3, 3], [2, 2]]  # 0, 1, 0 and 2 extra steps
    command = server_command(FAKE, tmp_path / "t.gguf", None, "ngram-simple", 2, 1, free_port(), False)
    served = decode_prompts(command, tmp_path / "server.log", prompts, 8)
    per = served["per_prompt"]
    assert [len(p["steps"]) for p in per] == [sum(p) % 3 + 1 for p in prompts]
    assert all(p["steps"][0] == (1, 1) and all(s == (0, 1) for s in p["steps"][1:]) for p in per)
    assert [p["tokens"] for p in per] == [len(t) for t in served["tokens"]]
    assert served["steps"] == [s for p in per for s in p["steps"]]
    assert sum(p["gen_ms"] for p in per) == pytest.approx(served["gen_ms"])


def _prompt(tokens, ms, steps):
    return {"tokens": tokens, "gen_ms": ms, "steps": steps}


def test_group_figures_and_speedups_by_hand():
    """Two code prompts and one chat prompt, two rounds. Round 2, code: 20 tokens in 1000 ms; tau: 18 tokens made
    after the prompt passes, 2 drafting steps accepting 3 + 1 drafts (6 tokens), 12 plain passes: 18 / 14."""
    categories = ["coding", "chat", "code-completion"]
    spec_rounds = [[_prompt(10, 400.0, [(3, 4)]), _prompt(10, 1000.0, []), _prompt(10, 400.0, [(1, 4)])],
                   [_prompt(10, 500.0, [(3, 4)]), _prompt(10, 1000.0, []), _prompt(10, 500.0, [(1, 4)])]]
    got = table.group_figures(spec_rounds, categories, table.CODE_CATEGORIES)
    assert set(got) == {"coding", "chat", "code-completion", "code", "rest"}
    assert got["code"]["tokens_per_s_rounds"] == pytest.approx([25.0, 20.0])
    assert got["code"]["tokens_per_s"] == pytest.approx(22.5) and got["code"]["prompts"] == 2
    assert got["code"]["tau"] == pytest.approx(18 / 14) and got["rest"]["tau"] == pytest.approx(1.0)
    plain_rounds = [[_prompt(10, 1000.0, [])] * 3] * 2

    def record(rounds, row, tps):
        return [{"tokens_per_s": tps, "row": row, "per_prompt": r} for r in rounds]

    plain = {"engine": "llama.cpp", "precision": "q4", "decoder": "plain", "setting": "plain"}
    spec = dict(plain, decoder="free n-gram", setting="--spec-type ngram-simple")
    rounds = [{"plain": p, "spec": s} for p, s in zip(record(plain_rounds, plain, 10.0),
                                                       record(spec_rounds, spec, 16.0))]
    rows = table.summarize(rounds, [], categories)
    spec_row = next(r for r in rows if r["decoder"] != "plain")
    assert spec_row["by_group"]["code"]["speedup_over_fastest"] == pytest.approx(22.5 / 10)
    assert spec_row["by_group"]["rest"]["speedup_over_own_plain"] == pytest.approx(1.0)
    assert "per_prompt" not in spec_row  # per-prompt records stay out of the result file
    assert "by_group" not in table.summarize(rounds, [])[0]  # no categories: no groups


SERVED_ROWS = [
    {"engine": "llama.cpp", "precision": "q4_k_m", "decoder": "plain", "setting": "plain", "tokens_per_s": 12.0,
     "speedup_over_fastest": 1.0, "speedup_over_own_plain": 1.0, "predicted_speedup": None,
     "by_group": {"code": {"tokens_per_s": 12.0, "speedup_over_fastest": 1.0},
                  "rest": {"tokens_per_s": 11.5, "speedup_over_fastest": 1.0},
                  "coding": {"tokens_per_s": 12.0, "speedup_over_fastest": 1.0},
                  "chat": {"tokens_per_s": 11.5, "speedup_over_fastest": 1.0}}},
    {"engine": "llama.cpp", "precision": "q8_0", "decoder": "plain", "setting": "plain", "tokens_per_s": 7.0,
     "speedup_over_fastest": 7 / 12, "speedup_over_own_plain": 1.0, "predicted_speedup": None},
    {"engine": "llama.cpp", "precision": "q4_k_m", "decoder": "AR drafter", "label": "0.5B",
     "setting": "--spec-type draft-simple --spec-draft-n-max 3", "tokens_per_s": 10.8, "speedup_over_fastest": 0.9,
     "speedup_over_own_plain": 0.9, "predicted_speedup": 0.95, "tau": 2.4,
     "acceptance_per_position": [0.9, 0.8, 0.7], "ours_acceptance_per_position": [0.88, 0.8, 0.71],
     "same_output_as_plain": {"prompts": 4, "identical": 3, "differences": [{"round": 0, "prompt": 1, "position": 7}],
                              "near_ties": [{"prompt": 1, "position": 7, "near_tie": True}], "near_ties_shown": 1},
     "by_group": {"code": {"tokens_per_s": 12.6, "speedup_over_fastest": 1.05},
                  "rest": {"tokens_per_s": 8.6, "speedup_over_fastest": 0.75},
                  "coding": {"tokens_per_s": 12.6, "speedup_over_fastest": 1.05},
                  "chat": {"tokens_per_s": 8.6, "speedup_over_fastest": 0.75}}},
]


def test_make_results_renders_a_served_table_from_its_result_file(tmp_path):
    results = tmp_path / "results"
    write_result("served_qwen1.5b", title="Qwen2.5-Coder-1.5B-Instruct served by llama.cpp", question="Which pays?",
                 command="python -m benchmarks.engines ...", split="test split, first 4 of each category, 8 prompts",
                 baseline="the fastest plain row", columns=["engine"], rows=[["unused"]], machine={"cpu": "Test CPU"},
                 results_dir=results,
                 data={"engine_rows": SERVED_ROWS, "cost_curves": [], "served": True, "rounds": 3,
                       "max_new_tokens": 96, "code_categories": ["coding", "code-completion"]})
    docs = tmp_path / "results.md"
    assert make_results.main(["--results-dir", str(results), "--docs", str(docs),
                              "--readme", str(tmp_path / "none.md")]) == 0
    page = docs.read_text()
    assert "## Qwen2.5-Coder-1.5B-Instruct served by llama.cpp" in page
    assert "**q4_k_m plain, 12.0 tokens/s** (medians of 3 interleaved rounds, 96 new tokens" in page
    assert ("| q4_k_m | AR drafter (0.5B) | --spec-type draft-simple --spec-draft-n-max 3 | 10.8 (0.90x) | "
            "12.6 (1.05x) | 8.600 (0.75x) | 2.400 | 0.90 / 0.80 / 0.70 | 0.88 / 0.80 / 0.71 | 0.950 | 0.900 |") in page
    assert "| q8_0 | plain | plain | 7.000 (0.58x) | – | – |" in page  # no categories kept: dashes
    assert "| q4_k_m | AR drafter (0.5B) | 1.050 | 0.750 |" in page  # the per-category table
    assert "| unused |" not in page and "- split: test split, first 4 of each category" in page


def test_the_readme_block_shows_the_main_job_then_the_served_speedup_per_kind_of_cpu(tmp_path):
    """One short table per question: the main job's, then per CPU kind the fastest plain decoder, the best free mode,
    the best drafter trained here (not the stock 0.5B) and the product; first differences stay in results.md."""
    results, readme = tmp_path / "results", tmp_path / "README.md"
    rows = [*SERVED_ROWS,
            {"engine": "llama.cpp", "precision": "q4_k_m", "decoder": "free n-gram", "setting": "--spec-type ngram-simple",
             "tokens_per_s": 11.5, "speedup_over_fastest": 0.958, "by_group": {}},
            {"engine": "llama.cpp", "precision": "q4_k_m", "decoder": "EAGLE-3", "label": "eagle3",
             "setting": "--spec-type draft-eagle3", "tokens_per_s": 9.0, "speedup_over_fastest": 0.75,
             "by_group": {"code": {"tokens_per_s": 9.6, "speedup_over_fastest": 0.8},
                          "rest": {"tokens_per_s": 8.4, "speedup_over_fastest": 0.7}}},
            {"engine": "llama.cpp", "precision": "q4_k_m", "decoder": "product", "label": "eagle3",
             "setting": "--spec-type ngram-simple,draft-eagle3", "tokens_per_s": 9.6, "speedup_over_fastest": 0.8,
             "by_group": {}}]
    write_result("served_qwen1.5b-test-cpu-avx2", title="Qwen served by llama.cpp", question="Which pays?",
                 command="x", split="test split, 2 prompts", baseline="the fastest plain row", columns=["engine"],
                 rows=[["unused"]], machine={"cpu": "Test CPU", "cpu_features": ["avx2"]}, results_dir=results,
                 data={"engine_rows": rows, "cost_curves": [], "served": True})
    # a second kind of CPU's table shows too; a served result of another name (the free rows) does not
    write_result("served_qwen1.5b-test-cpu-avx512", title="Qwen served by llama.cpp", question="Which pays?",
                 command="x", split="test split, 4 prompts", baseline="the fastest plain row", columns=["engine"],
                 rows=[["unused"]], machine={"cpu": "Test CPU", "cpu_features": ["avx2", "avx512f"]},
                 results_dir=results, data={"engine_rows": SERVED_ROWS[:1], "cost_curves": [], "served": True})
    write_result("served_qwen1.5b_free", title="Free rows", question="Which pays?", command="z",
                 split="test split, 1 prompt", baseline="the fastest plain row", columns=["engine"],
                 rows=[["unused"]], machine={"cpu": "Test CPU"}, results_dir=results,
                 data={"engine_rows": SERVED_ROWS, "cost_curves": [], "served": True})
    write_result("main_job", title="The main job", question="?", command="y", split="test split, first 16 prompts",
                 baseline="plain", columns=["decoder", "speedup"], rows=[["product", 1.25]], machine={"cpu": "Test CPU"},
                 results_dir=results)
    readme.write_text("# P\n<!-- results:start -->\nold\n<!-- results:end -->\n")
    make_results.main(["--results-dir", str(results), "--docs", str(tmp_path / "r.md"), "--readme", str(readme)])
    text = readme.read_text()
    assert "**The served speedup on Test CPU, avx2** (test split, 2 prompts):" in text  # the CPU's kind
    assert "|  | decoder | tok/s | x baseline | code | rest |" in text
    assert "| fastest plain decoder | plain, q4_k_m | 12.0 | 1.000 |" in text
    assert "| best free mode | free n-gram (ngram-simple), q4_k_m | 11.5 | 0.958 | – | – |" in text
    assert "| best trained drafter | EAGLE-3 (eagle3), q4_k_m | 9.000 | 0.750 | 0.800 | 0.700 |" in text
    assert "| the product | product (eagle3), q4_k_m | 9.600 | 0.800 |" in text
    assert "0.5B" not in text and "first differs" not in text and "near-tie" not in text
    assert "**The served speedup on Test CPU, avx2, avx512f** (test split, 4 prompts):" in text
    assert "Free rows" not in text
    assert text.index("| product | 1.250 |") < text.index("on Test CPU, avx2**") < text.index("avx2, avx512f**")


def test_the_driver_runs_a_served_table_on_the_stand_in(tmp_path, monkeypatch):
    """benchmarks.engines with --target-gguf, --draft-gguf and --per-category on the stand-in server (llama-bench and
    the step calibration replaced): every row, each with its category groups, in the result file it names."""
    from benchmarks import engines as driver
    from drafter_train.engines import llamacpp_cost

    llcpp = tmp_path / "llcpp"
    (llcpp / "build" / "bin").mkdir(parents=True)
    (llcpp / "build" / "bin" / "llama-server").symlink_to(FAKE / "llama-server")
    (llcpp / "build" / "bin" / "llama-bench").write_text("")  # replaced below: bench_curve
    target = drafter_gguf(tmp_path / "target.gguf", "llama")
    small = drafter_gguf(tmp_path / "small.gguf", "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"write {w} now", "category": c}) + "\n"
                               for w, c in [("a", "coding"), ("b", "chat"), ("c", "coding"), ("d", "chat"),
                                            ("e", "coding")]))
    benched, calibrated, repacked = [], [], []
    monkeypatch.setattr(driver, "bench_curve", lambda *a: benched.append(a[1]) or repacked.append(a[-1])
                        or {1: 10.0, 2: 12.0})
    monkeypatch.setattr(llamacpp_cost, "server_curves", lambda *a: calibrated.append(a[-2]) or repacked.append(a[-1])
                        or {"ms_1": 10.0, "kinds": {key: {"ms": {1: 10.0, 3: 15.0}, "relative": {1: 1.0, 3: 1.5}}
                                                    for key in a[-2]}})
    monkeypatch.setattr(driver.llamacpp_cost, "prompt_set", _word_prompts(llamacpp_cost.prompt_set))
    monkeypatch.setattr(driver.llamacpp_cost, "calibration_prompts", lambda *a, **k: [[5, 6, 7]])
    results = tmp_path / "results"
    (tmp_path / "metrics.json").write_text(json.dumps({"per_position_acceptance": [0.5, 0.25]}))
    code = driver.main(["--ours-acceptance", f"small={tmp_path / 'metrics.json'}", "--draft-len-of", "small=3","--engines", "llama.cpp", "--llamacpp", str(llcpp), "--target", str(tmp_path),
                        "--target-gguf", f"q4={target}", "--draft-gguf", f"small={small}", "--product", "small",
                        "--ngram-modes", "ngram-simple", "--prompts", str(prompts), "--per-category", "2",
                        "--rounds", "2", "--max-new-tokens", "4", "--output", str(tmp_path / "out"),
                        "--result", "--result-name", "served_test", "--results-dir", str(results),
                        "--calibration-rounds", "1",
                        "--ngram-drafts", "4,16", "--target-gguf", f"plainonly={target}",
                        "--no-repack", "plainonly"])
    assert code == 0
    # llama-bench and the step calibration as each target is served: plainonly with --no-repack
    assert repacked == [True, True, False]  # q4: llama-bench, then its step calibration; plainonly: llama-bench
    # calibrated in the first round only; the plain-only precision gets llama-bench's curve, no step calibration
    assert benched == [target, target] and calibrated == [{"ngram": (4, 16), "ar:small": (3, 8)}]
    result = json.loads((results / "served_test.json").read_text())
    rows = result["data"]["engine_rows"]
    assert [(r["decoder"], r.get("label")) for r in rows] == [("plain", None), ("plain", None), ("free n-gram", None),
                                                              ("AR drafter", "small"), ("product", "small")]
    assert result["data"]["served"] and result["data"]["prompt_categories"] == ["coding", "chat", "coding", "chat"]
    assert all(r["by_group"]["code"]["prompts"] == 2 and r["by_group"]["rest"]["prompts"] == 2 for r in rows)
    spec = rows[3]
    assert spec["ours_acceptance_per_position"] == rows[4]["ours_acceptance_per_position"] == [0.5, 0.25]
    assert "ours_acceptance_per_position" not in rows[2] and "--spec-draft-n-max 3" in spec["setting"]
    assert spec["cost_key"] == "ar:small" and spec["predicted_speedup"] is not None
    assert spec["acceptance_per_position"] and 0 <= spec["acceptance_per_position"][0] <= 1
    assert "first 2 of each category" in result["split"]
    # the run's own record keeps every decoder's tokens per round beside the prompts' ids; the result file does not
    record = json.loads((tmp_path / "out" / "served_test.json").read_text())
    assert len(record["prompt_ids"]) == 4 and len(record["outputs"]) == len(rows)
    assert all(len(per_round) == 2 and len(per_round[0]) == 4 for per_round in record["outputs"].values())
    assert "outputs" not in json.dumps(result)
    with pytest.raises(SystemExit, match="--draft-len-of: other: no --draft-gguf of that label"):
        driver.main(["--engines", "llama.cpp", "--llamacpp", str(llcpp), "--target-gguf", f"q4={target}",
                     "--draft-len-of", "other=2"])


def test_our_decoders_join_the_served_table_on_its_prompts_with_their_categories(tiny_data, tmp_path, monkeypatch):
    """--engines llama.cpp,ours with --per-category: our decoder runs the served table's prompts (the same ids as
    llama.cpp's), only the decoders --ours-decoders names (plain always), no HF row with --no-hf; its rows get the
    per-category figures and are compared token by token with our plain decoding (lossless: identical)."""
    from benchmarks import engines as driver
    from drafter_train.engines import llamacpp_cost
    from tests.conftest import tiny_llama
    from tests.stubs import VOCAB
    from tests.test_eagle3 import random_eagle3

    llcpp = tmp_path / "llcpp"
    (llcpp / "build" / "bin").mkdir(parents=True)
    (llcpp / "build" / "bin" / "llama-server").symlink_to(FAKE / "llama-server")
    (llcpp / "build" / "bin" / "llama-bench").write_text("")
    random_eagle3(tiny_llama(vocab_size=VOCAB, num_layers=3), layers=(0, 1, 2)).save_pretrained(tmp_path / "e3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in [
        ("the cat sat on the", "coding"), ("a big dog ran", "chat"), ("the red sun and the", "coding"),
        ("happy day", "chat"), ("small blue house", "coding")]))
    monkeypatch.setattr(driver, "bench_curve", lambda *a: {1: 10.0, 2: 12.0})
    monkeypatch.setattr(llamacpp_cost, "server_curves", lambda *a: {"ms_1": 10.0, "kinds": {}})
    monkeypatch.setattr(driver.llamacpp_cost, "calibration_prompts", lambda *a, **k: [[5, 6, 7]])
    results = tmp_path / "results"
    common = ["--engines", "llama.cpp,ours", "--llamacpp", str(llcpp), "--target", str(tiny_data / "target"),
              "--target-gguf", f"q4={drafter_gguf(tmp_path / 'target.gguf', 'llama')}", "--drafter",
              str(tmp_path / "e3"), "--corpus", str(tiny_data / "data"), "--no-hf", "--no-vllm", "--prompts",
              str(prompts), "--per-category", "2", "--rounds", "1", "--max-new-tokens", "8", "--sizes", "1,2",
              "--depth", "8", "--calibration-rounds", "1", "--output", str(tmp_path / "out")]
    assert driver.main([*common, "--ours-decoders", "EAGLE-3", "--result", "--result-name", "served_ours",
                        "--results-dir", str(results)]) == 0
    result = json.loads((results / "served_ours.json").read_text())
    rows = {(r["engine"], r["decoder"]): r for r in result["data"]["engine_rows"]}
    assert set(rows) == {("llama.cpp", "plain"), ("llama.cpp", "free n-gram"), ("ours", "plain"), ("ours", "EAGLE-3")}
    assert result["data"]["prompt_categories"] == ["coding", "chat", "coding", "chat"]
    record = json.loads((tmp_path / "out" / "served_ours.json").read_text())
    assert len(record["outputs"]["ours EAGLE-3"][0]) == len(record["prompt_ids"]) == 4  # the served prompts
    ours = rows[("ours", "EAGLE-3")]
    assert ours["same_output_as_plain"] == {"prompts": 4, "identical": 4, "differences": []}
    assert ours["by_group"]["code"]["prompts"] == ours["by_group"]["rest"]["prompts"] == 2
    assert sum(g["tokens"] for name, g in ours["by_group"].items() if name in ("code", "rest")) == ours["tokens"]
    assert ours["tau"] >= 1 and ours["by_group"]["code"]["speedup_over_fastest"] > 0
    monkeypatch.setattr(driver.llamacpp_cost, "prompt_set", lambda *a: pytest.fail("refused before any loading"))
    with pytest.raises(SystemExit, match=r"^engines: --ours-decoders: no EAGLE3 \(there are plain, free n-gram, "):
        driver.main([*common, "--ours-decoders", "EAGLE3"])


def test_vllm_rows_join_the_served_table_without_our_decoder(tiny_data, tmp_path, monkeypatch):
    """--engines llama.cpp,vllm: vLLM's rows get the served table's prompts and the target's EOS ids read from its
    configs (no torch model is loaded here: our decoder never starts); their rows sit beside llama.cpp's. vLLM itself
    is a stand-in (its real engine: tests/test_vllm_backend.py, opt-in)."""
    from benchmarks import engines as driver
    from drafter_train.engines import llamacpp_cost, vllm_cpu
    from drafter_train.engines import ours as ours_module

    llcpp = tmp_path / "llcpp"
    (llcpp / "build" / "bin").mkdir(parents=True)
    (llcpp / "build" / "bin" / "llama-server").symlink_to(FAKE / "llama-server")
    (llcpp / "build" / "bin" / "llama-bench").write_text("")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in [
        ("the cat sat on the", "coding"), ("a big dog ran", "chat"), ("the red sun", "coding")]))
    started = {}

    class Rows:
        info = {"startup_s": {}}

        def __init__(self, args, prompt_ids, eos):
            started.update(prompts=prompt_ids, eos=list(eos), only=args.vllm_decoders)

        def run_round(self, label):
            reply = {"tokens": [[5, 6]] * len(started["prompts"]), "seconds": [0.1] * len(started["prompts"]),
                     "draft_s": None, "steps": []}
            return {f"{vllm_cpu.ENGINE} plain": vllm_cpu.vllm_record(vllm_cpu.vllm_decoders(2)[0], reply)}

        def curve(self, sizes, depth, repeats):
            return {n: 10.0 * n for n in sizes}

        def close(self):
            started["closed"] = True

    monkeypatch.setattr(driver, "start_vllm_rows", Rows)
    monkeypatch.setattr(ours_module, "Ours", lambda *a, **k: pytest.fail("our decoder must not start"))
    monkeypatch.setattr(driver, "bench_curve", lambda *a: {1: 10.0, 2: 12.0})
    monkeypatch.setattr(llamacpp_cost, "server_curves", lambda *a: {"ms_1": 10.0, "kinds": {}})
    monkeypatch.setattr(driver.llamacpp_cost, "calibration_prompts", lambda *a, **k: [[5, 6, 7]])
    python = tmp_path / "python"
    python.write_text("")
    assert driver.main(["--engines", "llama.cpp,vllm", "--vllm-python", str(python), "--vllm-decoders", "plain",
                        "--llamacpp", str(llcpp), "--target", str(tiny_data / "target"), "--target-gguf",
                        f"q4={drafter_gguf(tmp_path / 'target.gguf', 'llama')}", "--ngram-modes", "ngram-simple",
                        "--prompts", str(prompts), "--per-category", "1", "--rounds", "1", "--max-new-tokens", "4",
                        "--sizes", "1,2", "--depth", "8", "--output", str(tmp_path / "out")]) == 0
    from drafter_train.config import TargetConfig
    from drafter_train.targets import eos_token_ids, load_target

    # the same EOS ids as the loaded target gives our decoder
    assert started["eos"] == eos_token_ids(*load_target(TargetConfig(path=str(tiny_data / "target"))))
    assert len(started["prompts"]) == 2 and started["closed"]
    record = json.loads((tmp_path / "out" / "engines.json").read_text())
    assert {(r["engine"], r["decoder"]) for r in record["rows"]} == {
        ("llama.cpp", "plain"), ("llama.cpp", "free n-gram"), ("vLLM-cpu", "plain")}
    assert record["prompt_ids"] == started["prompts"]
    with pytest.raises(SystemExit, match="--engines vllm: no vLLM interpreter at /no/python"):
        driver.main(["--engines", "llama.cpp,vllm", "--vllm-python", "/no/python", "--llamacpp", str(llcpp),
                     "--target-gguf", f"q4={tmp_path / 'target.gguf'}", "--target", str(tiny_data / "target"),
                     "--prompts", str(prompts), "--per-category", "1"])


def _word_prompts(real):
    """prompt_set with a stand-in tokenizer: each prompt's characters' codes (no model folder needed)."""
    def prompt_set(target, prompts, num_prompts, categories=None, per_category=None):
        from drafter_train.data.prompts import load_prompt_records

        records = load_prompt_records(prompts, 10 ** 9)
        taken: dict = {}
        keep = [(t, c) for t, c in records if taken.setdefault(c, []).append(t) or len(taken[c]) <= per_category]
        return [[ord(ch) % 50 + 3 for ch in t] for t, _ in keep], [c for _, c in keep]
    return prompt_set


# ---------------------------------------------------------------------------------------------------------------
# Opt-in: every row type once, in real llama.cpp, on stories260K (where llama.cpp is built and stories260K present)

from drafter_train.llamacpp import llamacpp_dir  # noqa: E402
from tests.test_gguf import gguf_export, stories_runs  # noqa: E402,F401 (stories_runs: the fixture)

needs_server = pytest.mark.skipif(not (llamacpp_dir() / "build" / "bin" / "llama-server").is_file(),
                                  reason=f"llama.cpp is not built in {llamacpp_dir()} (scripts/setup_llamacpp.sh)")


@pytest.mark.slow
@needs_server
@pytest.mark.usefixtures("llamacpp_smoke")
def test_every_served_row_type_runs_in_llamacpp(stories_runs, stories_path, tmp_path, monkeypatch):  # noqa: F811
    """One prompt per category, one round: plain at a given GGUF (f32) and an exported type (q8_0); all of
    llama-server's n-gram modes; a trained EAGLE-3 export, the product (ngram-cache with the corpus's static cache
    ahead of it), a DFlash export (draft-dflash, its step calibrated too), a q8_0-quantised AR drafter and a stock
    draft model (the f32 file serving the q8_0 target); each speculative row with llama.cpp's acceptance, its
    category groups and a prediction from its own calibrated step; then make_results renders the section."""
    from benchmarks import engines as driver
    from drafter_train.engines.lookup_cache import write_lookup_cache
    from drafter_train.targets import load_tokenizer

    from tests.test_engine_llamacpp import STORIES_DFLASH
    from tests.test_gguf import train_on_stories

    monkeypatch.setenv("DRAFTER_TRAIN_CACHE", str(tmp_path / "cache"))
    eagle, ar, dflash = tmp_path / "eagle", tmp_path / "ar", tmp_path / "dflash"
    gguf_export(stories_runs["eagle3"], eagle, gguf_type="f32")
    (tmp_path / "dflash-run").mkdir()
    dflash_run = train_on_stories(stories_path, tmp_path / "dflash-run", {"dflash": STORIES_DFLASH}, steps=2)["dflash"]
    gguf_export(dflash_run, dflash, gguf_type="f32", gguf_target=False)
    gguf_export(stories_runs["ar"], ar, gguf_type="f32", gguf_target=False, drafter_gguf_type="q8_0")
    lookup = write_lookup_cache(llamacpp_dir(), eagle / "target.gguf", stories_runs["eagle3"].parent.parent / "data",
                                tmp_path / "corpus.lookup", load_tokenizer(str(stories_path)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in [
        ("Once upon a time, there was a little", "coding"), ("The dog ran to the", "chat"),
        ("Lily saw a big", "coding")]))
    results = tmp_path / "results"
    assert driver.main([
        "--engines", "llama.cpp", "--target", str(stories_path), "--target-gguf", f"f32={eagle / 'target.gguf'}",
        "--export-types", "q8_0", "--draft-gguf", f"e3={eagle / 'drafter.gguf'}",
        "--draft-gguf", f"ar={ar / 'drafter.gguf'}", "--draft-gguf", f"stock={eagle / 'target.gguf'}@q8_0",
        "--draft-gguf", f"df={dflash / 'drafter.gguf'}", "--draft-len-of", "df=4",
        "--product", "e3", "--lookup-cache", str(lookup), "--ngram-modes", "all", "--prompts", str(prompts),
        "--per-category", "1", "--rounds", "1", "--max-new-tokens", "12", "--draft-len", "2",
        "--calibration-prompts", str(prompts), "--calibration-num-prompts", "1", "--calibration-new-tokens", "8",
        "--sizes", "1,2", "--depth", "16", "--output", str(tmp_path / "out"), "--result",
        "--result-name", "served_stories", "--results-dir", str(results)]) == 0
    result = json.loads((results / "served_stories.json").read_text())
    rows = result["data"]["engine_rows"]
    got = [(r["precision"], r["decoder"], r.get("label")) for r in rows]
    assert got == [("f32", "plain", None), ("q8_0", "plain", None),
                   *[("f32", "free n-gram", None)] * 5, ("f32", "EAGLE-3", "e3"), ("f32", "product", "e3"),
                   ("f32", "AR drafter", "ar"), ("q8_0", "AR drafter", "stock"), ("f32", "DFlash", "df")]
    for row in rows:
        assert row["tokens_per_s"] > 0 and set(row["by_group"]) == {"coding", "chat", "code", "rest"}
        if row.get("label"):  # every drafter row: llama.cpp's acceptance and a prediction from its own step
            assert len(row["acceptance_per_position"]) == (4 if row["label"] == "df" else 2), row
            assert row["predicted_speedup"] is not None, row
    steps = next(c for c in result["data"]["cost_curves"] if c["precision"] == "f32")["server"]["kinds"]
    assert set(steps) == {"ngram", "eagle3:e3", "ar:ar", "dflash:df"}
    assert steps["dflash:df"]["relative"]["5"] > 1  # DFlash's verify step over 5 tokens, measured
    stock = next(r for r in rows if r.get("label") == "stock")
    assert stock["cost_key"] == "ar:stock" and stock["acceptance_per_position"][0] > 0.9  # the target drafting itself
    docs = tmp_path / "results.md"
    assert make_results.main(["--results-dir", str(results), "--docs", str(docs), "--readme",
                              str(tmp_path / "none.md")]) == 0
    assert "| f32 | product (e3) |" in docs.read_text()


def test_each_speculative_row_is_compared_with_its_precisions_plain_output():
    """Outputs kept per round: a row that wrote plain's tokens is 2/2 identical; one that parted at token 3 of
    prompt 1 in round 2 is 1/2 with that position; another precision's plain row is never the reference."""
    plain = {"engine": "llama.cpp", "precision": "q4", "decoder": "plain", "setting": "plain"}
    other = dict(plain, precision="f16")
    same = dict(plain, decoder="free n-gram", setting="--spec-type ngram-simple")
    parted = dict(same, setting="--spec-type ngram-mod")
    out = [[1, 2, 3, 4], [5, 6, 7, 8]]
    rounds = [{"plain": {"tokens_per_s": 10.0, "row": plain, "outputs": out},
               "f16": {"tokens_per_s": 5.0, "row": other, "outputs": [[9], [9]]},
               "same": {"tokens_per_s": 12.0, "row": same, "outputs": out},
               "parted": {"tokens_per_s": 13.0, "row": parted,
                          "outputs": out if r == 0 else [out[0], [5, 6, 7, 0]]}} for r in range(2)]
    rows = {r["setting"] + r["precision"]: r for r in table.summarize(rounds, [])}
    assert rows["--spec-type ngram-simpleq4"]["same_output_as_plain"] == {"prompts": 2, "identical": 2,
                                                                            "differences": []}
    assert rows["--spec-type ngram-modq4"]["same_output_as_plain"] == {
        "prompts": 2, "identical": 1, "differences": [{"round": 1, "prompt": 1, "position": 3}]}
    assert "same_output_as_plain" not in rows["plainq4"]  # the engine's first plain row is the reference
    assert rows["plainf16"]["same_output_as_plain"] == {  # another file's plain output, against the first's
        "prompts": 2, "identical": 0, "reference": "q4", "differences": [
            {"round": r, "prompt": p, "position": 0} for r in range(2) for p in range(2)]}
    assert "outputs" not in rows["plainq4"]  # token lists stay out of the result file


def test_acceptance_needed_for_each_speedup_by_hand():
    """A 3-token step costs 1.8 one-token passes and drafting 0.2: a step costs 2.0, so 1.0x needs tau 2 (1 + a + a^2
    = 2: a = 0.618), 1.5x needs tau 3 (every draft accepted) and 2.0x tau 4, more than 2 drafts can give."""
    got = table.acceptance_needed_for({1: 1.0, 2: 1.5, 3: 1.8}, 2, 0.2)
    assert got["1"] == pytest.approx((5 ** 0.5 - 1) / 2, abs=1e-6)
    assert got["1.5"] == pytest.approx(1.0, abs=1e-6)
    assert got["2"] is None
    # on a file whose plain step is 1.25 of the baseline's, the step costs 2.5 baseline steps: 1.0x needs tau 2.5
    slower = table.acceptance_needed_for({1: 1.0, 2: 1.5, 3: 1.8}, 2, 0.2, slower=1.25)
    assert 1 + slower["1"] + slower["1"] ** 2 == pytest.approx(2.5, abs=1e-6) and slower["1.5"] is None


def _case(reference, other, position, stepwise, batched, stepwise_tokens=None, verify=()):
    return {"row": 0, "round": 1, "prompt_index": 2, "position": position, "prompt": [7], "reference": reference,
            "other": other, "stepwise_tokens": reference if stepwise_tokens is None else stepwise_tokens,
            "stepwise": stepwise, "batched": batched, "verify": list(verify)}


def test_a_difference_is_a_near_tie_only_within_the_engines_own_batch_shift():
    """Plain wrote 5 at position 2, the other decoder 6. Margins are logit differences: 0.01 in the 1-token step
    and -0.02 in one multi-token pass (the pass itself picks 6): a near tie. A 3.0 margin the batch moves by 0.1 is
    not; nor is a replay that did not reproduce plain's output, nor a token outside the top log-probabilities."""
    before = [{1: -0.1, 2: -3.1}, {3: -0.2, 4: -1.2}]  # top-1 minus top-2 margins 3.0 and 1.0 before the difference
    tie = near_ties.near_tie(_case([1, 3, 5, 9], [1, 3, 6], 2, before + [{5: -0.70, 6: -0.71, 8: -4.0}],
                               {6: -0.69, 5: -0.71}))
    assert tie == {"round": 1, "prompt": 2, "position": 2, "plain_token": 5, "other_token": 6, "reproduced": True,
                   "margin_stepwise": pytest.approx(0.01), "margin_batched": pytest.approx(-0.02),
                   "margin_verify": [], "flips_in": [], "other_rank": 2,
                   "median_margin_before": pytest.approx(2.0), "near_tie": True}
    wide = near_ties.near_tie(_case([1, 3, 5], [1, 3, 6], 2, before + [{5: -0.1, 6: -3.1}], {5: -0.2, 6: -3.1}))
    assert wide["margin_stepwise"] == pytest.approx(3.0) and not wide["near_tie"]
    replay = near_ties.near_tie(_case([1, 3, 5], [1, 3, 6], 2, before + [{5: -0.70, 6: -0.71}], {6: -0.6, 5: -0.7},
                                  stepwise_tokens=[1, 4, 5]))
    assert not replay["reproduced"] and not replay["near_tie"]
    outside = near_ties.near_tie(_case([1, 3, 5], [1, 3, 6], 2, before + [{5: -0.7, 8: -0.71}], {5: -0.7, 8: -0.9}))
    assert outside["other_rank"] is None and outside["margin_stepwise"] is None and not outside["near_tie"]
    ended = near_ties.near_tie(_case([1, 3, 5], [1, 3], 2, before + [{5: -0.7}], {5: -0.7}))
    assert ended["other_token"] is None and not ended["near_tie"]



def test_a_verify_shaped_batch_can_show_a_near_tie_the_prompt_pass_does_not():
    """A margin of 0.05 that one pass over the whole prefix leaves alone but a verify step's batch of 4 tokens
    turns to -0.01 (that batch itself writes the other token: flips_in) is a near tie; batches of 2 and 3 that give
    the 1-token step's arithmetic exactly (llama.cpp's repacked Q4_K kernels run them row by row) do not show it."""
    before = [{1: -0.1, 2: -3.1}, {3: -0.2, 4: -1.2}]
    step = before + [{5: -0.70, 6: -0.75}]
    same = [{"batch": m, "logprobs": {5: -0.70, 6: -0.75}} for m in (2, 3)]
    flipped = near_ties.near_tie(_case([1, 3, 5], [1, 3, 6], 2, step, {5: -0.70, 6: -0.75},
                                   verify=[*same, {"batch": 4, "logprobs": {6: -0.70, 5: -0.71}}]))
    assert flipped["near_tie"] and flipped["flips_in"] == [4]
    assert [v["batch"] for v in flipped["margin_verify"]] == [2, 3, 4]
    assert flipped["margin_verify"][2]["margin"] == pytest.approx(-0.01)
    assert not near_ties.near_tie(_case([1, 3, 5], [1, 3, 6], 2, step, {5: -0.70, 6: -0.75}, verify=same))["near_tie"]


def test_near_ties_are_checked_on_each_rows_plain_server(tmp_path, monkeypatch):
    """Each differing prompt once, at its first difference, on the plain decoder that answers for it (its own
    precision's for a speculative row, the reference's for another file's plain row); the stand-in server's top
    log-probabilities are read at the difference's position (1 token a step) and from one pass over the prefix (the
    stand-in is no language model: that pass answers another token than plain's, so that margin is unknown)."""
    plain = {"engine": "llama.cpp", "precision": "q4", "decoder": "plain", "setting": "plain"}
    other = dict(plain, precision="f16")
    spec = dict(plain, decoder="free n-gram", setting="--spec-type ngram-mod")
    prompts = [[1, 1], [2, 2]]
    out = [decode_prompts(server_command(FAKE, tmp_path / "t.gguf", None, None, 0, 1, free_port(), False),
                          tmp_path / "s.log", prompts, 8)["tokens"]][0]
    assert all(len(o) >= 2 for o in out)
    parted = [out[0], out[1][:1] + [1] + out[1][2:]]  # prompt 1 parts at position 1, on token 1: the runner-up
    rounds = [{"plain": {"tokens_per_s": 10.0, "row": plain, "outputs": out},
               "f16": {"tokens_per_s": 5.0, "row": other, "outputs": out},
               "spec": {"tokens_per_s": 12.0, "row": spec, "outputs": parted if r else out}} for r in range(2)]
    rows = table.summarize(rounds, [])
    decoders = {"plain": {"precision": "q4", "target": tmp_path / "q4.gguf"},
                "f16": {"precision": "f16", "target": tmp_path / "f16.gguf"},
                "spec": {"precision": "q4", "target": tmp_path / "q4.gguf", "spec_type": "ngram-mod", "draft_len": 3}}
    asked = []
    real = table.near_tie_logprobs
    monkeypatch.setattr(table, "near_tie_logprobs",
                        lambda command, log, cases, n: asked.append((command[command.index("-m") + 1], cases))
                        or real([str(FAKE / "llama-server"), *command[1:]], log, cases, n))
    record = tmp_path / "asked.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(record))
    table.check_near_ties(rows, list(rounds[0]), rounds, prompts, decoders, FAKE, 1, tmp_path / "n.log")
    assert [(m, [(c["prompt_index"], c["position"], c["round"]) for c in cases]) for m, cases in asked] == [
        (str(tmp_path / "q4.gguf"), [(1, 1, 1)])]
    same = rows[2]["same_output_as_plain"]
    assert same["near_ties_shown"] == 0 and same["near_ties"] == [{
        "round": 1, "prompt": 1, "position": 1, "plain_token": out[1][1], "other_token": 1, "reproduced": True,
        "margin_stepwise": pytest.approx(0.5), "margin_batched": None, "margin_verify": [
            {"batch": 2, "margin": None}], "flips_in": [], "other_rank": 2,
        "median_margin_before": pytest.approx(0.25), "near_tie": False}]
    # the verify-shaped replay on the prefix (prompt [2, 2] and the answer's first token): all but its last 2 tokens
    # cached, then the whole prefix, whose last 2 the server evaluates as one batch (sizes 3 and 4 of the draft
    # length 3 would leave nothing to cache)
    asked_bodies = [json.loads(line) for line in record.read_text().splitlines()]
    cached = [(b["prompt"], b["n_predict"]) for b in asked_bodies if b.get("cache_prompt")]
    assert cached == [([2], 0), ([2, 2, out[1][0]], 1)]
    assert "near_ties" not in (rows[1].get("same_output_as_plain") or {})  # f16's output equals the reference's


def test_a_stopped_served_table_resumes_from_its_journal_and_refuses_other_settings_or_machines(tmp_path, monkeypatch):
    """Each round's decoder and calibration is kept as it finishes (RunJournal): the same command again serves
    nothing and gives the same table; a lost unit is run again alone; a third round runs only its own units; other
    settings, or another CPU, are refused in one line before anything is served."""
    from benchmarks import engines as driver
    from drafter_train.engines import llamacpp_cost

    llcpp = tmp_path / "llcpp"
    (llcpp / "build" / "bin").mkdir(parents=True)
    (llcpp / "build" / "bin" / "llama-server").symlink_to(FAKE / "llama-server")
    (llcpp / "build" / "bin" / "llama-bench").write_text("")
    target = drafter_gguf(tmp_path / "target.gguf", "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"write {w} now", "category": c}) + "\n"
                               for w, c in [("a", "coding"), ("b", "chat")]))
    served, calibrations = [], []
    real_run = driver.run_llamacpp
    monkeypatch.setattr(driver, "run_llamacpp", lambda d, *a: served.append(d["decoder"]) or real_run(d, *a))
    monkeypatch.setattr(driver, "bench_curve", lambda *a: calibrations.append(a[1]) or {1: 10.0, 2: 12.0})
    monkeypatch.setattr(llamacpp_cost, "server_curves", lambda *a: {
        "ms_1": 10.0, "kinds": {key: {"ms": {1: 10.0, 3: 15.0}, "relative": {1: 1.0, 3: 1.5}} for key in a[-2]}})
    monkeypatch.setattr(driver.llamacpp_cost, "prompt_set", _word_prompts(llamacpp_cost.prompt_set))
    monkeypatch.setattr(driver.llamacpp_cost, "calibration_prompts", lambda *a, **k: [[5, 6, 7]])
    out = tmp_path / "out"

    def run(*more, rounds="2"):
        return driver.main(["--engines", "llama.cpp", "--llamacpp", str(llcpp), "--target", str(tmp_path),
                            "--target-gguf", f"q4={target}", "--ngram-modes", "ngram-simple",
                            "--prompts", str(prompts), "--per-category", "1", "--rounds", rounds,
                            "--max-new-tokens", "4", "--output", str(out), "--result-name", "t", *more])

    def table():
        return [(r["decoder"], r["tokens_per_s_rounds"]) for r in json.loads((out / "t.json").read_text())["rows"]]

    assert run() == 0 and served == ["plain", "free n-gram"] * 2 and len(calibrations) == 2
    first = table()
    served.clear(), calibrations.clear()
    assert run() == 0 and served == [] and calibrations == [] and table() == first
    journal = out / "t.journal"
    units = sorted(journal.glob("*.pkl"))
    assert len(units) == 6  # 2 rounds x (2 decoders + the calibration)
    units[0].unlink()  # any one unit lost
    assert run() == 0 and len(served) + len(calibrations) == 1
    served.clear(), calibrations.clear()
    assert run(rounds="3") == 0 and served == ["plain", "free n-gram"] and len(calibrations) == 1
    with pytest.raises(SystemExit, match=r"t.journal holds a stopped run with other settings \(max_new_tokens\)"):
        run("--max-new-tokens", "5")
    monkeypatch.setattr(driver, "machine_identity", lambda: {"cpu": "Other CPU", "cpu_features": ["avx2"],
                                                             "logical_cores": 2})
    with pytest.raises(SystemExit, match="holds a run measured on another machine") as err:
        run()
    assert "\n" not in str(err.value) and "Other CPU" in str(err.value)


def test_ours_acceptance_comes_from_drafter_eval_or_an_engine_check(tmp_path):
    from benchmarks.engines import add_ours_acceptance

    (tmp_path / "metrics.json").write_text(json.dumps({"per_position_acceptance": [0.5]}))
    (tmp_path / "llamacpp_check.json").write_text(json.dumps({"ours": {"per_position_acceptance": [0.25, 0.125]},
                                                              "llamacpp": {"per_position_acceptance": [0.9]}}))
    rows = [{"label": "a"}, {"label": "b"}, {"label": "b", "decoder": "product"}, {}]
    add_ours_acceptance(rows, [f"a={tmp_path / 'metrics.json'}", f"b={tmp_path / 'llamacpp_check.json'}"])
    assert [r.get("ours_acceptance_per_position") for r in rows] == [[0.5], [0.25, 0.125], [0.25, 0.125], None]
