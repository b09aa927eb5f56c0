"""Reading ahead of the step: an iterator run in a background thread a few items ahead, its
errors re-raised in the consumer, and the thread stopped when the consumer stops reading.
Knows nothing of stores or batches beyond passing them through.
"""

import queue
import threading
from collections.abc import Iterator

from dflash_train.train.batch import Batch

PREFETCH_JOIN_S = 60.0
"""How long closing the loader waits for the batch its thread is building."""


def _put_unless_stopped(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put `item` on a bounded queue, giving up once the consumer has stopped reading: a
    plain blocking put would hold the thread (and the consumer's join) on a full queue."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def prefetch(batches: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """Run the iterator in a background thread, `depth` items ahead; re-raise its errors."""
    if depth <= 0:
        yield from batches
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def work():
        try:
            for item in batches:
                if not _put_unless_stopped(q, item, stop):
                    return
            _put_unless_stopped(q, done, stop)
        except BaseException as e:  # surfaced in the consumer, not lost in the thread
            _put_unless_stopped(q, e, stop)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # Wait for the batch it is building: a thread still inside torch or a codec when the
        # interpreter exits can abort the process after the run has finished.
        thread.join(timeout=PREFETCH_JOIN_S)
