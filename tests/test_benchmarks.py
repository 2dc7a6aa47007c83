"""benchmarks/: the main job's summary (the quickstart's final table and its result file) and the generation of
docs/results.md and README.md's results block from result files. Made-up numbers, no model."""

from __future__ import annotations

import json

import pytest

from benchmarks import main_job, make_results
from benchmarks.common import dev_note, split_name, write_result
from drafter_train.errors import ConfigError

MACHINE = {"cpu": "Test CPU", "torch_threads": 2, "load_average": [1.5, 1.0, 0.5]}


def fake_run(root):
    """A run folder as the quickstart leaves it: two checkpoints (`best` the first) and, on the test split, the
    product at `best` and the three evaluations that take it apart."""
    run = root / "checkpoints" / "quick"
    (run / "step-300").mkdir(parents=True)
    (run / "best").symlink_to("step-300")
    rows = [{"step": 10, "train/loss": 3.0},
            {"step": 300, "eval/tau": 1.25, "eval/acceptance_rate": 0.125, "eval/speedup": 1.0625},
            {"step": 600, "eval/tau": 1.5, "eval/acceptance_rate": 0.25, "eval/speedup": 1.125}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"eval": {"prompts": "test", "num_prompts": 16, "max_new_tokens": 48},
              "target": {"cpu_kernels": "auto"}}
    for name, tau in (("product", 1.4), ("drafter-alone", 1.1), ("prompt-lookup", 1.2), ("corpus-lookup", 1.3),
                      ("drafter-chain", 1.15)):
        (run / f"{name}.json").write_text(json.dumps({"tau": tau, "acceptance_rate": tau - 1, "speedup": tau - 0.05,
                                                      "per_position_acceptance": [0.25] if name == "product" else [0.25, 0.5],
                                                      "machine": MACHINE, "config": config,
                                                      "side_by_side": ["product", "drafter-alone", "drafter-chain",
                                                                       "prompt-lookup", "corpus-lookup"]}))
    return run


def test_main_job_summary_prints_the_quickstart_table_and_writes_its_result_file(tmp_path, capsys):
    run = fake_run(tmp_path)
    main_job.main(["summarize", "--run", str(run), "--draft-len", "2", "--results-dir", str(tmp_path / "results")])
    assert capsys.readouterr().out == (
        "\ntest split, first 16 prompts, greedy, 2 drafts per pass (the drafter's as siblings, except in the chain's "
        "row)\n"
        "                                         step   tau    acceptance  speedup  per position\n"
        "lookups, then EAGLE-3 (the product)       300  1.400  0.400       1.350    0.250\n"
        "EAGLE-3 alone (best checkpoint)                 1.100  0.100       1.050    0.250 0.500\n"
        "EAGLE-3 alone, chain (top-1)                    1.150  0.150       1.100    0.250 0.500\n"
        "prompt lookup alone (no training)               1.200  0.200       1.150    0.250 0.500\n"
        "prompt + corpus lookup (no drafter)             1.300  0.300       1.250    0.250 0.500\n")
    result = json.loads((tmp_path / "results" / "main_job.json").read_text())
    assert result["columns"] == ["decoder", "step", "tau", "acceptance", "speedup", "acceptance per position"]
    assert result["rows"][0] == ["lookups, then EAGLE-3 (the product)", 300, 1.4, pytest.approx(0.4),
                                 pytest.approx(1.35), [0.25]]
    assert result["rows"][1] == ["EAGLE-3 alone (best checkpoint)", None, 1.1, pytest.approx(0.1), pytest.approx(1.05),
                                 [0.25, 0.5]]
    assert result["rows"][2] == ["EAGLE-3 alone, chain (top-1)", None, 1.15, pytest.approx(0.15),
                                 pytest.approx(1.1), [0.25, 0.5]]
    assert len(result["rows"]) == 5
    assert result["split"] == "test split, first 16 prompts"
    assert "plain decoding" in result["baseline"] and "cpu_kernels=auto" in result["baseline"]
    assert "picked on the dev split" in result["notes"] and "choose" not in result["notes"]  # test: no dev caveat
    assert "the 5 decoders decoded side by side against one plain decoding" in result["notes"]
    assert result["command"] == "bash scripts/quickstart.sh" and result["machine"] == MACHINE
    assert result["title"] and result["question"] and result["date"]
    (run / "drafter-chain.json").unlink()  # a run from before the chain's evaluation: the table without its row
    main_job.main(["summarize", "--run", str(run), "--results-dir", str(tmp_path / "results")])
    assert "chain (top-1)" not in capsys.readouterr().out


@pytest.mark.parametrize("prompts, split", [("test", "test split, first 16 prompts"),
                                            ("heldout-mix", "dev split, first 16 prompts"),
                                            ("my.jsonl", "my.jsonl, first 16 prompts")])
def test_result_files_name_the_shipped_splits(prompts, split):
    assert split_name(prompts, 16) == split
    assert bool(dev_note(split)) == split.startswith("dev")


def fake_result(results, name, title, rows):
    write_result(name, title=title, question=f"What does {name} show?", command=f"python -m benchmarks.{name}",
                 split="heldout-mix, first 4 prompts (dev)", baseline="plain decoding", columns=["decoder", "speedup"],
                 rows=rows, machine=MACHINE, results_dir=results)


def test_make_results_writes_every_table_and_replaces_only_the_readme_block(tmp_path, capsys):
    results, docs, readme = tmp_path / "results", tmp_path / "docs" / "results.md", tmp_path / "README.md"
    fake_result(results, "kernels", "Kernels", [["default", 1.0], ["auto", 1.25]])
    fake_result(results, "main_job", "The main job", [["product", 1.125]])
    readme.write_text("# Project\nintro\n<!-- results:start -->\nold table\n<!-- results:end -->\nafter\n")
    args = ["--results-dir", str(results), "--docs", str(docs), "--readme", str(readme)]

    assert make_results.main([*args, "--check"]) == 1  # nothing generated yet
    assert not docs.exists()
    assert make_results.main(args) == 0
    assert make_results.main([*args, "--check"]) == 0

    page = docs.read_text()
    assert "do not edit by hand" in page and "lab-notes/benchmarks.md" in page
    assert page.index("## The main job") < page.index("## Kernels")  # the headline first
    assert "| decoder | speedup |\n|---|---|\n| default | 1.000 |\n| auto | 1.250 |" in page
    assert "| product | 1.125 |" in page
    assert "`python -m benchmarks.kernels`" in page and "Test CPU (usable extensions not probed), 2 torch threads" in page
    text = readme.read_text()
    assert text.startswith("# Project\nintro\n<!-- results:start -->\n") and text.endswith(
        "<!-- results:end -->\nafter\n")
    assert "old table" not in text and "| product | 1.125 |" in text and "| auto |" not in text
    assert "heldout-mix, first 4 prompts (dev)" in text

    fake_result(results, "main_job", "The main job", [["product", 1.5]])
    assert make_results.main([*args, "--check"]) == 1  # a new result: both files are stale
    assert "README.md is out of date" in capsys.readouterr().out


def test_a_result_file_written_with_a_record_key_as_column_shows_a_readable_header(tmp_path):
    """main_job.json files written before the summary had a header name that column by its record key."""
    results, readme = tmp_path / "results", tmp_path / "README.md"
    write_result("main_job", title="The main job", question="?", command="bash scripts/quickstart.sh", split="test",
                 baseline="plain decoding", columns=["decoder", "tau", "per_position_acceptance"],
                 rows=[["product", 1.5, [0.3, 0.1]]], machine=MACHINE, results_dir=results)
    readme.write_text("<!-- results:start -->\n<!-- results:end -->\n")
    make_results.main(["--results-dir", str(results), "--docs", str(tmp_path / "results.md"), "--readme", str(readme)])
    for text in (readme.read_text(), (tmp_path / "results.md").read_text()):
        assert "| decoder | tau | acceptance per position |\n" in text and "per_position_acceptance" not in text


def test_make_results_leaves_a_readme_without_markers_alone(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Project\nno markers\n")
    fake_result(tmp_path / "results", "main_job", "The main job", [["product", 1.125]])
    make_results.main(["--results-dir", str(tmp_path / "results"), "--docs", str(tmp_path / "results.md"),
                       "--readme", str(readme)])
    assert readme.read_text() == "# Project\nno markers\n"
    assert "| product | 1.125 |" in (tmp_path / "results.md").read_text()


def test_engine_check_serves_every_kind_with_a_vllm_export_and_refuses_the_others_in_one_line():
    from drafter_train.engines.vllm_cpu import vllm_method
    from drafter_train.drafters.registry import all_kinds, get_kind

    assert {k: vllm_method(get_kind(k)) for k in ("eagle3", "dflash", "ar")} == {
        "eagle3": "eagle3", "dflash": "dflash", "ar": "draft_model"}
    for kind in all_kinds():
        if kind.name in ("eagle3", "dflash", "ar"):
            continue
        with pytest.raises(ConfigError) as refused:
            vllm_method(kind)
        message = str(refused.value)
        assert "\n" not in message and f"drafter kind {kind.name}" in message, message
        assert "has no vLLM export format; kinds with one: " in message and "eagle3" in message


def fake_llamacpp_check(kind: str, rates: list[float]) -> dict:
    """engine_check's llama.cpp record (check_llamacpp's `result`) with made-up figures."""
    acceptance = {"implied_acceptance_length": 1 + rates[0], "mean_acceptance_length": 1 + rates[0],
                  "per_position_acceptance": rates}
    return {"kind": kind, "target": "SmolLM2-135M-Instruct", "num_prompts": 16, "max_new_tokens": 48, "draft_len": 2,
            "ours": dict(acceptance, spec_tokens_per_s=30.0, ar_tokens_per_s=25.0, speedup=1.2),
            "llamacpp": dict(acceptance, gguf_type="f32", spec_type=f"draft-{kind}", threads=1,
                             spec_tokens_per_s=40.0, plain_tokens_per_s=50.0, speedup=0.8, output_mismatches=[]),
            "comparison": {"agree": True}}


def test_engine_check_names_its_result_file_and_make_results_sets_it_beside_the_first(tmp_path, capsys):
    from argparse import Namespace

    from benchmarks import engine_check

    results = tmp_path / "results"
    fake_result(results, "engines", "Engines", [["llama.cpp", 1.0]])
    for kind, name in (("eagle3", None), ("ar", "engine_llamacpp_ar")):
        args = Namespace(result_name=name, prompts="test", tolerance=0.03,
                         artifacts="drafter-pipeline pipeline=engine_artifacts")
        path = engine_check.write_llamacpp_result(fake_llamacpp_check(kind, [0.25, 0.125]), args, results)
        assert path == results / f"{name or 'engine_llamacpp'}.json"
    record = json.loads((results / "engine_llamacpp_ar.json").read_text())
    assert record["title"] == "The exported ar drafter of SmolLM2-135M-Instruct served by llama.cpp"
    assert record["rows"][1][:4] == ["llama.cpp (f32, --spec-type draft-ar)", 1.25, 1.25, "0.250 0.125"]
    assert record["split"] == "test split, first 16 prompts"
    assert record["command"].startswith("drafter-pipeline pipeline=engine_artifacts && python -m benchmarks.engine_check")
    page = make_results.results_page(make_results.load_results(results))
    eagle3, ar, engines = (page.index(f"## {title}") for title in (
        "The exported eagle3 drafter", "The exported ar drafter", "Engines"))
    assert eagle3 < ar < engines  # the AR check right after the EAGLE-3 one
    assert "`benchmarks/results/engine_llamacpp_ar.json`" in page

    with pytest.raises(SystemExit):  # a path is refused before anything loads
        engine_check.main(["--engine", "llamacpp", "--run", "x", "--result-name", "../elsewhere"])
    assert "--result-name '../elsewhere': a plain file name" in capsys.readouterr().err


def test_ours_from_is_refused_in_one_line_unless_it_checked_the_same(tmp_path, capsys):
    """--ours-from reuses our evaluator's figures only from a check of the same checkpoint, prompts, budget, draft
    length and lookups; anything else (or no such file, or a vLLM check) is one line before anything loads."""
    from benchmarks import engine_check
    from drafter_train.engines.check import CheckSpec, reused_ours

    same = {"checkpoint": "/runs/e3/step-60", "prompts": "test", "categories": None, "num_prompts": 14,
            "max_new_tokens": 48, "draft_len": 2, "lookups": None, "lookup_corpus": None}
    earlier = tmp_path / "llamacpp_check.json"
    earlier.write_text(json.dumps(dict(same, num_prompts=12, ours={"tau": 1.2})))
    with pytest.raises(ConfigError) as refused:
        reused_ours(earlier, same, {}, CheckSpec())
    assert str(refused.value) == f"--ours-from {earlier}: another check (num_prompts 12, here 14)"
    earlier.write_text(json.dumps({k: v for k, v in same.items() if k != "lookups"}))  # written before lookups were
    with pytest.raises(ConfigError, match=r"another check \(lookups '\(not recorded\)', here None\)"):
        reused_ours(earlier, same, {}, CheckSpec())
    with pytest.raises(ConfigError, match="--ours-from: no such file"):
        reused_ours(tmp_path / "none.json", same, {}, CheckSpec())
    with pytest.raises(SystemExit):
        engine_check.main(["--engine", "vllm", "--run", "x", "--ours-from", str(earlier)])
    assert "--ours-from: llama.cpp checks only" in capsys.readouterr().err


def test_engine_check_command_names_the_artifacts_command_first():
    from benchmarks.engine_check import result_command

    argv = ["--engine", "llamacpp", "--artifacts", "bash make.sh", "--run", "r", "--artifacts=bash x.sh", "--result"]
    assert result_command("bash make.sh", argv) == (
        "bash make.sh && python -m benchmarks.engine_check --engine llamacpp --run r --result")
    assert result_command(None, ["--run", "r"]) == "python -m benchmarks.engine_check --run r"


def test_vllm_workers_run_offline_on_the_cores_asked_without_our_path(monkeypatch):
    """The vLLM-cpu engine's worker: vLLM's interpreter with -P (its folder off its path), offline, without our
    PYTHONPATH or an LD_PRELOAD; the engine table's rows ask for their own KV cache size and cores."""
    from drafter_train.engines.vllm_cpu import WORKER, vllm_env, worker_command

    monkeypatch.setenv("PYTHONPATH", "/repo")
    monkeypatch.setenv("LD_PRELOAD", "libiomp5.so")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = vllm_env()
    assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-3")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    command = worker_command("/venv/bin/python", WORKER, "--serve", "r.json")
    assert command[:2] == ["/venv/bin/python", "-P"] and command[2].endswith("/drafter_train/engines/vllm_cpu_worker.py")
    assert command[3:] == ["--serve", "r.json"]


def test_the_machine_line_names_the_cpu_what_it_lists_and_what_was_probed_usable():
    record = {"cpu": "Intel Xeon", "cpu_features": ["avx2", "avx512f", "amx_tile"], "torch_threads": 2,
              "load_average": [0.5, 0.4, 0.3],
              "usable": {"torch_capability": "AVX512", "amx": "refused by the kernel (errno 1)",
                         "bf16_matmul": "native (avx512_bf16)"}}
    assert make_results.machine_line(record) == (
        "Intel Xeon (lists avx2, avx512f, amx_tile; torch AVX512, AMX refused by the kernel (errno 1), bf16 matmul "
        "native (avx512_bf16)), 2 torch threads, load average 0.5")
    # a result file written before the probe says so rather than implying the listed extensions were used
    assert make_results.machine_line(MACHINE).startswith("Test CPU (usable extensions not probed), 2 torch threads")



def test_a_given_target_gguf_is_named_by_its_own_weight_type(tmp_path):
    """engine_check's llama.cpp row names the target file's weight type from its header, not the export default."""
    from argparse import Namespace

    import gguf
    import numpy as np

    from benchmarks.engine_check import write_llamacpp_result
    from drafter_train.gguf_file import file_type as weight_type
    from tests.gguf_edit import save_gguf

    for name, file_type in (("q4.gguf", gguf.LlamaFileType.MOSTLY_Q4_K_M), ("f32.gguf", gguf.LlamaFileType.ALL_F32),
                            ("none.gguf", None)):
        writer = gguf.GGUFWriter(tmp_path / name, "llama")
        if file_type is not None:
            writer.add_file_type(file_type)
        writer.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
        save_gguf(writer)
    assert [weight_type(tmp_path / n, "x") for n in ("q4.gguf", "f32.gguf", "none.gguf")] == ["q4_k_m", "f32", "unknown"]
    record = fake_llamacpp_check("eagle3", [0.5])
    record["llamacpp"].update(gguf_type="f16", kv_cache="f32")
    args = Namespace(result_name="x", prompts="test", tolerance=0.03, artifacts=None)
    path = write_llamacpp_result(record, args, tmp_path / "results")
    assert json.loads(path.read_text())["rows"][1][0] == "llama.cpp (f16, f32 KV cache, --spec-type draft-eagle3)"
    record["target_gguf"] = "/cache/target.llama.gguf"  # a given file: the title names its type (two checks apart)
    assert json.loads(write_llamacpp_result(record, args, tmp_path / "results").read_text())["title"] == (
        "The exported eagle3 drafter of SmolLM2-135M-Instruct served by llama.cpp (f16 target file)")


def test_the_llamacpp_verdict_says_when_output_was_not_compared(capsys):
    from benchmarks.engine_check import print_llamacpp_verdict

    result = {"llamacpp": {"per_position_acceptance": [0.2], "spec_tokens_per_s": 4.6}, "num_prompts": 14,
              "ours": {"per_position_acceptance": [0.2]}, "comparison": {"agree": True}, "ok": True}
    print_llamacpp_verdict(result, 0.03)
    assert "speculative output not compared with plain (--no-baseline); llama.cpp 4.6 tok/s" in capsys.readouterr().out
    result["llamacpp"].update(output_mismatches=[{"prompt": 3}], plain_tokens_per_s=5.0)
    print_llamacpp_verdict(result, 0.03)
    assert "differs from plain in 1 of 14 prompts; llama.cpp 4.6 tok/s with the drafter, 5.0 without" in \
        capsys.readouterr().out
    result["llamacpp"]["same_output_as_plain"] = {"near_ties": [{"near_tie": True}], "near_ties_shown": 1}
    print_llamacpp_verdict(result, 0.03)
    assert "differs from plain in 1 (near tie shown in 1) of 14 prompts" in capsys.readouterr().out


def test_pass_curve_prices_each_pass_against_its_own_step_and_the_fastest_plain_step(tmp_path, monkeypatch):
    """benchmarks.pass_curve: each file and layout timed once by llama-bench (stood in), its relative costs, and the
    ceiling of always-accepted drafts: the best n / cost(n), against the file's own step and the fastest step."""
    from benchmarks import pass_curve

    curves = {("q4_k_m", True): {1: 80.0, 2: 120.0, 4: 160.0},  # 4 tokens for 2 steps: ceiling 2.0
              ("q4_k_m", False): {1: 100.0, 2: 150.0, 4: 400.0},  # 2 tokens for 1.5 steps: 4/3
              ("f16", True): {1: 200.0, 2: 204.0, 4: 210.0},  # 4 / 1.05 against its own step; 4 * 80 / 210 overall
              ("f16", False): {1: 200.0, 2: 204.0, 4: 210.0}}
    timed = []

    def fake_bench(bin_dir, gguf, sizes, depth, repeats, threads, repack=True):
        timed.append((gguf.name, tuple(sizes), depth, repeats, threads, repack))
        return curves[(gguf.stem, repack)]

    monkeypatch.setattr(pass_curve, "bench_curve", fake_bench)
    monkeypatch.setattr(pass_curve, "target_files", lambda name, types: {
        "q4_k_m": tmp_path / "q4_k_m.gguf", **{t: tmp_path / f"{t}.gguf" for t in types}})
    monkeypatch.setattr(pass_curve, "write_result", lambda name, **kw: captured.update(name=name, **kw))
    captured: dict = {}
    pass_curve.main(["--types", "f16", "--tokens", "4,2", "--repetitions", "2"])
    assert timed == [(f, (1, 2, 4), 128, 2, 2, r) for f in ("q4_k_m.gguf", "f16.gguf") for r in (True, False)]
    assert captured["name"] == "pass_curve" and captured["columns"][3:6] == ["n=1", "n=2", "n=4"]
    rows = {(r[0], r[1]): r[2:] for r in captured["rows"]}
    assert rows[("q4_k_m", "repacked")] == pytest.approx([80.0, 1.0, 1.5, 2.0, 2.0, 2.0])
    assert rows[("q4_k_m", "as stored")] == pytest.approx([100.0, 1.0, 1.5, 4.0, 4 / 3, 4 / 3 * 80 / 100])
    assert rows[("f16", "repacked")] == pytest.approx([200.0, 1.0, 1.02, 1.05, 4 / 1.05, 4 * 80 / 210])


def test_results_that_share_a_title_are_headed_apart_by_their_machine(tmp_path):
    """The same benchmark run on two kinds of CPU (the served table on an AVX2 and an AVX-512 EPYC): two sections,
    each heading naming its CPU and what it lists; a title held by one result is left as it is."""
    results, docs, readme = tmp_path / "results", tmp_path / "results.md", tmp_path / "README.md"
    for name, features in (("served_a", ["avx2"]), ("served_b", ["avx2", "avx512f"]), ("served_c", ["avx2"])):
        write_result(name, title="Served", question="?", command="c", split="s", baseline="b",
                     columns=["decoder", "speedup"], rows=[["plain", 1.0]],
                     machine=dict(MACHINE, cpu_features=features), results_dir=results)
    fake_result(results, "kernels", "Kernels", [["default", 1.0]])
    assert make_results.main(["--results-dir", str(results), "--docs", str(docs), "--readme", str(readme)]) == 0
    page = docs.read_text()
    assert "## Served (Test CPU, avx2, avx512f)\n" in page
    # two of them on the same kind of CPU (the free rows and the trained ones): their file names too
    assert "## Served (Test CPU, avx2; served_a)\n" in page and "## Served (Test CPU, avx2; served_c)\n" in page
    assert "## Kernels\n" in page and "## Served\n" not in page


def test_make_results_renders_the_peer_trainer_rows_with_their_command(tmp_path):
    """benchmarks/peer_trainers.py's file: rows of dicts (trainer, settings, tokens, wall, engine, acceptance)."""
    results, docs, readme = tmp_path / "results", tmp_path / "results.md", tmp_path / "README.md"
    fake_result(results, "main_job", "The main job", [["product", 1.125]])
    row = {"trainer": "speculators", "settings": {"name": "defaults", "optimizer": "muon"}, "tokens_seen": 25000,
           "optimizer_steps": 50, "train_wall_s": 612.4, "engine": "vLLM-cpu", "acceptance_length": 1.16,
           "per_position_acceptance": [0.138, 0.019, 0.003], "output_identical_to_plain": True}
    record = {"title": "Peers", "question": "Whose drafter?", "command": "python -m benchmarks.peer_trainers --x 1",
              "split": "test split, first 24 prompts", "baseline": "plain", "machine": MACHINE, "kind": "test",
              "date": "2026-11-29", "data": {"peer_trainers": True}, "rows": [row]}
    (results / "peer_trainers.json").write_text(json.dumps(record))
    readme.write_text("<!-- results:start -->\n<!-- results:end -->\n")
    assert make_results.main(["--results-dir", str(results), "--docs", str(docs), "--readme", str(readme)]) == 0
    page = docs.read_text()
    assert ("| speculators | defaults: optimizer muon | 50 | 25000 | 612 | vLLM-cpu | 1.160 | 0.14 / 0.02 / 0.00 | "
            "True |") in page
    assert "`python -m benchmarks.peer_trainers --x 1`" in page and "peer_trainers.json" in page


def _reference_only_store(root):
    """A datagen.generate=false folder: the source's answers in reference_ids, none of the target's; record 1 has
    no answer."""
    from drafter_train.data.store import DatagenStore

    records = [{"prompt_index": i, "prompt": f"p{i}", "prompt_ids": [1, 2 + i], "response_ids": [],
                "reference_ids": [] if i == 1 else [10 + i] * 5} for i in range(5)]
    store = DatagenStore.open(str(root))
    store.start({"generation": {"store_topk": 0}}, [])
    store.write_shard(0, records, 0)


def test_peer_trainers_refuses_data_without_the_asked_answers_in_one_line_before_loading_the_target(tmp_path,
                                                                                                monkeypatch):
    from benchmarks import common, peer_trainers

    _reference_only_store(tmp_path / "data")
    monkeypatch.setattr(common, "load_target_and_prompts", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(SystemExit, match=r"no records with response_ids \(.*--response reference\)"):
        peer_trainers.main(["--data", str(tmp_path / "data"), "--output", str(tmp_path / "out"), "--trainers", "ours"])


def test_peer_trainers_refuses_a_peer_whose_venv_is_not_built_in_one_line_before_reading_anything(tmp_path,
                                                                                                 monkeypatch):
    """The peers' venvs default to .venv-<peer> in this checkout, which another clone lacks: asked for, a missing one
    is one line naming it, its variable and the set-up script, before the data is read; a peer whose rows are kept
    (a finished comparison) needs no venv."""
    from benchmarks import peer_trainers

    monkeypatch.setenv("DRAFTER_TRAIN_SPECULATORS_VENV", str(tmp_path / "no-venv"))
    monkeypatch.setattr(peer_trainers, "load_distill_dataset", lambda *a: pytest.fail("the data was read"),
                        raising=False)
    argv = ["--data", str(tmp_path / "no-data"), "--output", str(tmp_path / "out"), "--trainers", "ours,speculators",
            "--settings", "defaults"]
    with pytest.raises(SystemExit) as refused:
        peer_trainers.main(argv)
    assert str(refused.value) == (
        f"peer_trainers: speculators runs in its own venv and {tmp_path}/no-venv/bin/python is not there: build it "
        "with bash scripts/setup_peers.sh, or set $DRAFTER_TRAIN_SPECULATORS_VENV to one built elsewhere (or leave "
        "speculators out of --trainers)")
    kept = tmp_path / "out" / "speculators-defaults" / "rows.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("[]")
    with pytest.raises(Exception) as past:  # past the check: reading the (missing) data folder fails
        peer_trainers.main(argv)
    assert "runs in its own venv" not in str(past.value)


def test_peer_trainers_reference_rows_and_our_subset_are_the_same_records(tmp_path, monkeypatch):
    """--response reference: the peers' rows are prompt + the source's answer, records without one are skipped, and
    our trainer's subset holds exactly the records those rows came from and trains on their reference_ids."""
    from benchmarks import common, peer_trainers
    from drafter_train.data.store import load_distill_dataset
    from drafter_train.recipes import train as train_module

    _reference_only_store(tmp_path / "data")

    class Loaded(Exception):
        pass

    monkeypatch.setattr(common, "load_target_and_prompts", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    argv = ["--data", str(tmp_path / "data"), "--output", str(tmp_path / "out"), "--response", "reference",
            "--response-tokens", "10", "--trainers", "ours"]
    with pytest.raises(Loaded):  # the rows and the subset are written before the target loads
        peer_trainers.main(argv)
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert rows == [{"input_ids": [1, 2, 10, 10, 10, 10, 10], "loss_mask": [0, 0, 1, 1, 1, 1, 1]},
                    {"input_ids": [1, 4, 12, 12, 12, 12, 12], "loss_mask": [0, 0, 1, 1, 1, 1, 1]}]
    subset = load_distill_dataset(tmp_path / "out" / "data")
    assert subset["prompt_index"] == [0, 2] and subset["reference_ids"] == [[10] * 5, [12] * 5]

    trained = []
    monkeypatch.setattr(train_module, "train", trained.append)
    args = peer_trainers.parse(argv)
    args.layers = [0, 1, 2]  # main sets them from the target
    peer_trainers.train_ours(args, "embedded:smollm2", tmp_path / "out" / "data",
                             peer_trainers.SETTINGS[("ours", "defaults")], tmp_path / "ours", records=2)
    assert trained[0].train.response == "reference" and trained[0].train.max_steps == 1


def test_results_open_with_where_things_stand_each_figure_linking_its_section(tmp_path):
    """The standing table reads each question's current result file and links the section it came from."""
    results, docs = tmp_path / "results", tmp_path / "results.md"
    write_result("main_job", title="The main job", question="?", command="bash scripts/quickstart.sh", split="test",
                 baseline="plain decoding", columns=["decoder", "tau", "speedup", "acceptance per position"],
                 rows=[["the product", 1.6, 1.5, [0.5, 0.4]], ["EAGLE-3 alone, chain (top-1)", 1.4, 1.3, [0.45, 0.2]],
                       ["prompt + corpus lookup (no drafter)", 1.3, 1.2, [0.5, 0.5]]],
                 machine=MACHINE, results_dir=results)
    curve = ["variant", "response tokens", "dev acceptance 1", "test acceptance 1", "2 SE of diff"]
    write_result("ablations_recipe_100k", title="Ablations (2.5 tokens)", question="?", command="c", split="test", baseline="none",
                 columns=curve, rows=[["main-job", 100025, 0.30, 0.31, 0.0], ["ttt3", 100025, 0.35, 0.33, 0.04]],
                 machine=MACHINE, results_dir=results)
    make_results.main(["--results-dir", str(results), "--docs", str(docs), "--readme", str(tmp_path / "none.md")])
    page = docs.read_text()
    table = page[page.index("## Where things stand"):page.index("## The main job")]
    assert "tau 1.600, speedup 1.500 (1.250x the free lookups' 1.200); EAGLE-3's chain at first position 0.450" in table
    assert "best on dev: ttt3 (dev 0.350, test 0.330) against main-job (dev 0.300, test 0.310), 100k" in table
    assert "; margin 0.050, beyond two standard errors (0.040)" in table
    assert "[ablations_recipe_100k](#ablations-25-tokens)" in table and "## Ablations (2.5 tokens)" in page
