"""The suite's spread over the cores (tests/workers.py): chosen from the usable cores at run time, never fixed."""

from __future__ import annotations

import os

import pytest
import torch

from tests.workers import THREAD_VARS, choose_workers, set_threads, torch_threads, usable_cores


def test_one_worker_per_usable_core_and_none_on_one_core():
    assert [choose_workers(cores) for cores in (1, 2, 3, 4, 16)] == [0, 2, 3, 4, 16]


def test_each_worker_gets_its_share_of_the_cores_and_at_least_one_thread():
    assert torch_threads(2, 2) == 1 and torch_threads(16, 16) == 1
    assert torch_threads(8, 2) == 4 and torch_threads(3, 2) == 1
    assert torch_threads(1, 0) == 1 and torch_threads(4, 0) == 4  # no xdist: the one process takes every core
    assert torch_threads(2, 4) == 1  # more workers than cores (-n 4 by hand): still one thread each


def test_usable_cores_follow_the_affinity_mask_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert usable_cores() == 3 and choose_workers(usable_cores()) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7}, raising=False)
    assert usable_cores() == 1 and choose_workers(usable_cores()) == 0


def test_subprocesses_inherit_the_share_and_this_process_runs_it(monkeypatch):
    # this very process runs what conftest chose for it, and so do the launches it makes
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    expected = torch_threads(len(os.sched_getaffinity(0)), workers)
    assert torch.get_num_threads() == expected and os.environ["OMP_NUM_THREADS"] == str(expected)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    env = {"PYTEST_XDIST_WORKER_COUNT": "3"}
    assert set_threads(env) == 2 and all(env[name] == "2" for name in THREAD_VARS)
    env = {}  # not a worker: the whole mask
    assert set_threads(env) == 6 and env["OMP_NUM_THREADS"] == "6"


def test_auto_asks_the_affinity_mask_at_run_time(pytestconfig, monkeypatch):
    """What `-n auto` resolves to in this suite (the conftest's xdist hook, called as xdist calls it)."""
    if not pytestconfig.pluginmanager.hasplugin("xdist"):
        pytest.skip("pytest-xdist is not installed or not loaded (-p no:xdist)")
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    for mask, workers in (({0, 3, 5}, 3), ({1}, 0), (set(range(12)), 12)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, mask=mask: mask, raising=False)
        assert pytestconfig.hook.pytest_xdist_auto_num_workers(config=pytestconfig) == workers
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")  # xdist's own override still works
    assert pytestconfig.hook.pytest_xdist_auto_num_workers(config=pytestconfig) == 5
