"""The order of an epoch: which samples form each GLOBAL batch, from sample lengths alone.

The plan is computed from the stores' offsets (a few bytes per sample): parts are taken a
window at a time, their read units (runs of samples about one shard long) shuffled across the
window, and samples then drawn at random from a buffer bounded in tokens into global batches.
Because the plan never looks at hidden states, resuming at batch N replays it without reading
data, and every rank computes it without talking to the others (train/data.py takes each
rank's share). This module never reads a sample's data and never drops one as damaged: a
damaged sample keeps its place in the plan and is left out when its batch is read.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain

import numpy as np

from dflash_train.batching import padded_batches
from dflash_train.store_schema import Part
from dflash_train.store_schema.part import sample_spans
from dflash_train.train.loader_config import LoaderConfig


@dataclass(frozen=True)
class SampleRef:
    """Where a sample lives: store, part and index within the part."""

    store: int
    part: int
    index: int
    length: int
    unit: tuple[int, int] = (0, 0)
    """The read unit [first, last + 1) of samples it is read with."""


def plan_epoch(
    parts: list[tuple[int, Part]], cfg: LoaderConfig, epoch: int
) -> Iterator[list[SampleRef]]:
    """The global batches of one epoch, from sample lengths only."""
    rng = np.random.default_rng([cfg.seed, epoch])
    refs = chain.from_iterable(_shuffled_units(parts, cfg, rng))
    if cfg.grouping == "random":
        drawn = _random_draws(refs, cfg.shuffle_buffer_tokens, rng)
        yield from padded_batches(drawn, _ref_length, cfg.batch_tokens)
    else:
        yield from _by_length(refs, cfg, rng)


def _shuffled_units(parts: list[tuple[int, Part]], cfg: LoaderConfig,
                    rng: np.random.Generator) -> Iterator[list[SampleRef]]:
    """Read units (runs of samples) in random order, a window of parts at a time; a store
    weight repeats a unit or draws it with the weight's fractional chance."""
    weights = cfg.store_weights
    order = rng.permutation(len(parts))
    for w in range(0, len(order), cfg.part_window):
        units = []
        for store_i, part in (parts[i] for i in order[w : w + cfg.part_window]):
            lengths = part.sample_lengths()
            if cfg.max_length:
                lengths = np.minimum(lengths, cfg.max_length)
            weight = 1.0 if weights is None else weights[store_i]
            for a, b in sample_spans(lengths, part.store.shard_tokens):
                copies = int(weight) + int(rng.random() < weight - int(weight))
                units += [[SampleRef(store_i, part.index, s, int(lengths[s]), (a, b))
                           for s in range(a, b)]] * copies
        for u in rng.permutation(len(units)):
            yield units[u]


def _ref_length(ref: SampleRef) -> int:
    return ref.length


def _random_draws(refs: Iterator[SampleRef], keep: int, rng: np.random.Generator
                  ) -> Iterator[SampleRef]:
    """The samples in random order: each drawn at random from a buffer refilled to `keep`
    tokens, which is then emptied at the epoch's end."""
    buffer: list[SampleRef] = []
    buffered = 0  # tokens in buffer
    for ref in refs:
        buffer.append(ref)
        buffered += ref.length
        while buffered > keep and buffer:
            drawn = buffer.pop(int(rng.integers(len(buffer))))
            buffered -= drawn.length
            yield drawn
    while buffer:
        yield buffer.pop(int(rng.integers(len(buffer))))


def _by_length(refs: Iterator[SampleRef], cfg: LoaderConfig, rng: np.random.Generator
               ) -> Iterator[list[SampleRef]]:
    """Each time the buffer holds more than the shuffle buffer's tokens (and at the epoch's
    end), all of it in batches of samples sorted by length, yielded in random order."""
    buffer: list[SampleRef] = []
    buffered = 0  # tokens in buffer
    for ref in refs:
        buffer.append(ref)
        buffered += ref.length
        if buffered > cfg.shuffle_buffer_tokens:
            yield from _sorted_batches(buffer, cfg.batch_tokens, rng)
            buffer, buffered = [], 0
    yield from _sorted_batches(buffer, cfg.batch_tokens, rng)


def _sorted_batches(buffer: list[SampleRef], budget: int, rng: np.random.Generator
                    ) -> Iterator[list[SampleRef]]:
    by_length = sorted(buffer, key=_ref_length)  # stable: ties keep the random order
    batches = list(padded_batches(by_length, _ref_length, budget))
    for i in rng.permutation(len(batches)):
        yield batches[i]
