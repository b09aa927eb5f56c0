"""Run `dflash extract` with a fault injected at the zarr store's write layer (tests, soak).

    python tests/reliability/extract_faults.py EXTRACT_ARGS...

Every object a local store writes goes through zarr's `_put(path, value)` (write a
`*.partial` file, then rename). This launcher wraps it, counts the writes of this process
and, as the environment asks, at the Nth one:

- DFLASH_FAULT_KILL_AT_WRITE=N    SIGKILL just before the Nth write;
- DFLASH_FAULT_TORN_COMMIT=N      write half of the Nth part commit record (a write of
                                  `parts/NNNNN/zarr.json` carrying the record; the 1st of
                                  each part is its creation) to its `*.partial` file, then
                                  SIGKILL: the part's data is on disk, its record is not;
- DFLASH_FAULT_ERRNO=ENOSPC@N     the Nth write and every later one raise that OSError
                                  (the disk stays full / the directory stays read-only);
- DFLASH_FAULT_STALL_AT_COMMIT=N  before the Nth part commit record, print STALLED on
                                  stdout and block until a line arrives on stdin (the
                                  process holds that part while another one runs).

Test-only: dflash itself carries no fault hooks beyond writer.KILL_AFTER_ENV.
"""

import errno
import os
import re
import signal
import sys
import threading
import uuid
from pathlib import Path

KILL_AT_WRITE = "DFLASH_FAULT_KILL_AT_WRITE"
TORN_COMMIT = "DFLASH_FAULT_TORN_COMMIT"
ERRNO_AT_WRITE = "DFLASH_FAULT_ERRNO"
STALL_AT_COMMIT = "DFLASH_FAULT_STALL_AT_COMMIT"
FAULT_VARS = (KILL_AT_WRITE, TORN_COMMIT, ERRNO_AT_WRITE, STALL_AT_COMMIT)

_COMMIT_RECORD = re.compile(r"/parts/\d+/zarr\.json$")
_RECORD_KEY = b'"dflash_part"'  # store_schema.layout.PART_KEY as it appears in the JSON


class WriteCounter:
    """Counts store writes and part commit records, and fires the configured fault."""

    def __init__(self, env: dict):
        self.writes = 0
        self.commits = 0
        self._lock = threading.Lock()
        self.kill_at = int(env.get(KILL_AT_WRITE) or 0)
        self.torn_at = int(env.get(TORN_COMMIT) or 0)
        self.stall_at = int(env.get(STALL_AT_COMMIT) or 0)
        self.errno, self.errno_at = _parse_errno(env.get(ERRNO_AT_WRITE) or "")

    def before(self, path: Path, data: bytes) -> None:
        """Called before each write; may kill the process, raise, or block."""
        with self._lock:
            self.writes += 1
            n = self.writes
            # a part group's zarr.json is also rewritten while its arrays are created;
            # only a write carrying the commit record's attrs key is a commit
            is_commit = bool(_COMMIT_RECORD.search(path.as_posix())) and _RECORD_KEY in data
            self.commits += is_commit
            commit_n = self.commits if is_commit else 0
        if self.kill_at and n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.torn_at and commit_n == self.torn_at:
            torn = path.with_suffix(f".{uuid.uuid4().hex}.partial")
            torn.parent.mkdir(parents=True, exist_ok=True)  # as zarr's own write would
            with open(torn, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        if self.errno_at and n >= self.errno_at:
            raise OSError(self.errno, os.strerror(self.errno), str(path))
        if self.stall_at and commit_n == self.stall_at:
            print("STALLED", flush=True)
            sys.stdin.readline()


def _parse_errno(spec: str) -> tuple[int, int]:
    if not spec:
        return 0, 0
    name, _, at = spec.partition("@")
    return getattr(errno, name), int(at or 1)


def install(env: dict) -> WriteCounter:
    """Wrap zarr's local write so every store write passes through a WriteCounter."""
    import zarr.storage._local as local

    counter = WriteCounter(env)
    put = local._put

    def counted_put(path, value, exclusive=False):
        counter.before(Path(path), bytes(value.as_buffer_like()))
        return put(path, value, exclusive=exclusive)

    local._put = counted_put
    return counter


def main() -> None:
    install(os.environ)
    from dflash_train.extract.command import extract

    extract(args=sys.argv[1:], prog_name="dflash extract")


if __name__ == "__main__":
    main()
