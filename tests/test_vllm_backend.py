"""datagen.backend=vllm. Without vLLM: the real worker script (drafter_train/data/vllm_worker.py) runs under a
"python" whose `vllm` is a stand-in generating with transformers (tests/fake_vllm), so the protocol, shards, resume,
the settings check, sampling settings, stored top-k logits and every refusal are tested end to end. With vLLM (an
environment at $DRAFTER_TRAIN_VLLM_VENV, default .venv-vllm in the repo, as scripts/setup_vllm.sh builds it): the
real engine's data equals the HF backend's on a tiny Llama."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_train.config import DatagenConfig
from drafter_train.recipes import datagen
from drafter_train.recipes.datagen import load_distill_dataset, run_datagen
from drafter_train.data.sources import TrainPrompt
from drafter_train.data.vllm_backend import BackendError, VllmBackend, prompt_seed, sampling_params, to_continuation
from drafter_train.decoding.sampling import SamplingParams, logits_to_probs
from drafter_train.errors import ConfigError
from tests.conftest import REPO
from tests.stubs import VOCAB, WORDS, compose_cfg, run_cli, save_tiny
from tests.test_sampling_exactness import chi2_pvalue

FAKE_VLLM = Path(__file__).with_name("fake_vllm")
PROMPTS = [{"prompt": " ".join(WORDS[i : i + 1 + i % 5])} for i in range(14)]


def tiny_target(folder: Path) -> None:
    """Head size 32: vLLM's CPU attention has no kernels for the 16 of conftest.tiny_llama. A large init keeps
    greedy choices far from ties, so float differences between engines cannot flip a token."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_tiny(LlamaForCausalLM(config).eval(), folder)


def python_wrapper(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    tiny_target(root / "target")
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    # An interpreter whose `vllm` is the stand-in; `-S` (no site-packages) makes one that has no vLLM at all.
    fake = python_wrapper(root / "fake-python", f'PYTHONPATH="{FAKE_VLLM}" exec "{sys.executable}" "$@"')
    python_wrapper(root / "no-vllm-python", f'exec "{sys.executable}" -S "$@"')
    return root, fake


def job(folders, out, *overrides):
    root, fake = folders
    return OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={root / 'target'}", "target.chat_template=false", f"datagen.prompts={root / 'prompts.jsonl'}",
        f"datagen.output_dir={out}", "datagen.num_eval_prompts=2", "datagen.num_prompts=10",
        "datagen.max_new_tokens=12", "datagen.batch_size=3", "datagen.shard_size=4", f"datagen.vllm_python={fake}",
        *overrides,
    ]))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fake_engine_data_equals_the_hf_backends(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "calls.jsonl"))
    hf = run_datagen(job(folders, tmp_path / "hf", "datagen.store_topk=5"), progress=False)
    vllm = run_datagen(job(folders, tmp_path / "vllm", "datagen.store_topk=5", "datagen.backend=vllm",
                           "datagen.vllm.max_num_seqs=16"), progress=False)
    a, b = load_distill_dataset(hf).with_format("torch"), load_distill_dataset(vllm).with_format("torch")
    assert a.column_names == b.column_names
    for column in ("prompt_index", "prompt_ids", "response_ids", "reference_ids", "topk_ids"):
        assert all(torch.equal(x, y) for x, y in zip(a[column], b[column])), column
    for x, y in zip(a["topk_logits"], b["topk_logits"]):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)  # raw logits, like generate's output_logits
    assert any(r[-1] == 2 for r in b["response_ids"]) and any(len(r) == 12 for r in b["response_ids"])

    manifest = json.loads((vllm / "datagen.json").read_text())
    assert manifest["generation"]["backend"] == "vllm" and manifest["run"]["backend"] == "vllm"
    calls = records(tmp_path / "calls.jsonl")
    engine = dict(model=str(folders[0] / "target"), dtype="float32", seed=0, max_model_len=256 + 12,
                  tensor_parallel_size=1, enforce_eager=False, skip_tokenizer_init=True, max_num_seqs=16,
                  logprobs_mode="raw_logits", max_logprobs=20)
    assert [c["engine"] for c in calls if "engine" in c] == [engine] == [manifest["run"]["vllm"]["engine"]]
    requests = [c["request"] for c in calls if "request" in c]
    assert [len(r["prompts"]) for r in requests] == [4, 4, 2]  # a whole shard per request
    greedy = dict(max_tokens=12, temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=[2], detokenize=False,
                  logprobs=5, seed=None)
    assert all(p == greedy for r in requests for p in r["params"])
    # vLLM's log lines go to stdout: the worker keeps them off its answers and in the log file.
    assert "fake vLLM: a log line on stdout" in (vllm / "vllm-worker.log").read_text()


def test_sampled_settings_crash_and_resume(folders, tmp_path, monkeypatch):
    sampled = ("datagen.backend=vllm", "datagen.temperature=0.8", "datagen.top_p=0.9", "datagen.seed=3",
               "datagen.store_topk=3")
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_VLLM_CRASH_AT", "2")
    with pytest.raises(BackendError, match=r"^the vLLM worker \(.*fake-python\) exited with code 1 while generating: "
                                           r".* \(full log: .*vllm-worker.log\)$"):
        run_datagen(job(folders, tmp_path / "resumed", *sampled), progress=False)
    worker = records(tmp_path / "calls.jsonl")[0]["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)  # stopped, not left running
    assert len(load_distill_dataset(tmp_path / "resumed")) == 4
    monkeypatch.delenv("FAKE_VLLM_CRASH_AT")
    run_datagen(job(folders, tmp_path / "resumed", *sampled), progress=False)
    run_datagen(job(folders, tmp_path / "straight", *sampled), progress=False)
    resumed = load_distill_dataset(tmp_path / "resumed")
    assert resumed.to_list() == load_distill_dataset(tmp_path / "straight").to_list()

    # transformers' semantics sent as vLLM's: top_k 0 (off) is -1; each prompt has its own seed.
    requests = [c["request"] for c in records(tmp_path / "calls.jsonl") if "request" in c]
    params = [p for r in requests for p in r["params"]]
    assert {json.dumps(dict(p, seed=None)) for p in params} == {json.dumps(dict(
        max_tokens=12, temperature=0.8, top_k=-1, top_p=0.9, stop_token_ids=[2], detokenize=False, logprobs=3,
        seed=None))}
    by_prompt = {tuple(ids): p["seed"] for r in requests for ids, p in zip(r["prompts"], r["params"])}
    assert {by_prompt[tuple(row["prompt_ids"])] for row in resumed} == {prompt_seed(3, i) for i in range(10)}
    # The sampled token is outside the top 3 somewhere; vLLM returns it too, the worker keeps the top 3 only.
    assert all(len(row) == 3 and row == sorted(row, reverse=True) for r in resumed["topk_logits"] for row in r)
    assert any(t not in ids for r, k in zip(resumed["response_ids"], resumed["topk_ids"]) for t, ids in zip(r, k))


def test_several_answers_per_prompt_draw_each_with_its_own_seed(folders, tmp_path, monkeypatch):
    """datagen.samples_per_prompt: the copies of a prompt are seeded by prompt and answer (the first as before), so
    they differ from each other and a rerun redraws them."""
    sampled = ("datagen.backend=vllm", "datagen.temperature=1.0", "datagen.seed=3", "datagen.samples_per_prompt=3")
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "calls.jsonl"))
    data = load_distill_dataset(run_datagen(job(folders, tmp_path / "a", *sampled), progress=False))
    assert data["prompt_index"] == [i for i in range(10) for _ in range(3)]
    seeds = [p["seed"] for c in records(tmp_path / "calls.jsonl") if "request" in c for p in c["request"]["params"]]
    assert sorted(seeds) == sorted(prompt_seed(3, i, k) for i in range(10) for k in range(3))
    assert prompt_seed(3, 5, 0) == prompt_seed(3, 5)  # one answer per prompt: the seeds folders already have
    answers = [{tuple(a) for a in data["response_ids"][3 * i: 3 * i + 3]} for i in range(10)]
    assert sum(len(three) > 1 for three in answers) >= 8
    again = load_distill_dataset(run_datagen(job(folders, tmp_path / "b", *sampled), progress=False))
    assert again["response_ids"] == data["response_ids"]


def test_a_folder_resumes_only_with_its_backend(folders, tmp_path, monkeypatch):
    out = run_datagen(job(folders, tmp_path / "hf", "datagen.num_prompts=4"), progress=False)
    with pytest.raises(ConfigError, match=r"other settings \(generation.backend: 'hf' -> 'vllm'\)"):
        run_datagen(job(folders, out, "datagen.num_prompts=4", "datagen.backend=vllm"), progress=False)
    # A folder written before the backend was recorded was written by transformers: it resumes as hf.
    manifest = json.loads((out / "datagen.json").read_text())
    del manifest["generation"]["backend"]
    (out / "datagen.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(datagen, "generate_shard", lambda *a, **k: pytest.fail("a finished shard was redone"))
    run_datagen(job(folders, out, "datagen.num_prompts=4"), progress=False)
    with pytest.raises(ConfigError, match=r"generation.backend: 'hf' -> 'vllm'"):
        run_datagen(job(folders, out, "datagen.num_prompts=4", "datagen.backend=vllm"), progress=False)


@pytest.mark.parametrize(
    "overrides, env, error, message",
    [
        (("datagen.vllm_python=/no/such/python",), {}, ConfigError,
         r"^datagen.vllm_python: cannot run /no/such/python: No such file or directory$"),
        (("datagen.vllm_python={root}/no-vllm-python",), {}, ConfigError,
         r"^datagen.vllm_python: \S+ cannot import vllm; install it \(pip install drafter-train\[vllm\]\)"),
        (("datagen.store_topk=4",), {"FAKE_VLLM_OLD": "1"}, ConfigError,
         r"^datagen.store_topk: this vLLM cannot return raw logits \(its engine has no logprobs_mode\)"),
        (("+datagen.vllm.engine_args.seed=1",), {}, ConfigError,
         r"^datagen.vllm.engine_args.seed: drafter-datagen sets seed=0 itself"),
        (("+datagen.vllm.engine_args.no_such_setting=1",), {}, ConfigError,
         r"^datagen.vllm: vLLM's engine has no setting no_such_setting \(full log: "),
        (("target.path={root}/model.gguf",), {}, ConfigError, r"^target.path: datagen.backend=vllm loads HF model"),
        ((), {"FAKE_VLLM_FAIL_START": "CUDA out of memory"}, BackendError,
         r"^the vLLM engine did not start: ValueError: CUDA out of memory \(full log: .*vllm-worker.log\)$"),
    ],
)
def test_one_line_refusals(folders, tmp_path, monkeypatch, overrides, env, error, message):
    import gguf

    from tests.gguf_edit import save_gguf

    # a well-formed GGUF (the start-up check refuses a broken one before the backend is asked)
    save_gguf(gguf.GGUFWriter(str(folders[0] / "model.gguf"), "llama"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = job(folders, tmp_path / "out", "datagen.backend=vllm", *(o.format(root=folders[0]) for o in overrides))
    with pytest.raises(error, match=message):
        run_datagen(cfg, progress=False)


def test_cli_refusal(tmp_path):
    result = run_cli("drafter-datagen", "datagen.backend=vllm", "datagen.vllm_python=/no/such/python",
                     f"datagen.output_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "drafter-datagen: error: datagen.vllm_python: cannot run /no/such/python: No such file or directory"
    )


def test_sampling_params_follow_transformers_semantics():
    eos = [2, 7]
    greedy = sampling_params(DatagenConfig(max_new_tokens=9, top_k=5, top_p=0.5), eos)
    assert greedy == dict(max_tokens=9, stop_token_ids=eos, detokenize=False, temperature=0.0)  # top-k/p unused
    sampled = sampling_params(DatagenConfig(temperature=0.7, top_k=5, top_p=0.5, store_topk=8), eos)
    assert sampled == dict(max_tokens=128, stop_token_ids=eos, detokenize=False, temperature=0.7, top_k=5,
                           top_p=0.5, logprobs=8)
    assert sampling_params(DatagenConfig(temperature=1.0), eos)["top_k"] == -1  # off in both
    seeds = {prompt_seed(s, i) for s in range(3) for i in range(100)}
    assert len(seeds) == 300 and all(0 <= s < 2**63 for s in seeds)


def test_worker_answers_become_hf_columns():
    out = {"token_ids": [5, 2, 9], "topk_ids": [[5, 1], [2, 3], [9, 4]], "topk_logits": [[3.0, 1.0]] * 3}
    kept = to_continuation(out, {2}, 2)
    assert kept.response_ids == [5, 2] and kept.topk_ids == [[5, 1], [2, 3]] and len(kept.topk_logits) == 2
    assert to_continuation(out, {7}, 0).topk_ids is None
    with pytest.raises(BackendError, match=r"^datagen.store_topk: vLLM returned logprobs for 3/3 tokens, not 4"):
        to_continuation(out, {7}, 4)


def vllm_python() -> Path:
    return Path(os.environ.get("DRAFTER_TRAIN_VLLM_VENV") or REPO / ".venv-vllm") / "bin" / "python"


needs_vllm = pytest.mark.skipif(not vllm_python().exists(), reason="no vLLM environment (scripts/setup_vllm.sh)")


@pytest.fixture
def cpu_kv_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))  # GiB; CPU only


@pytest.mark.slow
@needs_vllm
def test_real_vllm_matches_the_hf_backend(folders, tmp_path, cpu_kv_cache):
    """Opt-in: runs where scripts/setup_vllm.sh built the environment (about a minute on 2 CPU cores)."""
    common = ("datagen.store_topk=5", "datagen.num_prompts=8")
    hf = load_distill_dataset(run_datagen(job(folders, tmp_path / "hf", *common), progress=False))
    out = run_datagen(job(folders, tmp_path / "vllm", *common, "datagen.backend=vllm",
                          f"datagen.vllm_python={vllm_python()}", "datagen.vllm.enforce_eager=true"), progress=False)
    real = load_distill_dataset(out)
    assert real["response_ids"] == hf["response_ids"] and real["topk_ids"] == hf["topk_ids"]
    for x, y in zip(real.with_format("torch")["topk_logits"], hf.with_format("torch")["topk_logits"]):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)  # raw logits, not log-probabilities
    assert json.loads((out / "datagen.json").read_text())["run"]["vllm"]["version"] != "unknown"


@pytest.mark.slow
@needs_vllm
def test_real_vllm_samples_with_transformers_semantics(folders, tmp_path, cpu_kv_cache):
    """The first token of 600 prompts with their own seeds against the exact distribution: temperature, then top_k
    and top_p on the scaled logits, as transformers (the HF backend) and drafter-eval sample."""
    params = SamplingParams(temperature=1.5, top_k=5, top_p=0.8)
    cfg = job(folders, tmp_path / "out", "datagen.backend=vllm", f"datagen.vllm_python={vllm_python()}",
              "datagen.vllm.enforce_eager=true", "datagen.max_new_tokens=1", f"datagen.temperature={params.temperature}",
              f"datagen.top_k={params.top_k}", f"datagen.top_p={params.top_p}")
    prompt = [1, 5, 9, 3]
    target = LlamaForCausalLM.from_pretrained(folders[0] / "target").eval()
    logits = target(torch.tensor([prompt])).logits[0, -1].detach()
    kept = [int((logits_to_probs(logits, p) > 0).sum()) for p in (
        params, dataclasses.replace(params, top_p=1.0), dataclasses.replace(params, top_k=0))]
    # Both rules cut, and top-p must read the top-k-renormalised probabilities (top-p alone would keep 6).
    assert kept == [4, 5, 6]
    exact = logits_to_probs(logits, params)
    with VllmBackend(cfg) as backend:
        outputs, _ = backend.generate([TrainPrompt(i, "", prompt, []) for i in range(600)])
    counts = torch.bincount(torch.tensor([o.response_ids[0] for o in outputs]), minlength=VOCAB).float()
    assert counts[exact == 0].sum() == 0  # nothing outside top-k / top-p
    assert chi2_pvalue(counts, exact) > 1e-3
