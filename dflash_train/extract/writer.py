"""A background thread that appends samples to part writers while the next forward runs.

Owns the hand-off only: a bounded queue (so a slow disk throttles the GPU instead of filling
host memory) and error propagation. The first exception in the thread is re-raised in the
main thread on its next call; after it the thread drains the queue so the main thread never
blocks on a dead consumer.
"""

import os
import queue
import signal
import threading

from dflash_train.store_schema import PartWriter, Sample

FLUSH_SHARDS = 4
"""Shards extract buffers per part commit (PartWriter's flush_shards): fewer commits, each
with its fixed zarr metadata cost, for at most 3 more shards lost to a crash."""
KILL_AFTER_ENV = "DFLASH_EXTRACT_KILL_AFTER_SAMPLES"
"""Fault injection for the crash tests: SIGKILL this process after that many appends."""


class BackgroundWriter:
    """Runs PartWriter.append / finish on one thread, in submission order."""

    def __init__(self, max_pending: int = 4):
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)
        self._appended = 0
        self._thread = threading.Thread(target=self._run, name="dflash-writer", daemon=True)
        self._thread.start()

    def append(self, writer: PartWriter, samples: list[Sample]) -> None:
        self._put(("append", writer, samples))

    def finish(self, writer: PartWriter) -> None:
        self._put(("finish", writer, None))

    def wait(self) -> None:
        """Block until every queued write is done; re-raise the thread's error, if any.

        A part's claim must cover its writes, not only their submission: released earlier,
        another process could claim the part while this one still writes it.
        """
        self._queue.join()
        self._raise()

    def close(self) -> None:
        """Wait for every queued write; re-raise the thread's error, if any."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _put(self, item) -> None:
        self._raise()
        self._queue.put(item)

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._do(*item)
            except BaseException as e:  # noqa: B036 -- handed to the main thread, not swallowed
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _do(self, kind: str, writer: PartWriter, samples: list[Sample] | None) -> None:
        if kind == "finish":
            writer.finish()
            return
        for sample in samples:
            writer.append(sample)
            self._appended += 1
            if self._kill_after and self._appended >= self._kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
