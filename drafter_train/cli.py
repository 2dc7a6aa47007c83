"""What every console script shares: user errors as one line on stderr, no traceback."""

from __future__ import annotations

import contextlib
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
