"""Checkpoints that survive concurrency: ranks preparing one run folder at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from drafter_train.checkpoint import prepare_run_dir


# ---- many processes, one run folder ------------------------------------------------------------------------------


def test_ranks_preparing_one_run_folder_at_once_never_fail(tmp_path):
    """Every rank of a launch checks that the run folder is writable at the same moment. With one probe file name
    shared by all of them, one rank deleted it while another still used it: `cannot write ...: No such file`."""
    def prepare_many(root: str) -> list[str]:
        errors = []
        for _ in range(300):
            try:
                prepare_run_dir(root, "run", "auto")
            except Exception as err:  # noqa: BLE001 - any failure at all is the bug
                errors.append(str(err))
        return errors

    for attempt in range(3):  # a fresh folder each time, as for a new run
        with ThreadPoolExecutor(8) as pool:
            errors = [e for found in pool.map(prepare_many, [str(tmp_path / str(attempt))] * 8) for e in found]
        assert errors == [], errors[:3]
        assert [p.name for p in (tmp_path / str(attempt) / "run").iterdir()] == []  # no probe left behind
