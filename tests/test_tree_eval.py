"""Trees through the entry points: eval.tree configuration and its errors, tree metrics, sweeps over tree size and
their report, the trainer's checkpoint evaluation with a tree, and the calibration mode (prediction, pick,
calibration.json, the exported card)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.calibrate import calibrate, tree_shapes
from drafter_train.config import CalibrationConfig, EvalConfig, ExportConfig
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative
from drafter_train.decoding.tree import TreeSpec, build_topk_tree
from drafter_train.decoding.verify import make_tree_verifier, make_verifier
from drafter_train.errors import ConfigError
from drafter_train.recipes.evaluate import calibration_decoder, run_eval_job
from drafter_train.recipes.export import export
from drafter_train.recipes.report import collect, group_lines
from drafter_train.recipes.train import train
from tests.stubs import BigramLM, compose_cfg, run_cli
from tests.test_evaluate import folders, job  # noqa: F401  (module fixture)
from tests.test_export import tiny_run  # noqa: F401  (module fixture)
from tests.test_sampling_exactness import make_bigram_pair
from tests.test_train import train_cfg
from tests.test_trees import TableDrafter

TREE = ("eval.tree.top_k=2", "eval.tree.depth=3", "eval.tree.total_tokens=5")


# ---- configuration ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [
    (("eval.tree.top_k=0",), "eval.tree.top_k"),
    (("eval.tree.depth=3",), "eval.tree.top_k"),  # a tree shape without top_k
    (("eval.tree.top_k=2", "eval.tree.depth=0"), "eval.tree.depth"),
    (("eval.tree.top_k=2", "eval.tree.depth=4", "eval.tree.total_tokens=3"), "eval.tree.total_tokens"),
    (("eval.tree.top_k=2", "eval.tree.depth=2", "eval.tree.total_tokens=7"), "eval.tree.total_tokens"),
    (("eval.tree.top_k=2", "eval.tree.branching=beam"), "eval.tree.branching"),
    (("eval.tree.top_k=2", "eval.tree.branching=iid", "eval.tree.total_tokens=4"), "eval.tree.total_tokens"),
    (("eval.tree.top_k=2", "eval.tree.branching=iid"), "eval.tree.branching"),  # greedy over sampled drafts
    (("eval.tree.top_k=2", "eval.verify=specdec"), "eval.verify"),
    (("eval.verify=spectr",), "eval.verify"),
    (("eval.calibration.enabled=true", "eval.verify=specdec"), "eval.calibration.enabled"),
    (("eval.calibration.repeats=0",), "eval.calibration.repeats"),
    (("eval.tree.top_k=2", "eval.draft_exit=0.3"), "eval.draft_exit"),  # draft exit cuts chains only
    (("eval.calibration.enabled=true", "eval.draft_exit=0.3"), "eval.calibration.enabled"),
    (("eval.calibration.tree_sizes=[0,4]",), "eval.calibration.tree_sizes"),
])
def test_impossible_tree_settings_are_one_clear_error(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") + ":"):
        OmegaConf.to_object(compose_cfg("eval", list(overrides)))


def test_tree_settings_compose_for_eval_and_train():
    cfg = OmegaConf.to_object(compose_cfg("eval", ["eval.tree.top_k=4", "eval.draft_len=5"]))
    assert (cfg.eval.tree.enabled, cfg.eval.tree_depth, cfg.eval.tree.total_tokens) == (True, 5, None)
    cfg = OmegaConf.to_object(compose_cfg("eval", ["eval.verify=spectr", "eval.tree.top_k=3", "eval.tree.branching=iid"]))
    assert cfg.eval.samples
    cfg = OmegaConf.to_object(compose_cfg("train", ["eval.tree.top_k=2", "eval.tree.total_tokens=6"]))
    assert cfg.eval.tree.total_tokens == 6 and cfg.eval.tree_depth == cfg.drafter.draft_len


# ---- metrics, sweeps, the trainer ------------------------------------------------------------------------------------


def test_tree_metrics_record_shape_histogram_and_depths(folders):  # noqa: F811
    metrics = run_eval_job(job(folders, *TREE))
    assert metrics["tree"] == {"top_k": 2, "depth": 3, "total_tokens": 5, "branching": "topk"}
    assert metrics["greedy_match"] == 1.0 and metrics["draft_len"] == 3
    histogram = metrics["accepted_length_histogram"]
    assert len(histogram) == 4 and metrics["accepted_draft_tokens"] == sum(m * c for m, c in enumerate(histogram))
    assert len(metrics["per_position_acceptance"]) == 3
    assert 1 <= metrics["draft_tokens_per_step"] <= 5 and metrics["verify_ms_per_step"] > 0
    chain = run_eval_job(job(folders, "eval.draft_len=3"))
    assert chain["tree"] is None and len(chain["accepted_length_histogram"]) == 4
    sampled = run_eval_job(job(folders, "eval.verify=spectr", "eval.tree.top_k=3", "eval.tree.branching=iid"))
    assert sampled["greedy_match"] is None and sampled["tree"]["branching"] == "iid"


def test_eval_sweep_over_tree_size_is_reported_as_one_line(folders, tmp_path):  # noqa: F811
    sweep = tmp_path / "sweep"
    result = run_cli(
        "drafter-eval", "-m", "eval.tree.total_tokens=3,6", "eval.tree.top_k=2", "eval.tree.depth=3",
        f"target.path={folders / 'target'}", "target.chat_template=false", f"drafter.path={folders / 'drafter'}",
        f"eval.prompts={folders / 'prompts.txt'}", "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.warmup=0",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = group_lines(collect(sweep).results)
    (line,) = lines
    assert line.endswith("tree top_k=2 depth=3")
    assert [(p.draft_tokens, p.tree) for p in lines[line]] == [(3, "top_k=2 depth=3"), (6, "top_k=2 depth=3")]
    assert "| top_k=2 depth=3 | 6 |" in (sweep / "report.md").read_text()


def test_checkpoint_evaluation_can_use_a_tree(tiny_data, tmp_path):
    metrics = train(train_cfg(tiny_data, tmp_path, "train.max_steps=2", "train.save_every=2", *TREE))
    best = json.loads((tmp_path / "ar-fkl-k4" / "best" / "metrics.json").read_text())
    assert best["tree"]["total_tokens"] == 5 and metrics["tau"] == best["tau"] and best["greedy_match"] == 1.0


# ---- calibration --------------------------------------------------------------------------------------------------


def test_a_smaller_trees_acceptance_is_read_off_the_larger_trees_path():
    """In one context, greedy verification of the tree of total_tokens = n accepts exactly the accepted path's nodes
    of the larger tree that rank below n (what DecodeStats.accepted_within counts)."""
    target_table, draft_table = make_bigram_pair(vocab=8, seed=3)
    drafter, verify = TableDrafter(draft_table), make_tree_verifier("greedy", SamplingParams())
    for token in range(8):
        seq = torch.tensor([token])
        logits_of = lambda tree: target_table[torch.cat([seq, tree.tokens])]  # bigram target: row r after row r's token
        big = build_topk_tree(drafter, seq, TreeSpec(3, 4, 30), SamplingParams())
        path, _ = verify(big, logits_of(big))
        for n in range(4, 30):
            small = build_topk_tree(drafter, seq, TreeSpec(3, 4, n), SamplingParams())
            assert len(verify(small, logits_of(small))[0]) == sum(node < n for node in path)


def decode_all(target, drafter, prompts, c):
    greedy = SamplingParams()
    stats = []
    for prompt in prompts:
        if c.tree is None:
            out = generate_speculative(target, drafter, prompt, c.draft_len, make_verifier("greedy", greedy), 16)
        else:
            spec = TreeSpec(c.tree["top_k"], c.tree["depth"], c.tree["total_tokens"])
            out = generate_tree_speculative(target, drafter, prompt, spec, make_tree_verifier("greedy", greedy), 16)
        stats.append(out.stats)
    return stats


def test_calibration_candidates_come_from_their_runs():
    """A chain length or a shape's largest tree: exactly what decoding with it accepts and costs to draft; a smaller
    tree of a shape: the largest tree's steps, counted over its best nodes only."""
    target_table, draft_table = make_bigram_pair(vocab=8, seed=3)
    target, drafter = BigramLM(target_table), ARDrafter(BigramLM(draft_table))
    prompts = [[0], [3], [5, 1]]
    cfg = EvalConfig(max_new_tokens=16, calibration=CalibrationConfig(
        enabled=True, draft_lens=[1, 3], tree_top_k=[2, 3], tree_depth=[3], tree_sizes=[3, 5, 8, 12], repeats=2))
    candidates, costs = calibrate(target, prompts, cfg, calibration_decoder(target, drafter, prompts, [], cfg), False)
    by_name = {c.name: c for c in candidates}
    assert set(by_name) == {"chain draft_len=1", "chain draft_len=3"} | {
        f"tree top_k={k} depth=3 total_tokens={n}" for k, n in ((2, 3), (2, 5), (2, 8), (3, 3), (3, 5), (3, 8), (3, 12))}
    for name, largest in (("chain draft_len=1", None), ("chain draft_len=3", None), ("tree top_k=2 depth=3", 8),
                          ("tree top_k=3 depth=3", 12)):
        c = by_name[name if largest is None else f"{name} total_tokens={largest}"]
        runs = decode_all(target, drafter, prompts, c)
        steps = sum(s.proposals for s in runs)
        assert c.accepted_per_step == pytest.approx(sum(s.accepted for s in runs) / steps), c.name
        for n in (3, 5, 8, 12) if largest else ():
            if n <= largest:
                within = sum(s.accepted_within[n - 1] for s in runs) / steps
                assert by_name[f"{name} total_tokens={n}"].accepted_per_step == pytest.approx(within)
    for c in candidates:
        expected = c.predicted_tau * costs["ar_ms_per_token"] / (c.draft_ms + c.verify_ms)
        assert c.predicted_speedup == pytest.approx(expected)
        assert c.verify_ms == costs["verify_cost_ms"]["plain" if c.tree is None else "tree"][c.draft_tokens + 1]
    assert [c.predicted_speedup for c in candidates] == sorted((c.predicted_speedup for c in candidates), reverse=True)
    assert set(costs["verify_cost_ms"]["plain"]) == {1, 2, 4} and set(costs["verify_cost_ms"]["tree"]) == {4, 6, 9, 13}


def test_calibration_mode_picks_measures_and_records(tiny_run, tmp_path):  # noqa: F811
    """drafter-eval's calibration on a trained checkpoint: the pick is decoded for real and printed next to its
    prediction; calibration.json records it and the machine; drafter-export puts both in the card."""
    root, drafter_dir = tiny_run.parent.parent, tiny_run / "best" / "drafter"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\nthe dog ran\na big red house\nthe sun\nhappy day\nsmall blue tree\n")
    engines = tmp_path / "engines.json"  # another engine's cost curve: its prediction is printed and recorded too
    engines.write_text(json.dumps({"data": {"cost_curves": [{"engine": "llama.cpp", "precision": "q8_0", "ms_1": 5.0,
                                                             "relative": {"1": 1.0, "2": 1.5, "3": 2.0}}]}}))
    result = run_cli(
        "drafter-eval", f"target.path={root / 'target'}", "target.chat_template=false",
        "drafter=path", f"drafter.path={drafter_dir}", f"eval.prompts={prompts}", "eval.num_prompts=3",
        "eval.max_new_tokens=10", "eval.warmup=0", f"eval.output={tmp_path / 'metrics.json'}",
        "eval.calibration.enabled=true", "eval.calibration.num_prompts=2", "eval.calibration.draft_lens=[1,2]",
        "eval.calibration.tree_top_k=[2]", "eval.calibration.tree_depth=[2]", "eval.calibration.tree_sizes=[2,4]",
        "eval.calibration.repeats=2", f"eval.calibration.engine_costs={engines}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pick:" in result.stderr and "predicted speedup" in result.stderr and "measured" in result.stderr
    record = json.loads((tmp_path / "calibration.json").read_text())
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    pick = record["pick"]
    assert pick["name"] == record["candidates"][0]["name"] and len(record["candidates"]) == 4
    # measured over the baseline the prediction models (the target's own kernels), and over the fastest beside it
    assert pick["measured_speedup"] == metrics["speedup_same_kernels"] and metrics["calibration"]["name"] == pick["name"]
    assert pick["measured_speedup_over_fastest"] == metrics["speedup"]
    chains = {c["draft_len"]: c for c in record["candidates"] if c["tree"] is None}
    assert sorted(r["draft_len"] for r in record["engines"]) == [1, 2]  # the chains; trees are ours only
    for r in record["engines"]:
        c = chains[r["draft_len"]]
        expected = c["predicted_tau"] / ({1: 1.5, 2: 2.0}[r["draft_len"]] + c["draft_ms"] / record["ar_ms_per_token"])
        assert r["predicted_speedup"] == pytest.approx(expected)
    printed = " ".join(result.stderr.split())  # rich wraps the table to the terminal width
    assert "predicted speedup over their plain decoding" in printed and "llama.cpp q8_0" in printed, printed[-1500:]
    assert metrics["tree"] == pick["tree"] and metrics["draft_len"] == pick["draft_len"]
    assert record["calibration_prompts"] == "disjoint" and record["machine"]["logical_cores"] >= 1
    assert {"cpu", "device", "torch_threads", "dtype", "load_average"} <= set(record["machine"])

    out = tmp_path / "export"
    export(ExportConfig(run_dir=str(tiny_run), output_dir=str(out), calibration=str(tmp_path / "calibration.json")))
    card = (out / "README.md").read_text()
    assert "Draft length / tree size for this machine" in card and f"**{pick['name']}**" in card
    assert record["machine"]["cpu"] in card
    exported = json.loads((out / "calibration.json").read_text())
    assert "drafter" not in exported and exported["pick"] == pick
    with pytest.raises(ConfigError, match=r"export\.calibration: .*not this checkpoint"):
        export(ExportConfig(checkpoint=str(tiny_run / "step-1"), output_dir=str(tmp_path / "other"),
                            calibration=str(tmp_path / "calibration.json")))
    with pytest.raises(ConfigError, match=r"export\.calibration: cannot read"):
        export(ExportConfig(run_dir=str(tiny_run), output_dir=str(tmp_path / "x"), calibration=str(tmp_path / "no")))


# ---- the report plots tree-size sweeps ----------------------------------------------------------------------------


def write_eval_job(folder, draft_len, tree, tau, speedup):
    """A drafter-eval job folder as a `-m` sweep leaves it: metrics.json with its config and the measured tree."""
    folder.mkdir(parents=True)
    config = {"drafter": {"path": "d"}, "eval": {"draft_len": draft_len}}
    metrics = {"config": config, "tau": tau, "acceptance_rate": 0.5, "speedup": speedup, "draft_len": draft_len,
               "drafter_kind": "ar", "tree": tree}
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_report_plots_tree_size_sweeps_next_to_the_chains(tmp_path, monkeypatch):
    """One plot line per tree shape (x = total_tokens) beside the chain's (x = draft_len), with the measured tau and
    speedup, in the table as in the PNG."""
    from matplotlib.figure import Figure

    from drafter_train.config import TrackerConfig
    from drafter_train.recipes.report import write_report
    from tests.test_report import assert_valid_png, table_rows

    sweep = tmp_path / "sweep"
    shape = {"top_k": 2, "depth": 3, "branching": "topk"}
    points = {  # folder -> (draft_len, tree, tau, speedup)
        "chain-2": (2, None, 1.5, 1.1), "chain-4": (4, None, 1.75, 1.2),
        "tree-4": (3, {**shape, "total_tokens": 4}, 2.0, 1.3), "tree-8": (3, {**shape, "total_tokens": 8}, 2.5, 1.25),
        "iid-6": (2, {"top_k": 3, "depth": 2, "total_tokens": 6, "branching": "iid"}, 1.8, 1.05),
    }
    for name, point in points.items():
        write_eval_job(sweep / name, *point)
    figures = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), original(fig, *a, **k)))
    report = write_report(sweep, tmp_path / "out", TrackerConfig())
    assert_valid_png(report.plot)
    (fig,) = figures
    ax_tau, ax_speedup = fig.axes
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax_tau.get_lines()}
    speed = {line.get_label(): list(line.get_ydata()) for line in ax_speedup.get_lines() if line.get_label()[0] != "_"}
    assert drawn == {"drafter=d, kind=ar": ([2, 4], [1.5, 1.75]),
                     "drafter=d, kind=ar, tree top_k=2 depth=3": ([4, 8], [2.0, 2.5]),
                     "drafter=d, kind=ar, tree top_k=3 depth=2 iid": ([6], [1.8])}
    assert speed["drafter=d, kind=ar, tree top_k=2 depth=3"] == [1.3, 1.25]
    rows = {(r["tree"], r["draft_tokens"]): r for r in table_rows(report.markdown.read_text())}
    assert set(rows) == {("-", "2"), ("-", "4"), ("top_k=2 depth=3", "4"), ("top_k=2 depth=3", "8"),
                         ("top_k=3 depth=2 iid", "6")}
    assert rows["top_k=2 depth=3", "8"]["tau"] == "2.500" and rows["top_k=2 depth=3", "8"]["draft_len"] == "3"


# ---- calibration with an injected cost curve: the pick follows the machine, and is decoded for real ---------------


def steep(n):  # a machine where every extra verified token costs a lot (the drafter's ms are negligible beside it)
    return 1000.0 * n ** 3


def flat(n):  # a GPU-like machine: 1 to 32 tokens cost the same (drafter ms are noise beside it)
    return 1e6


@pytest.mark.parametrize("cost", [steep, flat])
def test_calibration_pick_follows_the_cost_curve_and_is_measured_for_real(folders, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                                          cost):
    """With the cost curve injected (the acceptance and drafter ms still measured), the prediction is the module's
    formula over it, the pick is its best, and a steep curve picks the shortest chain while a flat one picks the
    setting that accepts most. The pick is then decoded on the evaluation prompts: its measured tau is what
    evaluating that setting directly gives, and both numbers are printed side by side."""
    import drafter_train.calibrate as calibrate_module

    def curve(target, prefix, plain, tree, repeats):
        return {"plain": {n: cost(n) for n in plain}, "tree": {n: cost(n) for n in tree}}

    monkeypatch.setattr(calibrate_module, "verify_cost_curve", curve)
    cal = ("eval.calibration.enabled=true", "eval.calibration.num_prompts=2", "eval.calibration.draft_lens=[1,3]",
           "eval.calibration.tree_top_k=[2]", "eval.calibration.tree_depth=[3]", "eval.calibration.tree_sizes=[4,6]",
           "eval.calibration.repeats=1", "eval.num_prompts=2", "eval.warmup=0")
    capsys.readouterr()
    metrics = run_eval_job(job(folders, *cal, f"eval.output={tmp_path / 'metrics.json'}"))
    printed = capsys.readouterr().err
    record = json.loads((tmp_path / "calibration.json").read_text())
    candidates, pick = record["candidates"], record["pick"]
    assert {c["name"] for c in candidates} == {"chain draft_len=1", "chain draft_len=3", "tree top_k=2 depth=3 "
                                               "total_tokens=4", "tree top_k=2 depth=3 total_tokens=6"}
    for c in candidates:
        assert c["verify_ms"] == cost(c["draft_tokens"] + 1)
        assert c["predicted_speedup"] == pytest.approx((1 + c["accepted_per_step"]) * cost(1)
                                                       / (c["draft_ms"] + cost(c["draft_tokens"] + 1)))
    assert pick["name"] == max(candidates, key=lambda c: c["predicted_speedup"])["name"]
    if cost is steep:
        assert pick["name"] == "chain draft_len=1"
    else:
        assert pick["predicted_tau"] == max(c["predicted_tau"] for c in candidates)
        shortest = next(c for c in candidates if c["name"] == "chain draft_len=1")
        assert pick["predicted_tau"] > shortest["predicted_tau"]  # so the two machines get different picks
    # the pick decoded for real: the same tau as evaluating that setting by hand, printed beside the prediction
    setting = ([f"eval.draft_len={pick['draft_len']}"] if pick["tree"] is None else
               [f"eval.tree.{key}={pick['tree'][key]}" for key in ("top_k", "depth", "total_tokens")])
    direct = run_eval_job(job(folders, "eval.num_prompts=2", "eval.warmup=0", f"eval.output={tmp_path / 'd.json'}",
                              *setting))
    assert metrics["tau"] == direct["tau"] == pick["measured_tau"] and metrics["greedy_match"] == 1.0
    assert metrics["tree"] == direct["tree"] and metrics["draft_len"] == direct["draft_len"]
    assert (f"pick: {pick['name']}: predicted speedup {pick['predicted_speedup']:.3f}, measured "
            f"{pick['measured_speedup']:.3f}") in " ".join(printed.split())


def test_default_calibration_shapes_include_sibling_trees():
    """Depth-1 trees (the drafter's top-k as siblings) are candidates by default, with every size they can hold; deeper
    shapes only get sizes at least as large as their depth."""
    shapes = {(spec.top_k, spec.depth): (spec.total_tokens, sizes) for spec, sizes in tree_shapes(CalibrationConfig())}
    assert shapes[2, 1] == (2, [2]) and shapes[4, 1] == (4, [2, 3, 4])
    assert shapes[2, 4] == (12, [4, 6, 8, 12]) and shapes[4, 6] == (32, [6, 8, 12, 16, 24, 32])
