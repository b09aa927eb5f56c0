"""What every benchmark's command line owes its user, as `dflash` itself does: where it will
write is checked before any work starts (a benchmark runs for minutes to hours; a bad --out
found at the end loses everything measured), and a package error (dflash_train.errors.
DflashError: a missing store, another target's drafter) ends the run with its one line and
exit status 1, never a traceback.

This module only checks paths and reports errors; it never measures anything.
"""

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

from dflash_train.errors import DflashError


def package_errors_as_one_line(main: Callable[[], None]) -> Callable[[], None]:
    """`main` with a DflashError turned into `Error: <its message>` on stderr and exit 1."""

    @functools.wraps(main)
    def guarded() -> None:
        try:
            main()
        except DflashError as e:
            raise SystemExit(f"Error: {e}") from None

    return guarded


def writable_dir(flag: str, path: Path) -> Path:
    """`path` as a directory this process writes into (created if missing), checked before
    anything runs; else exit with one line naming `flag` (a file there, a read-only disk)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise SystemExit(f"{flag} {path}: {existing} is a file, not a directory; choose "
                         f"another {flag}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise SystemExit(f"{flag} {path}: cannot write there ({e.strerror or e}); choose "
                         f"another {flag}") from e
    return path


def new_dir(flag: str, path: Path) -> Path:
    """`path` for a run that must start afresh (it is created later, by the run): refused
    with one line if anything is there already, or if its parent cannot hold it."""
    if path.exists() or path.is_symlink():
        raise SystemExit(f"{flag} {path}: already exists; this benchmark starts afresh in a "
                         f"new directory: choose another {flag} or remove it")
    writable_dir(flag, path.parent)
    return path


def writable_file(flag: str, path: Path) -> Path:
    """`path` as a file this process will write at the end (replaced if there): its folder
    is made and tried now, and a directory in its place is refused."""
    if path.is_dir():
        raise SystemExit(f"{flag} {path}: is a directory, not a file; choose another {flag}")
    writable_dir(flag, path.parent)
    return path
