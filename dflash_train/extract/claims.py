"""Exclusive claims on a store's parts (and on its creation), so two writers never share one.

Owns the claim rules for both kinds of store:
- local path: an flock on `<out>.locks/<name>.lock`; the kernel drops it when the process
  dies, so a killed writer never blocks its resume.
- object store (any fsspec URL, tested on S3): claim objects `<out>.claims/<name>.<gen>.json`
  written with a conditional create (S3 `If-None-Match: *`), so of two writers racing for
  the same generation exactly one succeeds. The highest generation is the claim; the
  winner lists the generations again and yields if a higher one exists. Generations only
  grow: a release marks the object released instead of deleting it, so a slow racer can
  never re-create a generation somebody already used and count as owner beside it.
  The holder rewrites its object every stale_after / 4 seconds (heartbeat).
  The top claim is abandoned, and the next writer takes generation + 1, when it is released,
  or its process is gone (same machine and pid namespace: checked at once), or its
  heartbeat is older than stale_after seconds (other machines: their clocks must agree to
  well within that), or the caller forces it (`DFLASH_FORCE_CLAIM=1`, for a run known dead).
Never touches the store's own keys: claims live beside the store, not in it.
"""

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_train.extract.errors import ExtractError

STALE_ENV = "DFLASH_CLAIM_STALE_S"
FORCE_ENV = "DFLASH_FORCE_CLAIM"
DEFAULT_STALE_S = 600.0
_POLL_S = 0.5  # how often a waiting claimer looks again (creation is seconds long)


def is_object_store(out: str) -> bool:
    return "://" in out and not out.startswith("file://")


@contextmanager
def exclusive(out: str, name: str, *, wait: bool, stale_after: float | None = None,
              force: bool | None = None) -> Iterator[None]:
    """Hold the claim `name` on store `out` for the block; ExtractError if another live
    writer holds it and `wait` is False (with `wait`, block until it is free)."""
    if not is_object_store(out):
        with _flock(out, name, wait=wait):
            yield
        return
    stale = stale_after_from_env() if stale_after is None else stale_after
    forced = os.environ.get(FORCE_ENV, "") not in ("", "0") if force is None else force
    claim = ObjectClaim.acquire(out, name, wait=wait, stale_after=stale, force=forced)
    beats = _Heartbeat(claim, stale)
    try:
        yield
    finally:
        beats.stop()
        claim.release()


def stale_after_from_env() -> float:
    """Seconds without a heartbeat after which another machine's claim is abandoned."""
    raw = os.environ.get(STALE_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_STALE_S
    except ValueError as e:
        raise ExtractError(f"{STALE_ENV}={raw!r} is not a number of seconds") from e
    if value <= 0:
        raise ExtractError(f"{STALE_ENV}={raw!r} must be positive")
    return value


@contextmanager
def _flock(out: str, name: str, *, wait: bool) -> Iterator[None]:
    """An flock on `<out>.locks/<name>.lock`; released when the process dies."""
    lock_dir = Path(out.removeprefix("file://").rstrip("/") + ".locks")
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError as e:
            raise ExtractError(f"{out}: {name} is being written by another process "
                               f"(lock {lock_dir / name}.lock)") from e
        yield
    finally:
        os.close(fd)


# -- object stores -------------------------------------------------------------------------


@dataclass
class ClaimRecord:
    """The body of one claim object."""

    owner: str
    """Random id of the claiming run (one per acquire)."""
    host: str
    """Hostname of the claiming process, for messages."""
    machine: str
    """Boot id + pid namespace: equal means a pid check on this machine is meaningful."""
    pid: int
    """Claiming process id."""
    pid_start: str | None
    """The process's start time (Linux /proc), so a reused pid is not taken for it."""
    generation: int
    """This claim's generation; the highest existing one is the claim."""
    heartbeat: float
    """Wall-clock time (seconds since the epoch) of the holder's last heartbeat."""
    state: str
    """'held' or 'released'."""


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _machine_id() -> str:
    boot = _read_text("/proc/sys/kernel/random/boot_id") or socket.gethostname()
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = "?"
    return f"{boot}/{pid_ns}"


def _pid_start(pid: int) -> str | None:
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # field 22 (starttime) counted after the ')' closing the command name
    return stat.rsplit(")", 1)[-1].split()[19]


def _process_gone(record: ClaimRecord) -> bool:
    """True when `record`'s process provably no longer runs (it ran on this machine)."""
    if record.machine != _machine_id():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, under another user
    return record.pid_start is not None and _pid_start(record.pid) != record.pid_start


def claims_dir(out: str) -> str:
    """Where the claims of store `out` live: beside it, `<out>.claims`."""
    base = out.rstrip("/")
    if "/" not in base.split("://", 1)[1]:
        raise ExtractError(f"--out {out} is a bucket root; put the store under a prefix "
                           "(e.g. s3://bucket/hs.zarr) so its part claims can live beside it")
    return base + ".claims"


def abandoned_reason(record: ClaimRecord, stale_after: float, now: float) -> str | None:
    """Why `record` no longer holds its claim, or None while it does."""
    if record.state == "released":
        return "released"
    if _process_gone(record):
        return f"process {record.pid} on this machine is gone"
    age = now - record.heartbeat
    if age > stale_after:
        return f"heartbeat {age:.0f} s old > {stale_after:g} s"
    return None


class ObjectClaim:
    """A held claim object; see the module doc for the protocol."""

    def __init__(self, fs, directory: str, out: str, name: str, record: ClaimRecord):
        self.fs, self.directory, self.out, self.name = fs, directory, out, name
        self.record = record
        self.lost = False
        self.lost_to: ClaimRecord | None = None  # the taker, when its record could be read
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        return _claim_path(self.directory, self.name, self.record.generation)

    @classmethod
    def acquire(cls, out: str, name: str, *, wait: bool, stale_after: float,
                force: bool = False) -> "ObjectClaim":
        import fsspec

        url = claims_dir(out)
        fs, directory = fsspec.core.url_to_fs(url)
        while True:
            claim = cls._try(fs, directory, out, name, stale_after, force)
            if isinstance(claim, ObjectClaim):
                return claim
            if claim is None:
                continue  # lost a race for a generation: look again at once
            if not wait:
                holder = claim
                raise ExtractError(
                    f"{out}: {name} is being written by {holder.host} pid {holder.pid} "
                    f"(claim {url}/{_claim_name(name, holder.generation)}, heartbeat "
                    f"{time.time() - holder.heartbeat:.0f} s ago). A claim is abandoned once "
                    f"its process is gone (same machine) or its heartbeat is older than "
                    f"{stale_after:g} s ({STALE_ENV}); set {FORCE_ENV}=1 to take it over now "
                    "if that run is known to be dead")
            time.sleep(_POLL_S)

    @classmethod
    def _try(cls, fs, directory: str, out: str, name: str, stale_after: float, force: bool
             ) -> "ObjectClaim | ClaimRecord | None":
        """The claim if taken; the live holder's record if not; None after a lost race."""
        gens = _generations(fs, directory, name)
        if gens:
            top = _read_record(fs, _claim_path(directory, name, gens[-1]))
            if top is None:
                return None  # deleted under us: list again
            if not force and abandoned_reason(top, stale_after, time.time()) is None:
                return top
        gen = gens[-1] + 1 if gens else 0
        record = ClaimRecord(owner=uuid.uuid4().hex, host=socket.gethostname(),
                             machine=_machine_id(), pid=os.getpid(),
                             pid_start=_pid_start(os.getpid()), generation=gen,
                             heartbeat=time.time(), state="held")
        path = _claim_path(directory, name, gen)
        try:
            fs.pipe_file(path, _encode(record), mode="create")
        except FileExistsError:
            return None
        later = [g for g in _generations(fs, directory, name) if g > gen]
        if later:
            # a slow racer re-creating a generation that cleanup had deleted: not ours
            _remove(fs, path)
            return None
        for g in gens:  # older generations are dead now; keep the listing short
            _remove(fs, _claim_path(directory, name, g))
        return cls(fs, directory, out, name, record)

    def beat(self) -> None:
        """Refresh the heartbeat, or note that a later generation took the claim over."""
        with self._lock:
            if self.lost:
                return
            later = [g for g in _generations(self.fs, self.directory, self.name)
                     if g > self.record.generation]
            if later:
                self.lost = True
                self.lost_to = _read_record(
                    self.fs, _claim_path(self.directory, self.name, later[-1]))
                return
            self.record.heartbeat = time.time()
            self.fs.pipe_file(self.path, _encode(self.record))

    def release(self) -> None:
        """Mark the claim released; ExtractError if it was taken over while held."""
        self.beat()
        with self._lock:
            if self.lost:
                who = self.lost_to
                taker = f"{who.host} pid {who.pid}" if who else "another writer"
                raise ExtractError(
                    f"{self.out}: {self.name} was taken over by {taker} "
                    f"while this process wrote it (no heartbeat for {STALE_ENV} seconds, or "
                    f"{FORCE_ENV}); check the part with `dflash store validate`")
            self.record.state = "released"
            self.fs.pipe_file(self.path, _encode(self.record))


class _Heartbeat:
    """A daemon thread calling claim.beat() every stale_after / 4 seconds until stopped."""

    def __init__(self, claim: ObjectClaim, stale_after: float):
        self.claim = claim
        self.done = threading.Event()
        self.interval = max(0.05, stale_after / 4)
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"claim-heartbeat-{claim.name}")
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.claim.beat()
            except Exception:  # a flaky request: the next beat retries; staleness is generous
                continue

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def _claim_name(name: str, gen: int) -> str:
    return f"{name}.{gen:08d}.json"


def _claim_path(directory: str, name: str, gen: int) -> str:
    return f"{directory}/{_claim_name(name, gen)}"


def _generations(fs, directory: str, name: str) -> list[int]:
    """Existing generations of claim `name`, ascending, listed fresh (no listing cache)."""
    fs.invalidate_cache(directory)
    try:
        paths = fs.ls(directory, detail=False)
    except FileNotFoundError:
        return []
    gens = []
    for p in paths:
        stem = p.rstrip("/").rsplit("/", 1)[-1]
        head, _, rest = stem.partition(".")
        gen, _, ext = rest.partition(".")
        if head == name and ext == "json" and gen.isdigit():
            gens.append(int(gen))
    return sorted(gens)


def _read_record(fs, path: str) -> ClaimRecord | None:
    try:
        return ClaimRecord(**json.loads(fs.cat_file(path)))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ExtractError(f"claim object {path} is not a dflash claim ({e}); delete it if "
                           "no extract is running") from e


def _encode(record: ClaimRecord) -> bytes:
    return json.dumps(asdict(record)).encode()


def _remove(fs, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
