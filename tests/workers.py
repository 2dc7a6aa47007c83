"""How the suite spreads over this machine's cores (pytest-xdist; `-n auto` set by tests/conftest.py for a run over
a folder).

The tiny-model tests are bound by single-threaded Python and transformers overhead: a second torch thread buys ~5 %
where a second process running other tests buys ~2x. So the suite runs one xdist worker per usable core, each with
`usable cores // workers` torch threads (1 when every core has its worker), and no workers at all on one core, where
they would only add their start-up. Imported by tests/conftest.py before torch."""

from __future__ import annotations

import os

# What a subprocess's torch / OpenMP / MKL read for their thread count (the 2-rank launches, the CLI runs).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a taskset or a container's cpuset), not the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call (macOS): every core
        return os.cpu_count() or 1


def choose_workers(cores: int) -> int:
    """xdist workers for `cores` usable cores: one per core, or 0 (xdist off: the tests run in pytest's own process)
    on a single core."""
    return cores if cores >= 2 else 0


def torch_threads(cores: int, workers: int) -> int:
    """Torch threads of each of `workers` processes sharing `cores` (workers 0: the one pytest process)."""
    return max(1, cores // max(1, workers))


def set_threads(environ=os.environ) -> int:
    """The thread count for this process (an xdist worker reads the worker count xdist set in its environment),
    written to the OpenMP / MKL variables its subprocesses inherit; returned for torch.set_num_threads."""
    threads = torch_threads(usable_cores(), int(environ.get("PYTEST_XDIST_WORKER_COUNT", "0")))
    for name in THREAD_VARS:
        environ[name] = str(threads)
    return threads
