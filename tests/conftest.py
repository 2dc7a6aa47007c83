"""Shared fixtures: tiny models built in-process, and the optional real stories260K model from ../shared."""

from __future__ import annotations

import json
import os

# Before any HF import: huggingface_hub reads HF_HUB_OFFLINE once, at import time.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

from tests.workers import choose_workers, set_threads, usable_cores  # noqa: E402

# This process's share of the cores, in the environment before torch loads (torch reads OMP_NUM_THREADS when it
# starts), and so in every subprocess the tests launch. torch and transformers load with the first test module, not
# here: xdist's controller runs no test and would otherwise pay their import before starting its workers.
THREADS = set_threads()

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
STORIES_DEFAULT = REPO.parent / "shared" / "models" / "stories260K"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Parallel by default over a folder: `-n auto --dist worksteal` unless the command line says otherwise (`-n 0`:
    one process; `-n auto` for named files).
    Set here rather than in pyproject's addopts so that pytest without pytest-xdist still runs (in one process).
    worksteal: each worker starts on its own contiguous half of the tests, so a module's fixtures are built about
    once, and a worker that runs dry takes over half of the other's remaining tests."""
    option = config.option
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):  # absent, or a worker itself
        return
    # Only for a run over a folder (the suite, tests/): a run of named files starts its tests sooner in one process
    # (workers add 5-8 s of start-up here).
    folders = any(Path(arg.split("::")[0]).is_dir() for arg in config.args)
    if folders and option.numprocesses is None and not option.tx and not option.distload:
        option.numprocesses = "auto"
        if option.dist == "no":
            option.dist = "worksteal"


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: pytest without it still runs
def pytest_xdist_auto_num_workers(config):
    """What `-n auto` means here: one worker per usable core, none on one core (tests/workers.py);
    $PYTEST_XDIST_AUTO_NUM_WORKERS still overrides, as in xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return choose_workers(usable_cores())


@pytest.fixture(autouse=True)
def _own_thread_share():
    """A test or the code it runs may set torch's threads (our decoder in the engine table takes llama.cpp's -t):
    each test starts on this process's share, so two workers never run 2 threads each on 2 cores."""
    import torch

    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


def tiny_llama(vocab_size: int = 64, num_layers: int = 4, seed: int = 0, init: float = 0.3) -> LlamaForCausalLM:
    """A 2-4 layer, hidden-64 Llama. A large init spreads the logits so greedy has no near-ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny target folder, a drafter with a different vocabulary, another target of the same shape, and
    drafter-datagen output for the target
    (prompts.jsonl, data/ with stored top-8 logits and held-out eval prompts)."""
    from tests.stubs import VOCAB, save_tiny

    root = tmp_path_factory.mktemp("train")
    save_tiny(tiny_llama(vocab_size=VOCAB + 3, num_layers=1), root / "other_vocab")
    save_tiny(tiny_llama(vocab_size=VOCAB, num_layers=3, seed=5), root / "other_target")
    return write_tiny_data(root, tiny_llama(vocab_size=VOCAB, num_layers=3))


def write_tiny_data(root: Path, target) -> Path:
    """`target` saved in root/target, and drafter-datagen output for it in root/data (prompts in root/prompts.jsonl)."""
    from omegaconf import OmegaConf

    from drafter_train.recipes.datagen import run_datagen
    from tests.stubs import SENTENCES, WORDS, compose_cfg, save_tiny

    save_tiny(target, root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{s} {w}"}) + "\n" for s in SENTENCES for w in WORDS[:8]))
    datagen = compose_cfg("datagen", [
        f"target.path={root / 'target'}", "target.chat_template=false", f"datagen.prompts={prompts}",
        "datagen.num_prompts=32", "datagen.num_eval_prompts=4", "datagen.max_new_tokens=16",
        f"datagen.output_dir={root / 'data'}", "datagen.store_topk=8",
    ])
    run_datagen(OmegaConf.to_object(datagen), progress=False)
    return root


@pytest.fixture
def make_tiny_llama():
    return tiny_llama


@pytest.fixture(scope="session")
def stories_path() -> Path:
    """../shared/models/stories260K, or $DRAFTER_TRAIN_STORIES260K; tests using it skip when it is absent."""
    path = Path(os.environ.get("DRAFTER_TRAIN_STORIES260K", STORIES_DEFAULT))
    if not (path / "config.json").exists():
        pytest.skip(f"stories260K not found at {path} (set DRAFTER_TRAIN_STORIES260K)")
    return path


@pytest.fixture(scope="session")
def stories_data(stories_path, tmp_path_factory) -> Path:
    """drafter-datagen output on stories260K (32 prompts x 32 tokens), made once a session: the stories260K training
    tests (tests/test_train.py stories_run) all train on these same records."""
    from omegaconf import OmegaConf

    from drafter_train.recipes.datagen import run_datagen
    from tests.stubs import compose_cfg

    root = tmp_path_factory.mktemp("stories_data")
    prompts = root / "p.txt"
    prompts.write_text("".join(f"{s} {i}\n" for i in range(12) for s in ("Once upon a time", "The little dog", "Lily saw")))
    datagen = compose_cfg("datagen", [
        f"target.path={stories_path}", "target.chat_template=false", f"datagen.prompts={prompts}",
        "datagen.num_prompts=32", "datagen.num_eval_prompts=4", "datagen.max_new_tokens=32",
        f"datagen.output_dir={root / 'data'}",
    ])
    run_datagen(OmegaConf.to_object(datagen), progress=False)
    return root / "data"


@pytest.fixture(scope="session")
def llamacpp_smoke() -> Path:
    """The llama.cpp build's smoke run (drafter_train.llamacpp.smoke_check), once a session, before any test that
    runs its tools: a build whose tools crash on this CPU fails those tests with its one line, not with a signal."""
    from drafter_train.errors import DrafterTrainError
    from drafter_train.llamacpp import llamacpp_dir, smoke_check

    try:
        return smoke_check(llamacpp_dir())
    except DrafterTrainError as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(autouse=True)
def _auto_precision_is_float32(monkeypatch):
    """train.mixed_precision=auto (the EAGLE-3 recipe's) measures a bf16 matmul at start and takes bf16 where it
    pays: on an AMX Xeon or an avx512_bf16 EPYC but not on an AVX2-only one. Tests of what auto decides patch the
    measurement themselves; every other test trains in float32 on every CPU kind, so its figures do not move with
    the machine the suite runs on."""
    from drafter_train import distributed

    monkeypatch.setattr(distributed, "bf16_matmul_speedup", lambda device: 1.0)
