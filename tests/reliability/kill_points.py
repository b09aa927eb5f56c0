"""SIGKILL a writer just before its Nth file operation under a directory, in a child process.

The kill tests of every unit dflash writes in pieces (a store's creation, a converted store, a
checkpoint, an export, an eval report) run the writer in a child and kill it at seeded random
moments. A child is forked from a server that imported torch, transformers and dflash once
(multiprocessing's forkserver), so a trial costs the writer's work, not an interpreter start.
In the child a Python audit hook sees every operation that changes a file under `root`:
open for writing, rename / replace, unlink, mkdir / rmdir, rmtree, chmod, truncate. A run
without a kill lists them (`Trial.events`), so kills can be drawn over the whole write; a run
with `kill_at=N` SIGKILLs itself just before the Nth. Bytes written by native code without
Python's file API (safetensors, pyarrow) are not operations here; the opens, renames and
removals around them are.
"""

import json
import multiprocessing
import os
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "torch._inductor", "sympy", "transformers", "tokenizers",
           "transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen3_5.modeling_qwen3_5", "zarr", "gguf", "pyarrow.parquet",
           "pandas", "matplotlib.pyplot",
           "dflash_train.cli", "dflash_train.extract.pipeline", "dflash_train.evaluate.pipeline",
           "dflash_train.train.run", "tests.reliability.kill_points"]
"""Imported once by the fork server, so that children start warm."""
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.rename": (0, 2), "os.remove": (0, 1), "os.rmdir": (0, 1),
                "os.mkdir": (0, 2), "shutil.rmtree": (0, 1), "os.chmod": (0, 2),
                "os.truncate": (0, None), "os.link": (0, 2), "os.symlink": (0, 2)}
"""Audit events that change a file: (index of the path argument, index of its dir_fd)."""
TIMEOUT_S = 240


@dataclass
class Trial:
    """How one child ended."""

    exitcode: int
    """0 for success; -9 when the kill fired (or when it was killed otherwise)."""
    events: list[str]
    """'event path' of each counted operation, in order; a killed child's end with the one
    it was killed before."""
    error: str
    """The traceback of an exception that ended the child, else ''."""


_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_child(fn: Callable, args: tuple, root: str | Path, kill_at: int | None = None,
              env: dict[str, str] | None = None) -> Trial:
    """fn(*args) in a fresh child (`fn` importable by name) with `env` set, SIGKILLed before
    its `kill_at`th file operation under `root` when given."""
    return start_child(fn, args, root, kill_at, env).wait()


def start_child(fn: Callable, args: tuple, root: str | Path, kill_at: int | None = None,
                env: dict[str, str] | None = None) -> "Child":
    """run_child without waiting for the end: `.wait()` returns the Trial."""
    handle, report = tempfile.mkstemp(prefix="kill_points-", suffix=".jsonl")
    os.close(handle)
    process = _forkserver().Process(target=_child, args=(
        fn, args, os.path.realpath(root), kill_at, env or {}, report))
    process.start()
    return Child(process, Path(report), f"{fn.__name__}{args}")


def events():
    """A new Event that children and this process share (a gate a child waits on)."""
    return _forkserver().Event()


@dataclass
class Child:
    """A child started by start_child."""

    process: multiprocessing.process.BaseProcess
    report: Path
    what: str

    def wait(self) -> Trial:
        self.process.join(TIMEOUT_S)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
            raise TimeoutError(f"{self.what} ran past {TIMEOUT_S} s")
        lines = [json.loads(line) for line in self.report.read_text().splitlines()]
        self.report.unlink()
        return Trial(self.process.exitcode, [line["event"] for line in lines if "event" in line],
                     "".join(line.get("error", "") for line in lines))


def _child(fn: Callable, args: tuple, root: str, kill_at: int | None, env: dict[str, str],
           report: str) -> None:
    os.environ.update(env)
    counter = _Counter(root, kill_at, os.open(report, os.O_WRONLY | os.O_APPEND))
    import sys

    sys.addaudithook(counter.hook)
    try:
        fn(*args)
    except SystemExit as e:
        if e.code not in (0, None):
            counter.report({"error": f"SystemExit({e.code})"})
        raise
    except BaseException:
        counter.report({"error": traceback.format_exc()})
        raise
    finally:
        counter.stop = True


class _Counter:
    """The audit hook: counts file-changing operations under `root`, kills at the Nth."""

    def __init__(self, root: str, kill_at: int | None, report_fd: int):
        self.root, self.kill_at, self.report_fd = root, kill_at, report_fd
        self.count = 0
        self.stop = False
        self.lock = threading.Lock()

    def report(self, line: dict) -> None:
        """One JSON line to the parent, written at once (os.write raises no audit event):
        what a killed child did is known up to its last operation."""
        os.write(self.report_fd, (json.dumps(line) + "\n").encode())

    def hook(self, event: str, args: tuple) -> None:
        if self.stop or (event != "open" and event not in _PATH_EVENTS):
            return
        path = self._changed_path(event, args)
        if path is None or not (path == self.root or path.startswith(self.root + os.sep)) \
                or "__pycache__" in path:
            return
        with self.lock:
            self.count += 1
            n = self.count
            self.report({"event": f"{event} {path}"})
        if n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def _changed_path(self, event: str, args: tuple) -> str | None:
        if event == "open":
            path, mode, flags = args
            writes = (flags & _WRITE_FLAGS) if isinstance(flags, int) and flags >= 0 else \
                any(c in (mode or "") for c in "wax+")
            return _absolute(path, None) if writes else None
        where, fd_at = _PATH_EVENTS[event]
        dir_fd = args[fd_at] if fd_at is not None and fd_at < len(args) else None
        return _absolute(args[where], dir_fd)


def _absolute(path, dir_fd) -> str | None:
    """`path` (str, bytes, path-like or an open fd) as an absolute path, else None."""
    try:
        if isinstance(path, int):
            return os.readlink(f"/proc/self/fd/{path}")
        path = os.fsdecode(path)
        if not os.path.isabs(path):
            base = os.readlink(f"/proc/self/fd/{dir_fd}") \
                if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
            path = os.path.join(base, path)
        return os.path.normpath(path)
    except (OSError, TypeError, ValueError):
        return None


def kill_points(events: list[str], rng, count: int, first: int = 1,
                last: int | None = None) -> list[int]:
    """`count` distinct operation numbers (1-based) drawn by `rng` from [first, last]."""
    last = len(events) if last is None else last
    return sorted(rng.sample(range(first, last + 1), min(count, last - first + 1)))


def tree(root: str | Path, skip: Callable[[str], bool] = lambda _: False) -> dict[str, bytes]:
    """Every file under `root` by relative path, with its bytes (`skip`: names to leave out)."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not skip(str(p.relative_to(root)))}


def tree_differences(got: dict[str, bytes], want: dict[str, bytes]) -> list[str]:
    """What differs between two tree() results: missing, extra, or other bytes, by path."""
    return ([f"missing {p}" for p in sorted(set(want) - set(got))]
            + [f"extra {p}" for p in sorted(set(got) - set(want))]
            + [f"differs {p}" for p in sorted(set(got) & set(want)) if got[p] != want[p]])
