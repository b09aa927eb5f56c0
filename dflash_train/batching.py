"""Padded batches: the one rule by which extract, train and eval group sequences.

A batch is padded to its longest sequence, so what it costs is count x longest tokens; that
product must stay within a token budget. Owns only the grouping: it never reorders (the
callers choose the order: row order for extract's resume, length-sorted or shuffled for
train, store order for eval) and never reads a sequence.
"""

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def padded_batches(items: Iterable[T], length: Callable[[T], int], budget: int
                   ) -> Iterator[list[T]]:
    """Consecutive runs of `items`, each with count x longest `length` <= `budget`; an item
    longer than the budget gets a batch of its own. Lazy: a stream is consumed as it goes."""
    batch: list[T] = []
    longest = 0
    for item in items:
        n = length(item)
        if batch and (len(batch) + 1) * max(longest, n) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(item)
        longest = max(longest, n)
    if batch:
        yield batch
