"""drafter_train/engines: the interface with a fake engine whose answers are known, drafter-eval eval.engine=... on
tiny local folders through that fake engine, the one-line refusals before anything heavy, and the target export
cached by its fingerprint. Nothing here starts a real engine (tests/test_engine_llamacpp.py does, opt-in)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from drafter_train.drafters.common.truncated import cut_from_target
from drafter_train.drafters.registry import all_kinds, get_kind
from drafter_train.engines.base import Served, acceptance_from_steps, tau_of
from drafter_train.engines.evaluate import (decode_interleaved, engine_metrics, evaluate_in_engine, print_engine,
                                            refuse_early)
from drafter_train.engines.llamacpp_server import decode_prompts, free_port, server_command
from drafter_train.errors import ConfigError
from tests.conftest import tiny_llama
from tests.stubs import VOCAB, compose_cfg, save_tiny

FAKE = Path(__file__).resolve().parent / "fake_llamacpp" / "build" / "bin"
# one prompt, 7 tokens: the prompt pass made the first (free), then verify steps accepting 2 of 2, 0 of 2, 1 of 2
# (3 + 1 + 2 = 6 tokens in 3 passes)
STEPS = [(2, 2), (0, 2), (1, 2)]


class FakeEngine:
    """An engine whose answers are known: plain decoding at 10 tok/s in round 1 and 12 in round 2, speculative at 8
    tok/s every round with STEPS; it records the order of its calls."""

    name = "fake"

    def __init__(self):
        self.calls, self.closed = [], False

    def decode(self, prompts, max_new_tokens, speculative):
        self.calls.append("spec" if speculative else "plain")
        tokens = [[1, 2, 3, 4, 5, 6, 7] for _ in prompts]
        if speculative:
            return Served(tokens=tokens, tokens_per_s=8.0, steps=list(STEPS) * len(prompts), free_tokens=len(prompts))
        plain_rounds = self.calls.count("plain")
        return Served(tokens=tokens, tokens_per_s=10.0 if plain_rounds == 1 else 12.0, free_tokens=len(prompts))

    def close(self):
        self.closed = True


def test_the_interface_on_a_fake_engine_gives_its_known_figures():
    engine = FakeEngine()
    plains, specs = decode_interleaved(engine, [[5, 6]], 8, rounds=2)
    assert engine.calls == ["plain", "spec", "plain", "spec"]  # interleaved: each round plain, then speculative
    ours = {"tau": 1.5, "per_position_acceptance": [0.5, 0.5]}
    got = engine_metrics("fake", specs, plains, draft_len=2, ours=ours)
    # position 1: accepted in 2 of 3 steps; position 2: reached in those 2, accepted in 1
    assert got["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 2])
    assert got["tau"] == pytest.approx(6 / 3) == tau_of(specs[0])
    assert got["implied_acceptance_length"] == pytest.approx(1 + 2 / 3 + 1 / 3)
    assert got["plain_tokens_per_s"] == 11.0 and got["spec_tokens_per_s"] == 8.0
    assert got["speedup_rounds"] == pytest.approx([0.8, 8 / 12]) and got["speedup"] == pytest.approx(8 / 11)
    assert got["tau_diff"] == pytest.approx(0.5) and got["per_position_diff"] == pytest.approx([1 / 6, 0.0])
    assert got["output_equals_plain"]
    assert got["same_output_as_plain"] == {"prompts": 1, "identical": 1, "differences": []}


class PartingEngine(FakeEngine):
    """The fake engine whose speculative output parts from plain at position 1 of prompt 1 (on token 1), with a
    plain server to replay (the stand-in llama-server: each position's own token at -0.5, token 1 0.25 behind it
    at position 0, 0.5 behind at position 1)."""

    def __init__(self, plain, tmp_path, replay=True):
        super().__init__()
        self.plain, self.log_dir = plain, tmp_path
        if replay:
            self.plain_command = lambda: server_command(FAKE, tmp_path / "t.gguf", None, None, 0, 1, free_port(),
                                                        False)

    def decode(self, prompts, max_new_tokens, speculative):
        served = super().decode(prompts, max_new_tokens, speculative)
        parted = [self.plain[0], self.plain[1][:1] + [1] + self.plain[1][2:]]
        return Served(tokens=parted if speculative else self.plain, tokens_per_s=served.tokens_per_s,
                      steps=served.steps, free_tokens=served.free_tokens)


def test_a_difference_from_plain_is_replayed_on_the_engines_plain_server(tmp_path, capsys):
    """drafter-eval in llama.cpp: an output that differs from plain is listed (prompt, first differing position)
    and replayed on the plain server for its margin; an engine with no replay (vLLM) lists it only."""
    prompts = [[1, 1], [2, 2]]
    plain = decode_prompts(server_command(FAKE, tmp_path / "t.gguf", None, None, 0, 1, free_port(), False),
                           tmp_path / "p.log", prompts, 8)["tokens"]
    assert all(len(o) >= 3 for o in plain)
    cfg = SimpleNamespace(max_new_tokens=8, engine_rounds=1, draft_len=2)
    got = evaluate_in_engine(PartingEngine(plain, tmp_path), prompts, cfg)
    same = got["same_output_as_plain"]
    assert not got["output_equals_plain"] and same["identical"] == 1 and same["prompts"] == 2
    assert same["differences"] == [{"prompt": 1, "first_difference": 1, "spec_len": len(plain[1]),
                                    "plain_len": len(plain[1])}]
    [tie] = same["near_ties"]
    # the replay reproduced plain's output; the 1-token step puts plain's token 0.5 ahead of token 1; the one-pass
    # replay asks the stand-in another prompt, which answers other tokens: no margin there, so no near tie shown
    assert tie["reproduced"] and tie["margin_stepwise"] == pytest.approx(0.5) and tie["other_rank"] == 2
    assert tie["margin_batched"] is None and not tie["near_tie"] and same["near_ties_shown"] == 0
    assert (tmp_path / "near_ties.log").is_file()
    print_engine(got)
    assert "identical to plain on 1/2 prompts (first differs at token 1; near ties shown in 0 of the 1 (margins " \
           "0.500))" in capsys.readouterr().out
    listed = evaluate_in_engine(PartingEngine(plain, tmp_path, replay=False), prompts, cfg)["same_output_as_plain"]
    assert listed["differences"] == same["differences"] and "near_ties" not in listed


def test_acceptance_counts_a_short_last_step_only_where_it_reached():
    # the last step drafted 1 token (the budget): it reaches position 1 only
    assert acceptance_from_steps([(2, 2), (1, 1)], 2)["reached_per_position"] == [2, 1]
    assert acceptance_from_steps([(2, 2), (1, 1)], 2)["per_position_acceptance"] == [1.0, 1.0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-eval")
    target = tiny_llama(vocab_size=VOCAB, num_layers=3)
    save_tiny(target, root / "target")
    save_tiny(cut_from_target(target, 1, share_weights=False), root / "drafter")
    (root / "prompts.txt").write_text("the cat sat on the mat\nthe dog ran\n")
    return root


def eval_job(folders, *overrides):
    return OmegaConf.to_object(compose_cfg("eval", [
        f"target.path={folders / 'target'}", "target.chat_template=false", f"drafter.path={folders / 'drafter'}",
        f"eval.prompts={folders / 'prompts.txt'}", f"eval.output={folders / 'out' / 'metrics.json'}",
        "eval.max_new_tokens=12", "eval.num_prompts=2", "eval.draft_len=2", "eval.baseline_kernels=same",
        *overrides]))


def test_drafter_eval_reports_the_engine_beside_ours(folders, monkeypatch, capsys):
    """eval.engine=llamacpp through a fake engine: started with the drafter's folder before the target loads, fed
    the same prompt ids, its figures in metrics.json beside ours with the difference, and printed."""
    from drafter_train.recipes import evaluate

    engine, seen = FakeEngine(), {}

    def start(name, cfg, drafter_dir, out, field, target, eos=()):
        seen.update(name=name, drafter=drafter_dir, field=field, target=target, draft_len=cfg.draft_len)
        return engine

    monkeypatch.setattr(evaluate, "refuse_early", lambda *args: "draft-simple")
    monkeypatch.setattr(evaluate, "start_engine", start)
    metrics = evaluate.run_eval_job(eval_job(folders, "eval.engine=llamacpp", "eval.engine_rounds=2"))
    assert seen == {"name": "llamacpp", "drafter": folders / "drafter", "field": "eval.engine=llamacpp",
                    "target": {"path": str(folders / "target"), "cache_dir": None}, "draft_len": 2}
    got = metrics["engine"]
    assert engine.calls == ["plain", "spec", "plain", "spec"] and engine.closed
    assert got["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 2]) and got["speedup"] == pytest.approx(8 / 11)
    assert got["ours"]["per_position_acceptance"] == metrics["per_position_acceptance"]
    assert got["tau_diff"] == pytest.approx(got["tau"] - metrics["tau"])
    assert json.loads((folders / "out" / "metrics.json").read_text())["engine"]["engine"] == "fake"
    evaluate.print_engine(got)
    out = capsys.readouterr().out
    assert "speedup over its own plain decoding 0.73x (rounds: 0.80x, 0.67x)" in out and "engine - ours" in out


def fake_llamacpp(root: Path) -> Path:
    """A llama.cpp folder with the files the refusals look for (nothing runs)."""
    (root / "build" / "bin").mkdir(parents=True)
    (root / "build" / "bin" / "llama-server").write_text("")
    (root / "llama.cpp").mkdir()
    (root / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    return root


def test_refusals_come_in_one_line_before_anything_heavy(folders, tmp_path, monkeypatch):
    from drafter_train.recipes import evaluate

    def heavy(*args, **kwargs):
        raise AssertionError("loaded a model before refusing")

    monkeypatch.setattr(evaluate, "load_target", heavy)
    monkeypatch.setenv("DRAFTER_TRAIN_LLAMACPP", str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="eval.engine=llamacpp: no llama-server .* scripts/setup_llamacpp.sh") as err:
        evaluate.run_eval_job(eval_job(folders, "eval.engine=llamacpp"))
    assert "\n" not in str(err.value)
    monkeypatch.setenv("DRAFTER_TRAIN_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(ConfigError, match="eval.engine=vllm: no vLLM interpreter .* scripts/setup_vllm.sh"):
        evaluate.run_eval_job(eval_job(folders, "eval.engine=vllm"))

    # a layout llama.cpp cannot run: EAGLE-3's per-layer fc_norm, refused from the drafter's config.json
    monkeypatch.setenv("DRAFTER_TRAIN_LLAMACPP", str(fake_llamacpp(tmp_path / "llcpp")))
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text(json.dumps({"model_type": get_kind("eagle3").model_type, "fc_norm": True,
                                                    "target_layers": [0, 1, 2]}))
    with pytest.raises(ConfigError, match="^eval.engine=llamacpp: llama.cpp's EAGLE-3 has no per-layer fc_norm"):
        evaluate.run_eval_job(eval_job(folders, "eval.engine=llamacpp", f"drafter.path={eagle3}"))
    from drafter_train.config import EvalConfig

    assert refuse_early("llamacpp", EvalConfig(), folders / "drafter", "eval.engine=llamacpp") == "draft-simple"


def test_kinds_without_an_engine_export_are_named_in_one_line():
    from drafter_train.engines.export import engine_method

    with_gguf = [k for k in all_kinds() if "gguf" in k.export_formats]
    assert {k.name for k in with_gguf} >= {"eagle3", "ar", "dflash"}
    for kind in all_kinds():
        if kind in with_gguf:
            assert engine_method(kind, "llamacpp", "f") == kind.engine_methods["gguf"]
            continue
        with pytest.raises(ConfigError, match=f"^f: .*drafter kind {kind.name}.* has no GGUF export for llama.cpp; "
                                              "kinds with one: "):
            engine_method(kind, "llamacpp", "f")


def test_engine_settings_are_checked_where_they_are_set():
    for overrides, words in ((["eval.engine=sglang"], "eval.engine"), (["eval.engine_gguf_type=q4"], "gguf_type"),
                             (["eval.engine=llamacpp", "eval.verify=sample"], "greedy chain")):
        with pytest.raises(ConfigError, match=words):
            OmegaConf.to_object(compose_cfg("eval", overrides))


def test_the_target_export_is_reused_by_its_fingerprint(tmp_path, monkeypatch):
    from drafter_train.engines import export

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"a": 1}')
    (target / "model.safetensors").write_bytes(b"x" * 10)
    converted = []

    def convert(root, model_dir, out_file, gguf_type, name):
        converted.append(gguf_type)
        Path(out_file).write_text(gguf_type)

    monkeypatch.setattr(export, "convert_typed", convert)
    first = export.cached_target_gguf(tmp_path, target, "f32", tmp_path / "cache")
    assert export.cached_target_gguf(tmp_path, target, "f32", tmp_path / "cache") == first
    assert converted == ["f32"] and first.read_text() == "f32"
    assert export.cached_target_gguf(tmp_path, target, "q8_0", tmp_path / "cache") != first  # another type
    (target / "config.json").write_text('{"a": 2}')  # another target
    assert export.cached_target_gguf(tmp_path, target, "f32", tmp_path / "cache") != first
    assert converted == ["f32", "q8_0", "f32"]


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint evaluation in the engine during training (train.eval_engine, train.best_by)


class CheckpointFake(FakeEngine):
    """A llama-server stand-in for checkpoint evaluation: the first checkpoint's drafter is accepted at every step,
    the second's never; plain decoding as FakeEngine's."""

    started: list = []

    def __init__(self, drafter_dir):
        super().__init__()
        self.bin_dir, self.target, self.drafter, self.spec_type = Path("bin"), Path("t.gguf"), drafter_dir, "draft-simple"
        CheckpointFake.started.append(self)

    def decode(self, prompts, max_new_tokens, speculative):
        served = super().decode(prompts, max_new_tokens, speculative)
        if speculative:
            accepted = 2 if len(CheckpointFake.started) == 1 else 0
            served.steps = [(accepted, 2)] * (6 // (accepted + 1)) * len(prompts)
            # drafting 0.5 ms a token, but the second evaluation ran beside other load: 100x as long
            served.draft_ms = 0.5 * 2 * len(served.steps) * (1 if len(CheckpointFake.started) == 1 else 100)
        return served


def test_best_follows_the_engine_and_metrics_hold_both_decoders(tiny_data, tmp_path, monkeypatch):
    from drafter_train.engines import evaluate, llamacpp_cost
    from tests.test_train import train_cfg

    CheckpointFake.started = []
    calibrations = []
    monkeypatch.setenv("DRAFTER_TRAIN_LLAMACPP", str(fake_llamacpp(tmp_path / "llcpp")))
    monkeypatch.setattr(evaluate, "start_engine", lambda engine, cfg, drafter_dir, *rest: CheckpointFake(drafter_dir))
    monkeypatch.setattr(llamacpp_cost, "server_curves", lambda *args: calibrations.append(args[-1]) or {
        "ms_1": 10.0, "kinds": {"ar": {"relative": {1: 1.0, 3: 1.5}}}})
    from drafter_train.recipes.train import train

    cfg = train_cfg(tiny_data, tmp_path, "train.eval_engine=llamacpp", "train.best_by=engine",
                    "train.eval_at_start=false", "eval.draft_len=2")
    train(cfg)
    run_dir = tmp_path / cfg.train.run_name
    assert len(CheckpointFake.started) == 2 and calibrations == [{"ar": (2,)}]  # step costs measured once per run
    assert [e.calls for e in CheckpointFake.started] == [["plain", "spec"], ["spec"]]  # plain decoding once per run
    first, second = (json.loads((run_dir / f"step-{n}" / "metrics.json").read_text()) for n in (3, 6))
    for metrics in (first, second):
        engine = metrics["engine"]
        assert {"tau", "per_position_acceptance", "predicted_speedup", "measured_speedup", "seconds"} <= set(engine)
        assert engine["ours"]["tau"] == metrics["tau"] and engine["tau_diff"] == pytest.approx(engine["tau"] - metrics["tau"])
    assert first["engine"]["predicted_speedup"] > second["engine"]["predicted_speedup"]
    # drafting is priced once per run (the first evaluation's 0.5 ms a token), not at the loaded second one's 50 ms
    assert second["engine"]["draft_ms_per_token"] == {"this_evaluation": pytest.approx(50.0), "priced_at": pytest.approx(0.5)}
    # every step of the second drafter makes 1 token at a verify cost of 1.5 plain steps, plus its drafting: priced at
    # 0.5 ms a token (0.05 plain steps) that is ~1 / 1.6; at the loaded 50 ms (5 plain steps) it would be ~1 / 11.5
    assert 0.5 < second["engine"]["predicted_speedup"] < 0.7
    for metrics in (first, second):  # where each evaluation's seconds went; they add up to its total
        stages = metrics["engine"]["seconds_by_stage"]
        assert set(stages) == {"export", "baseline", "speculative"}
        assert sum(stages.values()) == pytest.approx(metrics["engine"]["seconds"])
    assert (run_dir / "best").resolve().name == "step-3"  # the engine's ranking, whatever tau says
    tracked = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in tracked if "eval/engine_predicted_speedup" in r] == [3, 6]
    assert all("eval/tau" in r for r in tracked if "eval/engine_tau" in r)


def test_training_refuses_an_engine_layout_before_anything_loads(tiny_data, tmp_path, monkeypatch):
    from drafter_train.recipes import train as recipe
    from tests.test_train import train_cfg

    def heavy(*args, **kwargs):
        raise AssertionError("loaded a model before refusing")

    monkeypatch.setattr(recipe, "load_target", heavy)
    monkeypatch.setenv("DRAFTER_TRAIN_LLAMACPP", str(fake_llamacpp(tmp_path / "llcpp")))
    cfg = train_cfg(tiny_data, tmp_path, "drafter=eagle3", "drafter.path=new", "drafter.fc_norm=true",
                    "train.eval_engine=llamacpp")
    with pytest.raises(ConfigError, match="^train.eval_engine=llamacpp: llama.cpp's EAGLE-3 has no per-layer fc_norm"):
        recipe.train(cfg)
    monkeypatch.setenv("DRAFTER_TRAIN_LLAMACPP", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="scripts/setup_llamacpp.sh"):
        recipe.train(train_cfg(tiny_data, tmp_path, "train.eval_engine=llamacpp"))
    with pytest.raises(ConfigError, match="train.best_by"):
        train_cfg(tiny_data, tmp_path, "train.best_by=engine")


def test_runs_saved_before_engine_ranking_still_resume():
    from drafter_train.checkpoint import TrainState

    state = TrainState()
    state.load_state_dict({"step": 3, "tokens_seen": 10, "best_tau": 1.2, "best_step": 3})  # an older run's state
    assert state.best_engine_speedup == float("-inf") and state.best_step == 3


def test_prompts_can_be_chosen_by_category(tmp_path):
    from types import SimpleNamespace

    from drafter_train.data.prompts import prompt_ids
    from tests.stubs import word_tokenizer

    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in (
        ("the cat", "general"), ("def f", "code"), ("the dog", "general"), ("a big", "code"))))
    cfg = SimpleNamespace(chat_template=False)
    ids, categories = prompt_ids(word_tokenizer(), cfg, str(file), 2, ["code"])
    assert categories == ["code", "code"] and len(ids) == 2
    assert prompt_ids(word_tokenizer(), cfg, str(file), 3)[1] == ["general", "code", "general"]
    with pytest.raises(ConfigError, match="prompt categories math: no such prompts"):
        prompt_ids(word_tokenizer(), cfg, str(file), 2, ["math"])
