"""What every console script shares: user errors as one line on stderr, no traceback."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from drafter_train.errors import DrafterTrainError


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """Turn a DrafterTrainError into `prog: error: message` and exit status 2 (argparse's convention)."""
    try:
        yield
    except DrafterTrainError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        sys.exit(2)


def on_main_process() -> bool:
    """Whether this is the launch's main process: RANK 0 under `accelerate launch` / torchrun, or no launcher at all.

    Every rank runs the console script in the same run folder; what is written or printed once (Hydra's files, the
    final summary, a sweep's report) is done here, before and after any Accelerator exists.
    """
    return os.environ.get("RANK", "0") == "0"


def main_process_only(value, elsewhere=None):
    """Hydra resolver `${main_process_only:VALUE[,ELSEWHERE]}`: VALUE on the main process, ELSEWHERE on other ranks."""
    return value if on_main_process() else elsewhere
