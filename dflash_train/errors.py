"""The base of every package's one exception type, and how the CLI reports them.

Each stage raises its own error (StoreError, TargetError, ExtractError, TrainError, EvalError,
DrafterError, BlockError) naming what is wrong and where; all derive from DflashError, so a
command catches one type, and a new stage's error is caught without editing any command.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import click


class DflashError(Exception):
    """A user-facing error: the message names the file, option, row or sample at fault."""


@contextmanager
def reported_as_one_line() -> Iterator[None]:
    """Turn a DflashError into click's one-line message and exit status 1, no traceback."""
    try:
        yield
    except DflashError as e:
        raise click.ClickException(str(e)) from e
