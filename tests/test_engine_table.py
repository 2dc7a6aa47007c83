"""The engine table (benchmarks/make_results.py) on a fixture result file, and the llama.cpp
commands benchmarks/engines.py and engine_check build: the product's comma list, the static corpus cache, plain
decoding without any --spec-type, the stand-alone AR drafter as a draft model, and the drafting time read from
llama-server's log. Nothing here runs an engine."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from benchmarks import engines as engines_driver
from benchmarks import make_results
from benchmarks.common import write_result
from benchmarks.make_results import engine_section, pays_lines, server_step_table, speculation_table, speed_table
from drafter_train.engines import check as engine_check
from drafter_train.engines import table as engines
from drafter_train.engines import vllm_cpu as vllm_engine
from drafter_train.engines.llamacpp_server import drafting_ms, logged_steps, server_command
from drafter_train.errors import ConfigError
from drafter_train.targets import model_name


def _row(engine, precision, decoder, tps, fastest=150.0, own=None, **extra):
    return {"engine": engine, "precision": precision, "decoder": decoder, "setting": extra.pop("setting", decoder),
            "tokens_per_s": tps, "speedup_over_fastest": tps / fastest,
            "speedup_over_own_plain": None if own is None else tps / own, **extra}


ROWS = [
    _row("llama.cpp", "q8_0", "plain", 150.0, own=150.0),
    _row("llama.cpp", "q8_0", "free n-gram", 140.0, own=150.0, setting="--spec-type ngram-simple", tau=1.1,
         predicted_speedup=0.98, draft_cost_per_step=0.01),
    _row("llama.cpp", "q8_0", "free n-gram", 120.0, own=150.0, setting="--spec-type ngram-mod", tau=1.05),
    _row("llama.cpp", "q8_0", "EAGLE-3", 100.0, own=150.0, tau=1.3, predicted_speedup=0.7, draft_cost_per_step=0.2),
    _row("ours", "f32", "plain", 40.0, own=40.0),
    _row("ours", "f32", "product", 50.0, own=40.0, tau=1.6, predicted_speedup=1.2),
    _row("HF generate", "f32", "plain", 24.0, own=24.0),
]
CURVES = [{"engine": "llama.cpp", "precision": "q8_0", "ms_1": 5.8, "relative": {"1": 1.0, "2": 1.9, "3": 2.2}},
          {"engine": "ours", "precision": "f32", "ms_1": 25.0, "relative": {"1": 1.0, "2": 1.05, "3": 1.1}}]


def test_speed_table_names_the_fastest_plain_and_each_decoder():
    table = speed_table(ROWS).splitlines()
    assert table[0].startswith("| engine | precision | plain: tok/s (x fastest plain) | free n-gram")
    llama = next(line for line in table if line.startswith("| llama.cpp | q8_0"))
    # the best n-gram mode (140, not 120); no AR drafter row: "not measured"
    assert llama == ("| llama.cpp | q8_0 | 150.0 (1.00x) | 140.0 (0.93x) | 100.0 (0.67x) | not measured | "
                     "not measured |")
    ours = next(line for line in table if line.startswith("| ours |"))
    assert "| 40.0 (0.27x) |" in ours and "50.0 (0.33x) |" in ours
    assert "| HF generate | f32 | 24.0 (0.16x) |" in speed_table(ROWS)


def test_speculation_table_sets_prediction_beside_measurement():
    lines = speculation_table(ROWS).splitlines()
    eagle = next(line for line in lines if "EAGLE-3" in line)
    # measured 100/150 = 0.667, predicted 0.7: +5 %
    assert eagle == "| llama.cpp | q8_0 | EAGLE-3 | EAGLE-3 | 1.300 | 0.667 | – | 0.700 | +5 % |"
    product = next(line for line in lines if "product" in line)
    assert product == "| ours | f32 | product | product | 1.600 | 1.250 | – | 1.200 | -4 % |"
    assert not any("| plain |" in line for line in lines)


def test_pays_lines_by_hand():
    """llama.cpp q8_0 with a drafter costing 0.2 passes per step: break-even tau 1.9 + 0.2 = 2.1 at draft length 1
    (beyond 1 + 1: out of reach) and 2.2 + 0.2 = 2.4 at 2 (1 + a + a^2 = 2.4: a = 0.78); ours (no EAGLE-3 row:
    drafting cost 0): 1.05 (a = 0.05) and 1.1 (a = 0.09)."""
    lines = pays_lines(ROWS, CURVES)
    llama, ours = lines
    assert "**llama.cpp q8_0**: speculation does not pay (best: free n-gram, 0.93x" in llama
    assert "draft length 1: tau 2.10 (out of reach)" in llama
    assert "draft length 2: tau 2.40 (per-position acceptance 0.78)" in llama
    assert "**ours f32**: speculation pays (best: product, 1.25x" in ours
    assert "draft length 1: tau 1.05 (per-position acceptance 0.05)" in ours
    assert "draft length 2: tau 1.10 (per-position acceptance 0.09)" in ours
    # llama-server's measured EAGLE-3 step (drafter_train/engines/llamacpp_cost.py) replaces llama-bench's pass: 1 + (2.4 - 1) / 2
    # = 1.7 at draft length 1 (interpolated), 2.4 at 2; plus 0.2 of drafting: 1 + a = 1.9, 1 + a + a^2 = 2.6
    stepped = [dict(CURVES[0], server={"ms_1": 5.0, "kinds": {"eagle3": {"relative": {"1": 1.0, "3": 2.4}}}})]
    llama = pays_lines(ROWS, stepped)[0]
    assert "draft length 1: tau 1.90 (per-position acceptance 0.90)" in llama
    assert "draft length 2: tau 2.60 (per-position acceptance 0.86)" in llama


def test_the_rounds_spread_is_shown_and_a_gain_within_it_is_not_called_paying():
    """Per round: 60/50 and 55/55 -> 1.00-1.20; plain moved 50 -> 55 between rounds (10 %), so a 1.05x median gain
    is within that spread and is not called paying, while a 1.25x one is."""
    plain = _row("llama.cpp", "f32", "plain", 52.0, own=52.0, tokens_per_s_rounds=[50.0, 55.0])
    ngram = _row("llama.cpp", "f32", "free n-gram", 54.6, own=52.0, tau=1.02, predicted_speedup=1.0,
                 tokens_per_s_rounds=[60.0, 55.0])
    curve = [{"engine": "llama.cpp", "precision": "f32", "ms_1": 14.0, "relative": {"1": 1.0, "2": 1.3, "3": 1.5}}]
    assert "| 1.050 | 1.00-1.20 | 1.000 | -5 % |" in speculation_table([plain, ngram])
    (line,) = pays_lines([plain, ngram], curve)
    assert "speculation gains no more than plain decoding's spread between rounds (10 %)" in line
    fast = dict(ngram, tokens_per_s=65.0, speedup_over_own_plain=1.25)
    assert "**llama.cpp f32**: speculation pays (best: free n-gram, 1.25x" in pays_lines([plain, fast], curve)[0]


def test_make_results_renders_the_engine_section_from_its_result_file(tmp_path):
    results = tmp_path / "results"
    write_result("engines", title="Engines on this machine", question="Which is fastest?", command="python -m x",
                 split="test split, first 16 prompts", baseline="the fastest plain decoder (llama.cpp q8_0)",
                 columns=["engine"], rows=[["unused"]], machine={"cpu": "Test CPU"}, results_dir=results,
                 data={"engine_rows": ROWS, "cost_curves": CURVES})
    docs = tmp_path / "results.md"
    assert make_results.main(["--results-dir", str(results), "--docs", str(docs),
                              "--readme", str(tmp_path / "none.md")]) == 0
    page = docs.read_text()
    assert "## Engines on this machine" in page and "**llama.cpp q8_0 plain, 150.0 tokens/s**" in page
    assert speed_table(ROWS) in page and speculation_table(ROWS) in page
    assert "| llama.cpp | q8_0 | 5.800 | 1.900 | 2.200 |" in page  # the cost curve, relative to n = 1
    assert "- split: test split, first 16 prompts" in page and "- baseline: the fastest plain decoder" in page
    assert "| unused |" not in page  # the generic table gives way to the engine table


def test_the_section_shows_llama_servers_own_verify_step_where_it_was_measured():
    """The step the llama.cpp predictions use sits under the pass curves, per precision and verify kind, relative to
    a plain step; without it (an older result) no such table is printed."""
    server = {"ms_1": 6.0, "kinds": {"eagle3": {"ms": {"1": 6.0, "3": 19.5}, "relative": {"1": 1.0, "3": 3.25}},
                                     "ngram": {"ms": {"1": 6.0, "3": 18.0, "9": 33.0},
                                               "relative": {"1": 1.0, "3": 3.0, "9": 5.5}}}}
    curves = [dict(CURVES[0], server=server)]
    table = server_step_table(curves)
    assert "| llama.cpp q8_0 | eagle3 | 6.000 | 3.250 | – |" in table
    assert "| llama.cpp q8_0 | ngram | 6.000 | 3.000 | 5.500 |" in table
    result = {"title": "Engines", "question": "?", "data": {"engine_rows": ROWS, "cost_curves": curves}}
    assert table in "\n".join(engine_section("engines", result))
    assert server_step_table(CURVES) is None
    assert "llama-server's verify step" not in "\n".join(
        engine_section("engines", dict(result, data={"engine_rows": ROWS, "cost_curves": CURVES})))


def test_product_spec_type_and_refusals():
    assert engine_check.llamacpp_spec_type("draft-eagle3", None) == "draft-eagle3"
    assert engine_check.llamacpp_spec_type("draft-eagle3", "ngram-cache") == "ngram-cache,draft-eagle3"
    assert engine_check.llamacpp_spec_type("draft-simple", "ngram-simple,ngram-mod", None) == \
        "ngram-simple,ngram-mod,draft-simple"
    with pytest.raises(ConfigError, match="--lookups ngram-fancy: not a llama.cpp n-gram mode"):
        engine_check.llamacpp_spec_type("draft-eagle3", "ngram-fancy")
    with pytest.raises(ConfigError, match="--lookup-corpus is read by llama.cpp's ngram-cache mode"):
        engine_check.llamacpp_spec_type("draft-eagle3", "ngram-simple", "data/x")


def _pairs(command: list[str]) -> dict:
    return {a: b for a, b in zip(command, command[1:]) if a.startswith("-")}


def test_server_commands_for_plain_ngram_and_product():
    bin_dir = Path("/opt/llama/bin")
    plain = server_command(bin_dir, Path("t.gguf"), None, None, 2, 2, 8080, f32_cache=False)
    assert "--spec-type" not in plain and "-md" not in plain and plain[0] == "/opt/llama/bin/llama-server"
    ngram = server_command(bin_dir, Path("t.gguf"), None, "ngram-simple", 3, 2, 8080, f32_cache=True)
    assert _pairs(ngram)["--spec-type"] == "ngram-simple" and _pairs(ngram)["--spec-draft-n-max"] == "3"
    assert "-md" not in ngram and "-ctkd" not in ngram and _pairs(ngram)["-ctk"] == "f32"
    product = server_command(bin_dir, Path("t.gguf"), Path("d.gguf"), "ngram-cache,draft-eagle3", 2, 2, 8080,
                             f32_cache=False, lookup_cache=Path("corpus.lookup"))
    got = _pairs(product)
    assert got["--spec-type"] == "ngram-cache,draft-eagle3" and got["-md"] == "d.gguf"
    assert got["--lookup-cache-static"] == "corpus.lookup" and got["--spec-draft-n-max"] == "2"
    assert "--no-repack" not in product  # llama.cpp's default: repacked weights
    assert "--no-repack" in server_command(bin_dir, Path("t.gguf"), None, None, 2, 2, 8080, False, repack=False)


def test_engines_lists_every_decoder_of_the_exports(tmp_path):
    for precision in ("f16", "q8_0"):
        (tmp_path / precision).mkdir()
        (tmp_path / precision / "target.gguf").write_bytes(b"")
    (tmp_path / "q8_0" / "drafter.gguf").write_bytes(b"")
    (tmp_path / "corpus.lookup").write_bytes(b"")
    decoders = engines.llamacpp_decoders(tmp_path, ["ngram-simple", "ngram-mod"], 2)
    got = [(d["precision"], d["decoder"], d["spec_type"], d["draft_len"]) for d in decoders]
    assert got == [("f16", "plain", None, 0), ("f16", "free n-gram", "ngram-simple", 2),
                   ("f16", "free n-gram", "ngram-mod", 2), ("q8_0", "plain", None, 0),
                   ("q8_0", "free n-gram", "ngram-simple", 2), ("q8_0", "free n-gram", "ngram-mod", 2),
                   ("q8_0", "EAGLE-3", "draft-eagle3", 2), ("q8_0", "product", "ngram-cache,draft-eagle3", 2)]
    assert decoders[-1]["lookup_cache"] == tmp_path / "corpus.lookup" and decoders[-1]["drafter"].name == "drafter.gguf"


def test_engines_adds_the_ar_drafter_as_a_draft_model_per_precision(tmp_path):
    """The AR drafter's gguf exports (their own folders, no targets) pair with the targets of --exports at the same
    precision; served as llama.cpp's draft model (draft-simple, -md) with the draft length in its setting."""
    exports, ar = tmp_path / "exports", tmp_path / "ar"
    for precision in ("f32", "q8_0"):
        (exports / precision).mkdir(parents=True)
        (exports / precision / "target.gguf").write_bytes(b"")
    (ar / "q8_0").mkdir(parents=True)
    (ar / "q8_0" / "drafter.gguf").write_bytes(b"")
    decoders = engines.llamacpp_decoders(exports, [], 3, ar)
    got = [(d["precision"], d["decoder"], d["spec_type"]) for d in decoders]
    assert got == [("f32", "plain", None), ("q8_0", "plain", None), ("q8_0", "AR drafter", "draft-simple")]
    ar_row = decoders[-1]
    assert ar_row["drafter"] == ar / "q8_0" / "drafter.gguf" and ar_row["target"] == exports / "q8_0" / "target.gguf"
    assert engines._row(ar_row) == {"engine": "llama.cpp", "precision": "q8_0", "decoder": "AR drafter",
                                    "setting": "--spec-type draft-simple --spec-draft-n-max 3",
                                        "draft_len": 3}
    command = _pairs(server_command(Path("/bin"), ar_row["target"], ar_row["drafter"], ar_row["spec_type"], 3, 2,
                                    8080, f32_cache=True))
    assert command["-md"] == str(ar / "q8_0" / "drafter.gguf") and command["--spec-type"] == "draft-simple"
    assert command["-ctkd"] == "f32" and command["-td"] == "2"
    assert engines.llamacpp_decoders(exports, [], 3) == decoders[:2]  # no AR folder: no AR row


def test_engines_takes_the_ar_exports_and_folder_together(capsys):
    with pytest.raises(SystemExit):
        engines_driver.main(["--exports", "x", "--drafter", "d", "--corpus", "c", "--ar-exports", "ar"])
    assert "--ar-exports and --ar-drafter go together" in capsys.readouterr().err


def test_result_titles_name_the_model_not_the_embedded_path():
    assert model_name("embedded:smollm2") == "SmolLM2-135M-Instruct"
    assert model_name("/models/Qwen3-8B") == "Qwen3-8B" and model_name("Qwen/Qwen3-8B") == "Qwen3-8B"


def test_the_ar_drafter_rows_fill_the_tables():
    rows = ROWS + [_row("llama.cpp", "q8_0", "AR drafter", 90.0, own=150.0, setting="--spec-type draft-simple",
                        tau=1.5, predicted_speedup=0.63, draft_cost_per_step=0.3),
                   _row("ours", "f32", "AR drafter", 36.0, own=40.0, setting="chain of 2", tau=1.5,
                        predicted_speedup=0.99)]
    table = speed_table(rows)
    llama = next(line for line in table.splitlines() if line.startswith("| llama.cpp | q8_0"))
    assert llama == ("| llama.cpp | q8_0 | 150.0 (1.00x) | 140.0 (0.93x) | 100.0 (0.67x) | 90.0 (0.60x) | "
                     "not measured |")
    ours = next(line for line in table.splitlines() if line.startswith("| ours |"))
    assert "| 36.0 (0.24x) | 50.0 (0.33x) |" in ours
    lines = speculation_table(rows).splitlines()
    # measured 90/150 = 0.6, predicted 0.63: +5 %; ours 36/40 = 0.9 against 0.99: +10 %
    assert "| llama.cpp | q8_0 | AR drafter | --spec-type draft-simple | 1.500 | 0.600 | – | 0.630 | +5 % |" in lines
    assert "| ours | f32 | AR drafter | chain of 2 | 1.500 | 0.900 | – | 0.990 | +10 % |" in lines


def test_drafting_ms_sums_the_last_running_total_of_each_drafter():
    line = ("0.01.250.737 I spec common_specu: statistics     {name}: #calls(b,g,a) =    3     96     96, #gen drafts "
            "=     96, #acc drafts =    23, #gen tokens =    373, #acc tokens =    35, #mean acc len = 1.36, #acc "
            "rate/pos = (0.240, 0.073), dur(b,g,a) = {b}, {g}, {a} ms\n")
    log = (line.format(name="draft-eagle3", b="0.006", g="205.778", a="0.025")
           + line.format(name="ngram-cache", b="0.001", g="1.000", a="0.002")
           + line.format(name="draft-eagle3", b="0.012", g="318.580", a="0.040"))
    assert drafting_ms(log) == pytest.approx(0.012 + 318.580 + 0.040 + 0.001 + 1.0 + 0.002)
    assert drafting_ms("no statistics here") == 0.0


def test_logged_steps_names_the_drafter_of_each_step():
    """A product's log (lookup ahead of EAGLE-3): each verify step is the drafter whose "called impl" line came
    last before it; a step that drafted nothing is nobody's, and an impl line does not carry over past its step."""
    impl = "0.01.2 D spec common_specu: called impl {}, hist size = 40, call_count = 3, gen = 2\n"
    step = "0.01.3 D slot update_slots: id  0 | task 1 | add accepted tokens: sampled=12, ids.size={}, n_draft={}\n"
    log = (impl.format("ngram-cache") + step.format(3, 2) + step.format(1, 0) + impl.format("draft-eagle3")
           + step.format(1, 2) + "0.01.4 I something else\n" + impl.format("draft-eagle3") + step.format(2, 2)
           + step.format(1, 0))
    steps, impls = logged_steps(log)
    assert steps == [(2, 2), (0, 0), (0, 2), (1, 2), (0, 0)]
    assert impls == ["ngram-cache", "", "draft-eagle3", "draft-eagle3", ""]


# ---------------------------------------------------------------------------------------------------------------
# vLLM-cpu rows (drafter_train/engines/vllm_cpu.py): what its worker's replies become; nothing here starts vLLM


def test_vllm_decoders_and_the_product_it_cannot_run():
    decoders = vllm_engine.vllm_decoders(2, Path("e3"), Path("ar"))
    assert [(d["decoder"], d["method"], d.get("drafter")) for d in decoders] == [
        ("plain", None, None), ("free n-gram", "ngram", None), ("EAGLE-3", "eagle3", "e3"),
        ("AR drafter", "draft_model", "ar")]
    # vLLM's prompt lookup with our prompt lookup's n-gram sizes, the same draft length everywhere
    assert decoders[1]["spec_options"] == {"prompt_lookup_min": 2, "prompt_lookup_max": 3}
    assert {d["draft_len"] for d in decoders} == {2}
    assert [d["decoder"] for d in vllm_engine.vllm_decoders(3)] == ["plain", "free n-gram"]
    assert [(u["engine"], u["decoder"]) for u in vllm_engine.UNAVAILABLE] == [("vLLM-cpu", "product")]
    assert "one speculative method" in vllm_engine.UNAVAILABLE[0]["reason"]


VLLM_REPLY = {"tokens": [[5] * 10, [6] * 6], "seconds": [0.5, 0.3], "draft_s": 0.04,
              "steps": [[2, 2], [0, 2], [1, 2], [2, 2]]}  # (accepted, drafted) per verify step


def test_vllm_record_from_its_per_request_steps():
    """16 tokens in 0.8 s; the verify steps made 3 + 1 + 2 + 3 = 9 of them, the other 7 came from plain passes:
    tau 16 / (7 + 4); position 1 accepted in 3 of 4 steps, position 2 in 2 of the 3 that reached it."""
    eagle3 = vllm_engine.vllm_decoders(2, Path("e3"))[2]
    record = vllm_engine.vllm_record(eagle3, VLLM_REPLY)
    assert record["row"] == {"engine": "vLLM-cpu", "precision": "f32", "decoder": "EAGLE-3",
                             "setting": "method eagle3 (speculators export), k 2"}
    assert record["tokens_per_s"] == pytest.approx(20.0) and record["tokens"] == 16
    assert record["plain_passes"] == 7 and record["drafted"] == [2, 2, 2, 2]
    assert record["tau"] == pytest.approx(16 / 11) and record["draft_ms"] == pytest.approx(40.0)
    assert record["acceptance_per_position"] == pytest.approx([0.75, 2 / 3])
    plain = vllm_engine.vllm_record(vllm_engine.vllm_decoders(2)[0], dict(VLLM_REPLY, steps=[], draft_s=None))
    assert set(plain) == {"tokens_per_s", "row", "outputs"} and plain["tokens_per_s"] == pytest.approx(20.0)
    assert plain["outputs"] == record["outputs"] == VLLM_REPLY["tokens"]  # compared with vLLM's plain output


def test_vllm_engines_one_at_a_time_never_hold_two_targets(tmp_path, monkeypatch):
    """--vllm-one-at-a-time (a float32 1.5B twice does not fit in 24 GB; seen: the second engine OOM-killed): each
    decoder's engine starts, decodes and goes before the next starts, plain last so that the curve finds it alive;
    rows come back in the usual order."""
    alive, events = set(), []

    class FakeWorker:
        def __init__(self, python, request, folder, name, threads):
            assert not alive, f"{name} started while {alive} alive"
            alive.add(name)
            self.name, self.ready = name, {"startup_s": 1.0, "timers": None}
            events.append(f"start {name}")

        def call(self, **command):
            events.append(f"{command['op']} {self.name}")
            if command["op"] == "curve":
                return {"ms": {"1": 10.0}, "scheduled": {"1": 1}}
            return dict(VLLM_REPLY, steps=[] if self.name == "plain" else VLLM_REPLY["steps"])

        def close(self):
            alive.discard(self.name)
            events.append(f"close {self.name}")

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    monkeypatch.setattr(vllm_engine, "Worker", FakeWorker)
    rows = vllm_engine.VllmRows("python", str(tmp_path), [[1, 2]], [2], 8, 2, 2, tmp_path, eagle3=Path("e3"),
                                only=["EAGLE-3"], one_at_a_time=True)
    assert events == []  # nothing starts before the first round
    for r in range(2):
        found = rows.run_round(f"round {r + 1}")
        assert list(found) == ["vLLM-cpu plain", "vLLM-cpu EAGLE-3"] and found["vLLM-cpu EAGLE-3"]["tau"] > 1
        assert rows.curve([1], 8, 1) == {1: pytest.approx(10.0)}  # from the plain engine, alive after the round
    rows.close()
    one_round = ["start EAGLE-3", "decode EAGLE-3", "close EAGLE-3", "start plain", "decode plain", "curve plain",
                 "close plain"]
    assert events == one_round * 2
    assert not alive


def test_vllm_rows_get_predictions_from_vllms_curve_and_a_dash_for_the_product():
    """Predicted: 16 tokens over 7 one-token passes + 4 passes of 3 tokens (1.2 each) + 40 ms of drafting (2
    passes of 20 ms) = 16 / 13.8."""
    decoders = vllm_engine.vllm_decoders(2, Path("e3"))
    found = {"vLLM-cpu plain": vllm_engine.vllm_record(decoders[0], dict(VLLM_REPLY, seconds=[0.4, 0.4])),
             "vLLM-cpu EAGLE-3": vllm_engine.vllm_record(decoders[2], VLLM_REPLY)}
    curves = engines.median_curves([{("vLLM-cpu", "f32"): {1: 20.0, 2: 22.0, 3: 24.0}}])
    rows = engines.summarize([found], curves)
    eagle = next(r for r in rows if r["decoder"] == "EAGLE-3")
    assert eagle["predicted_speedup"] == pytest.approx(16 / 13.8)
    assert eagle["speedup_over_own_plain"] == pytest.approx(1.0) and eagle["fastest_plain"] == "vLLM-cpu f32"
    assert eagle["draft_cost_per_step"] == pytest.approx(2 / 11)
    table = speed_table(rows, vllm_engine.UNAVAILABLE)
    assert "| vLLM-cpu | f32 | 20.0 (1.00x) | not measured | 20.0 (1.00x) | not measured | – |" in table
    result = {"title": "Engines", "question": "Which?", "data": {"engine_rows": rows, "cost_curves": curves,
                                                                "unavailable": vllm_engine.UNAVAILABLE}}
    page = "\n".join(make_results.engine_section("engines", result))
    assert "- –: vLLM-cpu f32 product: vLLM takes one speculative method per engine" in page
    assert "| vLLM-cpu | f32 | 20.0 | 1.100 | 1.200 |" in page  # its verify-cost curve


def test_vllm_step_overhead_is_wall_time_outside_the_model_runner_per_step():
    """0.8 s of generate calls, 0.6 s of it in 20 model-runner steps: 10 ms per step elsewhere (scheduler, front
    end), which the verify-cost curve adds to each step's model-runner time."""
    assert vllm_engine.step_overhead_ms(dict(VLLM_REPLY, engine_step_s=0.6, engine_steps=20)) == pytest.approx(10.0)
