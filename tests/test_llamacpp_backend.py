"""datagen.backend=llamacpp (data/llamacpp_backend.py): against a stand-in llama-server (tests/fake_llamacpp) in the
default suite — records, per-record resume after a killed server, cut journal lines, the stop-token check, the
store_topk refusal — and (opt-in, where llama.cpp is built) on a tiny real GGUF: resume and agreement with the HF
backend."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from datasets import load_from_disk
from omegaconf import OmegaConf

from drafter_train.data.llamacpp_backend import JOURNAL, BackendError, request_body
from drafter_train.data.sources import TrainPrompt
from drafter_train.errors import ConfigError
from drafter_train.recipes.datagen import load_distill_dataset, run_datagen
from tests.stubs import SPECIALS, WORDS, compose_cfg, word_tokenizer
from tests.test_targets import tiny_llama, write_tiny_gguf

FAKE = Path(__file__).resolve().parent / "fake_llamacpp"
PROMPTS = [{"prompt": f"prompt number {i} says {'abc' * (i % 4)}"} for i in range(14)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp")
    write_tiny_gguf(root / "tiny.gguf")
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return root


def job(root: Path, out: Path, *overrides, llamacpp: Path = FAKE):
    return OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={root / 'tiny.gguf'}", "target.chat_template=false", f"datagen.prompts={root / 'prompts.jsonl'}",
        f"datagen.output_dir={out}", "datagen.num_eval_prompts=2", "datagen.num_prompts=12", "datagen.max_new_tokens=8",
        "datagen.shard_size=5", "datagen.backend=llamacpp", f"datagen.llamacpp.llamacpp={llamacpp}",
        "datagen.llamacpp.parallel=3", "datagen.llamacpp.threads=1", *overrides,
    ]))


def responses(out: Path) -> dict[int, list[int]]:
    data = load_distill_dataset(str(out))
    return {row["prompt_index"]: row["response_ids"] for row in data}


def requested(record: Path) -> list[list[int]]:
    return [json.loads(line)["prompt"] for line in record.read_text().splitlines()] if record.exists() else []


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_LLAMA_EOS", "258")  # the tiny GGUF's EOS (its last token)
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(tmp_path / "requests.jsonl"))
    return tmp_path / "requests.jsonl"


def fake_response(prompt: list[int], n_predict: int = 8) -> list[int]:
    body = [(sum(prompt) * 7 + i * 13) % 200 + 3 for i in range(sum(prompt) % 5 + 1)] + [258]
    return body[:n_predict]


def test_records_are_the_servers_responses_one_request_per_prompt(folders, tmp_path, fake_env):
    out = tmp_path / "data"
    run_datagen(job(folders, out), progress=False)
    got = responses(out)
    prompts = {row["prompt_index"]: row["prompt_ids"] for row in load_distill_dataset(str(out))}
    assert len(got) == 12 and got == {i: fake_response(prompts[i]) for i in got}
    assert sorted(map(tuple, requested(fake_env))) == sorted(tuple(p) for p in prompts.values())
    manifest = json.loads((out / "datagen.json").read_text())
    assert manifest["run"]["backend"] == "llamacpp" and manifest["run"]["llamacpp"]["parallel"] == 3
    assert manifest["run"]["eos_token_ids"] == [258]


def simulate_slots(choice, waiting: int, rate: dict) -> list[tuple[int, int]]:
    """Drive a SlotChoice over `waiting` prompts of 10 tokens each, a count of s slots making rate[s] tokens/s:
    the (slots, prompts) of every batch it planned."""
    batches = []
    while waiting:
        slots, take = choice.plan(waiting)
        batches.append((slots, take))
        choice.record(slots, take, 10 * take, 10 * take / rate[slots])
        waiting -= take
    return batches


def test_the_slot_count_is_chosen_by_measured_tokens_per_second():
    """1, 2, 4 ... slots, WAVES batches' worth of prompts each, while the rate rises; the rest at the fastest. Every
    prompt runs once, measured ones included (their answers are kept)."""
    from drafter_train.data.llamacpp_backend import WAVES, SlotChoice

    assert WAVES == 2
    falls = SlotChoice(8)  # 4 slots are slower than 2 (a compute-bound 2-core CPU): 8 is never tried
    assert simulate_slots(falls, 40, {1: 10.0, 2: 18.0, 4: 17.0}) == [(1, 2), (2, 4), (4, 8), (2, 26)]
    assert falls.chosen == 2 and [t["slots"] for t in falls.tried] == [1, 2, 4]
    assert falls.tried[1] == {"slots": 2, "prompts": 4, "tokens": 40, "seconds": pytest.approx(40 / 18, abs=1e-3),
                              "tokens_per_s": 18.0}
    rises = SlotChoice(6)  # rising all the way: the largest count, max_parallel itself (not a power of two)
    assert simulate_slots(rises, 40, {1: 10.0, 2: 18.0, 4: 30.0, 6: 40.0}) == [(1, 2), (2, 4), (4, 8), (6, 12),
                                                                               (6, 14)]
    assert rises.chosen == 6
    few = SlotChoice(8)  # too few prompts to measure 4 slots: the rest at the best so far, nothing chosen yet
    assert simulate_slots(few, 9, {1: 10.0, 2: 18.0}) == [(1, 2), (2, 4), (2, 3)] and few.chosen is None
    fixed = SlotChoice(8, 3)
    assert simulate_slots(fixed, 10, {3: 1.0}) == [(3, 10)] and fixed.tried == []


def test_datagen_measures_the_slot_count_on_its_first_prompts(folders, tmp_path, fake_env):
    """datagen.llamacpp.parallel=null: the server gets max_parallel slots, every prompt is asked once (the measured
    ones' answers are the records), and datagen.json says what was measured and chosen."""
    out = tmp_path / "data"
    run_datagen(job(folders, out, "datagen.llamacpp.parallel=null", "datagen.llamacpp.max_parallel=2"),
                progress=False)
    prompts = {row["prompt_index"]: row["prompt_ids"] for row in load_distill_dataset(str(out))}
    assert responses(out) == {i: fake_response(p) for i, p in prompts.items()} and len(prompts) == 12
    assert len(requested(fake_env)) == 12
    chosen = json.loads((out / "datagen.json").read_text())["run"]["llamacpp"]
    assert chosen["parallel_by"] == "measurement" and chosen["max_parallel"] == 2
    assert [t["slots"] for t in chosen["slot_counts"]][:1] == [1] and chosen["parallel"] in (1, 2)


def test_a_killed_server_resumes_per_record_and_a_cut_journal_line_is_regenerated(folders, tmp_path, fake_env,
                                                                                   monkeypatch):
    out = tmp_path / "data"
    monkeypatch.setenv("FAKE_LLAMA_DIE_AFTER", "7")  # dies inside the second shard
    with pytest.raises(Exception):
        run_datagen(job(folders, out), progress=False)
    journal = (out / JOURNAL).read_text().splitlines()
    before = len(requested(fake_env))  # answered before the kill; slots in flight at the kill may have answered too
    assert before == 7 and 5 <= len(journal) <= 7
    (out / JOURNAL).write_text("\n".join(journal[:-1]) + "\n" + journal[-1][:9])  # the last line cut by the kill
    whole = {json.loads(line)["prompt_index"] for line in journal[:-1]}
    # the first shard (5 prompts) was written before the kill; whether the kill left any of the second shard's answers
    # in the journal depends on which in-flight requests the dying server answered, so the cut line may be the first
    # shard's (kept in its shard folder) or the second's (asked again)
    shards = sorted(p for p in (out / "shards").glob("shard-*"))
    finished = {i for shard in shards for i in load_from_disk(str(shard))["prompt_index"]}
    assert len(shards) == 1 and len(finished) == 5
    monkeypatch.delenv("FAKE_LLAMA_DIE_AFTER")
    run_datagen(job(folders, out), progress=False)
    # Exactly the prompts in no finished shard and without a whole journal line were asked again (the cut line's
    # prompt among them unless its shard was finished).
    prompts = {row["prompt_index"]: row["prompt_ids"] for row in load_distill_dataset(str(out))}
    again = sorted(set(prompts) - finished - whole)
    assert sorted(requested(fake_env)[before:]) == sorted(prompts[i] for i in again)
    cut = json.loads(journal[-1])["prompt_index"]
    assert (cut in again) == (cut not in finished)
    assert responses(out) == {i: fake_response(p) for i, p in prompts.items()}


def test_an_answer_slower_than_request_s_stops_in_one_line_and_the_rerun_resumes(folders, tmp_path, fake_env,
                                                                                 monkeypatch):
    """A machine too busy to answer within datagen.llamacpp.request_s: one line naming the setting (the served
    pipeline's datagen died with urllib's TimeoutError traceback under load), and a rerun resumes."""
    out = tmp_path / "data"
    monkeypatch.setenv("FAKE_LLAMA_DELAY", "3")
    with pytest.raises(BackendError, match=r"^llama-server gave no answer to prompt \d+ within 1 s "
                                           r"\(datagen.llamacpp.request_s\): the answers so far are journaled") as err:
        run_datagen(job(folders, out, "datagen.llamacpp.request_s=1"), progress=False)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("FAKE_LLAMA_DELAY", "0")
    run_datagen(job(folders, out, "datagen.llamacpp.request_s=1"), progress=False)
    prompts = {row["prompt_index"]: row["prompt_ids"] for row in load_distill_dataset(str(out))}
    assert responses(out) == {i: fake_response(p) for i, p in prompts.items()}


def test_a_server_that_stops_on_other_tokens_is_refused_in_one_line(folders, tmp_path, fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_STOP_ON", "7")
    with pytest.raises(BackendError, match=r"^llama-server stopped on token 7, which is not in eos_token_ids \[258\]"):
        run_datagen(job(folders, tmp_path / "data"), progress=False)


def test_a_server_whose_end_of_generation_tokens_differ_is_refused_in_one_line(folders, tmp_path, fake_env,
                                                                              monkeypatch):
    """llama-server prints its end-of-generation ids as it loads: the same as ours passes, another set is one line."""
    monkeypatch.setenv("FAKE_LLAMA_EOG", "258")
    run_datagen(job(folders, tmp_path / "same"), progress=False)
    monkeypatch.setenv("FAKE_LLAMA_EOG", "257,258")
    with pytest.raises(BackendError, match=r"^llama-server ends generations on tokens \[257, 258\], datagen on "
                                           r"eos_token_ids \[258\]") as err:
        run_datagen(job(folders, tmp_path / "other"), progress=False)
    assert "\n" not in str(err.value)


def test_eos_ids_are_llamacpps_end_of_generation_set_for_a_qwen_vocabulary(tmp_path):
    """A Qwen2.5 GGUF declares only <|im_end|> as EOS; llama.cpp also ends on <|endoftext|> and its FIM pad / repo /
    file-separator tokens (found by their text in the GGUF's own vocabulary): so do datagen's eos_token_ids. Other
    special tokens are not; a token transformers adds to the tokenizer (not in the file) is not either."""
    from types import SimpleNamespace

    import gguf as gguf_package

    from drafter_train.data import llamacpp_backend
    from tests.gguf_edit import save_gguf

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>",
                "<|file_sep|>"]
    path = tmp_path / "qwen-vocab.gguf"
    writer = gguf_package.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", *specials, "c"])
    writer.add_eos_token_id(4)  # <|im_end|>
    writer.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    save_gguf(writer)
    got = llamacpp_backend.gguf_eos_ids(path, SimpleNamespace(eos_token_id=4))
    assert got == [2, 4, 6, 7, 8]  # <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>
    assert llamacpp_backend.gguf_eos_ids(path, SimpleNamespace(eos_token_id=10)) == [2, 4, 6, 7, 8, 10]


def test_store_topk_and_non_gguf_targets_are_refused(folders, tmp_path):
    with pytest.raises(ConfigError, match="^datagen.store_topk: not with datagen.backend=llamacpp: llama-server's "
                                          "n_probs are probabilities"):
        job(folders, tmp_path / "x", "datagen.store_topk=4")
    with pytest.raises(ConfigError, match="datagen.backend=llamacpp serves a GGUF file"):
        tiny_llama(len(SPECIALS) + len(WORDS)).save_pretrained(tmp_path / "hf")
        word_tokenizer().save_pretrained(tmp_path / "hf")
        run_datagen(job(folders, tmp_path / "x", f"target.path={tmp_path / 'hf'}"), progress=False)
    with pytest.raises(ConfigError, match="no llama-server in"):
        run_datagen(job(folders, tmp_path / "x", llamacpp=tmp_path), progress=False)


def test_sampled_requests_pin_the_samplers_and_seed_each_prompt():
    cfg = OmegaConf.to_object(compose_cfg("datagen", ["datagen.backend=llamacpp", "datagen.temperature=0.7",
                                                      "datagen.top_k=20", "datagen.top_p=0.9", "datagen.seed=3"]))
    prompt = TrainPrompt(index=5, text="x", prompt_ids=[1, 2, 3], reference_ids=[])
    body = request_body(cfg, prompt)
    assert body["samplers"] == ["top_k", "top_p", "temperature"] and body["min_p"] == 0.0
    assert (body["temperature"], body["top_k"], body["top_p"]) == (0.7, 20, 0.9)
    assert body["seed"] != request_body(cfg, TrainPrompt(6, "x", [1, 2, 3], []))["seed"]
    greedy = request_body(OmegaConf.to_object(compose_cfg("datagen", ["datagen.backend=llamacpp"])), prompt)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 1 and "seed" not in greedy


# ---------------------------------------------------------------------------------------------------------------
# Opt-in: the real llama-server on the tiny GGUF

LLAMACPP = Path(os.environ.get("DRAFTER_TRAIN_LLAMACPP", Path(__file__).resolve().parents[1] / ".llamacpp"))


@pytest.mark.slow
@pytest.mark.skipif(not (LLAMACPP / "build" / "bin" / "llama-server").is_file(),
                    reason="llama.cpp not built (scripts/setup_llamacpp.sh; $DRAFTER_TRAIN_LLAMACPP)")
def test_real_llama_server_agrees_with_the_hf_backend(folders, tmp_path):
    hf = tmp_path / "hf"
    run_datagen(job(folders, hf, "datagen.backend=hf", "datagen.batch_size=4"), progress=False)
    served = tmp_path / "llamacpp"
    run_datagen(job(folders, served, llamacpp=LLAMACPP), progress=False)
    ours, theirs = responses(hf), responses(served)
    assert ours.keys() == theirs.keys() and len((served / JOURNAL).read_text().splitlines()) == len(ours)
    same = sum(ours[i] == theirs[i] for i in ours)
    # float32 weights, but llama.cpp's f16 KV cache: near-ties may part; nearly every prompt agrees token for token.
    assert same >= len(ours) - 2, {i: (ours[i], theirs[i]) for i in ours if ours[i] != theirs[i]}


def test_a_taken_port_starts_the_server_again_on_another(tmp_path, fake_env):
    """free_port() names a port that was free when asked; another process binding it before llama-server does makes
    the server say so and exit: it is started again on another free port, and only its own /health counts."""
    import socket

    from drafter_train.llamacpp_http import complete, running_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [str(FAKE / "build" / "bin" / "llama-server"), "-m", "t.gguf", "--port", str(port)]
        with running_server(command, tmp_path / "s.log", startup_s=30) as url:
            assert not url.endswith(f":{port}")
            assert complete(url, [1, 2], 8)["tokens"] == fake_response([1, 2])
        with pytest.raises(RuntimeError, match="could not bind a port in 1 starts"):
            with running_server(command, tmp_path / "s.log", startup_s=30, attempts=1):
                pass


def test_an_engines_completion_waits_longer_the_more_tokens_it_asks_for(tmp_path, fake_env, monkeypatch):
    """The engines' /completion had a fixed 600 s limit: a long generation on a slow CPU overran it. The limit grows
    with the tokens asked (llamacpp_http.request_timeout), and past it the error is one line."""
    from drafter_train import llamacpp_http
    from drafter_train.llamacpp_http import ServerTimeout, complete, free_port, request_timeout, running_server

    assert request_timeout({"prompt": [1] * 100, "n_predict": 200}) == 120 + 0.5 * 100 + 5 * 200
    # scaled down: 0.5 s, plus 0.3 s a token to generate; the fake server answers after 1.5 s
    monkeypatch.setattr(llamacpp_http, "REQUEST_S", 0.5)
    monkeypatch.setattr(llamacpp_http, "REQUEST_S_PER_NEW_TOKEN", 0.3)
    monkeypatch.setattr(llamacpp_http, "REQUEST_S_PER_PROMPT_TOKEN", 0.0)
    monkeypatch.setenv("FAKE_LLAMA_DELAY", "1.5")
    command = [str(FAKE / "build" / "bin" / "llama-server"), "-m", "t.gguf", "--port", str(free_port())]
    with running_server(command, tmp_path / "s.log", startup_s=30) as url:
        with pytest.raises(ServerTimeout) as err:
            complete(url, [1, 2], 1)  # 0.8 s allowed
        assert str(err.value) == (f"llama-server gave no answer within 1 s to {url}/completion (2 prompt tokens, "
                                  "n_predict 1); the limit grows with the tokens asked "
                                  "(llamacpp_http.request_timeout): is the machine busy?")
        assert complete(url, [1, 2], 8)["tokens"] == fake_response([1, 2])  # 2.9 s allowed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's prctl")
def test_a_server_dies_with_the_process_that_started_it_even_when_that_one_is_killed(tmp_path, fake_env):
    """A drafter-datagen ended by SIGKILL (or SIGTERM, whose default skips finally blocks) leaves no llama-server
    behind holding its cores and port: the server is started with a death signal."""
    import signal
    import subprocess
    import time
    import urllib.request

    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys, time\nfrom pathlib import Path\nfrom drafter_train.llamacpp_http import free_port, running_server\n"
        f"command = [{str(FAKE / 'build' / 'bin' / 'llama-server')!r}, '-m', 't.gguf', '--port', str(free_port())]\n"
        f"with running_server(command, Path({str(tmp_path / 's.log')!r}), startup_s=30) as url:\n"
        "    print(url, flush=True)\n    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        url = parent.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
            assert reply.status == 200
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).close()
        except OSError:
            return  # nothing answers: the server is gone
        time.sleep(0.2)
    pytest.fail(f"llama-server still answers at {url} after its parent was killed")
