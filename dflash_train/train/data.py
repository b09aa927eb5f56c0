"""Stream a store into padded training batches: deterministic, rank-disjoint, bounded memory.

The order of an epoch is a PLAN computed from sample lengths alone (the stores' offsets, a few
bytes per sample): parts are opened lazily a window at a time, their read units (runs of
samples about one shard long) shuffled across the window, and samples then drawn at random
from a buffer bounded in tokens into GLOBAL batches. Rank r of W takes samples r, r+W, ... of
each global batch, so a run on W ranks sees exactly the batches of a run on one. Because the
plan never looks at hidden states, resuming at batch N replays it without reading data, and
every rank computes it without talking to the others. Data is read per sample; the sharded
context array makes that a read of only the inner chunks the sample covers.

Damage. Before planning, the stores get a structural check that reads no chunk data
(store_schema.check_before_reading); while reading, a sample whose bytes fail their checksum
is named by store, part and sample. Either refuses the store, unless `skip_corrupt` is set:
then a damaged sample is dropped from its batch AFTER planning and reported in
`Batch.skipped`. The plan (which samples form global batch N, which rank reads each) stays the
one computed from offsets alone, so every other sample keeps its batch, rank and step, with or
without the damage, and resume replays it exactly. Only a part whose metadata is unreadable
(no offsets to plan from) leaves the plan; the damage list is computed once per process from
the store, identically on every rank, and handed to DataLoader workers rather than recomputed.

Never touches labels or noise: a batch carries the stored arrays as they are.
"""

import ctypes
import math
import os
import queue
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Literal

import numpy as np
import torch

from dflash_train.batching import padded_batches
from dflash_train.dtypes import torch_dtype
from dflash_train.store_schema import (
    Damage,
    Part,
    Sample,
    Store,
    StoreError,
    check_before_reading,
    open_store,
    read_guarded,
    refusal,
)
from dflash_train.store_schema.integrity import read_by_span, refuse_unless_skipping
from dflash_train.store_schema.layout import hidden_to_numpy
from dflash_train.store_schema.part import sample_spans
from dflash_train.store_schema.sample import sample_from_arrays
from dflash_train.train.options import option_name, require

MIN_TRAINABLE_LENGTH = 3
"""Shortest sample holding a block: an anchor a >= 1 (one context position before it) and
its first label at a + 1 (blocks.valid_anchor_mask)."""


@dataclass
class LoaderConfig:
    """How the store is streamed into batches."""

    batch_tokens: int = 16384
    """Padded tokens per GLOBAL batch (samples x longest sample) at most, summed over ranks;
    one longer sample still forms a batch of its own."""
    shuffle_buffer_tokens: int = 65536
    """Tokens held for shuffling samples; bounds the loader's memory with batch_tokens."""
    grouping: Literal["random", "by_length"] = "random"
    """How samples leaving the shuffle buffer form batches. random: drawn one at a time, so a
    batch pads to the longest of random lengths. by_length: each time the buffer fills, its
    samples are sorted by length, cut into batches and the batches shuffled, so a batch's
    rows are of similar length and its budget holds more samples and fewer pads: more data
    per step, fewer steps per epoch (measured on the quickstart's 6 epochs: 305 steps instead
    of 455, and held-out tau 1.23 instead of 1.30, so it is not the default)."""
    part_window: int = 8
    """Parts opened at once; their read units are shuffled together."""
    max_length: int | None = None
    """Samples longer than this are cut to their first max_length tokens."""
    prefetch_batches: int = 2
    """Batches read ahead (per worker), overlapping I/O with compute."""
    pad_to: int = 1
    """Round each batch's length up to a multiple of this (CUDA: 256, so compiled flex
    attention sees few shapes); padding never changes the loss."""
    workers: int = 0
    """DataLoader worker processes reading batches (spawned, each re-opens the stores);
    0 reads in a background thread of this process."""
    seed: int = 0
    """Seeds the order; epoch e of seed s is the same on every run and every rank."""
    store_weights: list[float] | None = None
    """Per store: passes over it per epoch (fractions draw that share of its read units
    afresh each epoch). None: every store once."""
    unit_cache_tokens: int = 1 << 20
    """Tokens of small per-token arrays (~137 B each) kept for read units still being served."""
    skip_corrupt: bool = False
    """Skip samples whose data is damaged (missing shard, failed checksum, torn part metadata)
    and report them, instead of refusing the store. Off: any damage stops the run."""

    def __post_init__(self) -> None:
        for name in ("batch_tokens", "part_window", "pad_to"):
            require(getattr(self, name) >= 1, f"loader.{name}", ">= 1", getattr(self, name))
        require(self.grouping in ("random", "by_length"), "loader.grouping",
                "random or by_length", self.grouping)
        for name in ("shuffle_buffer_tokens", "prefetch_batches", "workers", "seed",
                     "unit_cache_tokens"):
            require(getattr(self, name) >= 0, f"loader.{name}", ">= 0", getattr(self, name))
        require(self.max_length is None or self.max_length >= MIN_TRAINABLE_LENGTH,
                "loader.max_length", f">= {MIN_TRAINABLE_LENGTH} (an anchor after one context "
                "token, and its label)", self.max_length)
        weights = self.store_weights
        if weights is not None:
            require(all(math.isfinite(w) and w >= 0 for w in weights), "loader.store_weights",
                    "finite numbers >= 0", weights_text(weights))
            require(any(w > 0 for w in weights), "loader.store_weights",
                    "> 0 for at least one store (all zero leaves nothing to train on)",
                    weights_text(weights))


def weights_text(weights: list[float]) -> str:
    """Weights as they are typed after --weights: 1,0.5."""
    return ",".join(f"{w:g}" for w in weights)


@dataclass(frozen=True)
class SampleRef:
    """Where a sample lives: store, part and index within the part."""

    store: int
    part: int
    index: int
    length: int
    unit: tuple[int, int] = (0, 0)
    """The read unit [first, last + 1) of samples it is read with."""


@dataclass
class Batch:
    """Padded samples; position t of row b is valid where t < lengths[b]."""

    input_ids: torch.Tensor  # int64 [b, T]
    loss_mask: torch.Tensor  # bool [b, T], False on padding
    context: torch.Tensor  # [b, T, n, H]
    topk_ids: torch.Tensor  # int64 [b, T, k]
    topk_logits: torch.Tensor  # float32 [b, T, k]
    lse: torch.Tensor  # float32 [b, T]
    lengths: torch.Tensor  # int64 [b]
    refs: list[SampleRef] = field(default_factory=list)
    skipped: list[Damage] = field(default_factory=list)
    """Samples of this batch left out as damaged (only with LoaderConfig.skip_corrupt)."""

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


def empty_batch(store: Store, skipped: list[Damage] | None = None) -> Batch:
    """A one-token batch with nothing to learn: a rank with no sample in a step still steps."""
    m = store.meta
    return Batch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.bool),
                 torch.zeros(1, 1, m.num_context_layers, m.target.hidden_size,
                             dtype=torch_dtype(m.hidden_dtype)),
                 torch.zeros(1, 1, m.top_k, dtype=torch.long), torch.zeros(1, 1, m.top_k),
                 torch.zeros(1, 1), torch.ones(1, dtype=torch.long), refs=[],
                 skipped=list(skipped or []))


def collate(samples: list[Sample], refs: list[SampleRef], pad_to: int = 1,
            context: torch.Tensor | None = None) -> Batch:
    """Pad samples to the longest, rounded up to a multiple of `pad_to` (few distinct shapes
    keep compiled kernels from recompiling); padding is never a loss position.

    context: the batch's [b, T, n, H] context when the samples' context was already read
    into its rows (sample i's is context[i, :len(i)]); only its padding is written then."""
    b, t = len(samples), _round_up(max(len(s) for s in samples), pad_to)
    s0 = samples[0]
    n, h = s0.context.shape[1:]
    k = s0.topk_ids.shape[1]
    in_place = context is not None
    if in_place and (tuple(context.shape) != (b, t, n, h) or any(
            s.context.data_ptr() != context[i].data_ptr() for i, s in enumerate(samples))):
        raise ValueError(f"collate: context {tuple(context.shape)} does not hold the samples' "
                         f"context in its rows (expected {(b, t, n, h)})")
    out = Batch(
        input_ids=torch.zeros(b, t, dtype=torch.int64),
        loss_mask=torch.zeros(b, t, dtype=torch.bool),
        # the largest array: filled row by row below, only its padding zeroed (not all of it)
        context=context if in_place else torch.empty(b, t, n, h, dtype=s0.context.dtype),
        topk_ids=torch.zeros(b, t, k, dtype=torch.int64),
        topk_logits=torch.full((b, t, k), float("-inf")),
        lse=torch.zeros(b, t),
        lengths=torch.tensor([len(s) for s in samples], dtype=torch.int64),
        refs=refs,
    )
    for i, s in enumerate(samples):
        n_i = len(s)
        out.input_ids[i, :n_i] = s.input_ids
        out.loss_mask[i, :n_i] = s.loss_mask
        if not in_place:
            out.context[i, :n_i] = s.context
        out.context[i, n_i:] = 0
        out.topk_ids[i, :n_i] = s.topk_ids
        out.topk_logits[i, :n_i] = s.topk_logits
        out.lse[i, :n_i] = s.lse
    return out


BATCH_MMAP_THRESHOLD = 8 << 20
"""Bytes from which glibc serves an allocation by its own mmap (returned to the OS on free):
above an inner chunk of the widest target (256 x 5120 x 2 B = 2.6 MB), below a batch's."""


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at BATCH_MMAP_THRESHOLD for this process; True if set.

    Every batch allocates its large arrays afresh and frees them a step later in another
    thread. glibc raises its mmap threshold to the size of each mmapped block freed, so
    after the first batches these come from the heap instead, whose fragmentation grew
    the loader's peak RSS with the size of the store (measured: a 10x store 1.41x of a 1x
    one; with the threshold fixed 1.00x, and both ~300 MiB instead of 320-450). Blocks
    below it (decode buffers, chunk bytes) stay on the heap, so reading stays as fast.
    Left alone where the user set MALLOC_MMAP_THRESHOLD_ or the C library is not glibc."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD
    return bool(mallopt(m_mmap_threshold, BATCH_MMAP_THRESHOLD))


class StoreLoader:
    """Batches of one epoch at a time from one or more stores, read ahead in a thread."""

    def __init__(self, urls: list[str], cfg: LoaderConfig, rank: int = 0, world: int = 1,
                 damage: list[Damage] | None = None):
        """damage: the stores' structural damage, when already checked (DataLoader workers
        get the parent's list); None runs the check."""
        self.cfg, self.rank, self.world = cfg, rank, world
        pin_mmap_threshold()
        self.stores: list[Store] = [open_store(u) for u in urls]
        first = self.stores[0]
        for s in self.stores[1:]:
            # "s does not match first": each difference reads s's value != first's
            diffs = s.meta.target_mismatches(first.meta) + [
                d for d in s.meta.mismatches(first.meta) if d.startswith(("hidden_dtype", "top_k"))]
            if diffs:
                raise StoreError(f"{s.url} does not match {first.url}: stores trained together "
                                 f"must share target, layers, top-k and dtype ({s.url} != "
                                 f"{first.url}):\n  " + "\n  ".join(diffs))
        complete = [(i, p) for i, s in enumerate(self.stores) for p in s.parts() if p.complete]
        if damage is None:
            damage = [d for i, s in enumerate(self.stores) for d in
                      check_before_reading(s, [p.index for j, p in complete if j == i])]
        refuse_unless_skipping(damage, cfg.skip_corrupt)
        self.damage = damage
        """Structural damage found before reading (skipped: cfg.skip_corrupt is set)."""
        bad_parts = {(d.store, d.part) for d in damage if d.sample is None}
        self.parts = [(i, p) for i, p in complete if (urls[i], p.index) not in bad_parts]
        if not self.parts:
            raise StoreError(f"no complete part in {urls}: finish extraction first")
        weights = cfg.store_weights
        if weights is not None and len(weights) != len(urls):
            raise StoreError(f"{option_name('loader.store_weights')} "
                             f"{weights_text(weights)} gives {len(weights)} weight(s) for "
                             f"{len(urls)} store(s): give one per --store")

    def plan(self, epoch: int) -> Iterator[list[SampleRef]]:
        """This rank's share of each global batch (possibly empty when W > batch size)."""
        for batch in plan_epoch(self.parts, self.cfg, epoch):
            yield batch[self.rank :: self.world]

    def plan_inputs(self) -> list[list[int]]:
        """[store, part, samples] of every part planned over: what fixes the batches."""
        return [[i, p.index, p.num_samples] for i, p in self.parts]

    def batches_per_epoch(self, epoch: int = 0) -> int:
        return sum(1 for _ in plan_epoch(self.parts, self.cfg, epoch))

    def epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[Batch | None]:
        """Batches of `epoch`, starting after `skip_batches` (resume: no data is read for them).

        None stands for a global batch with no sample for this rank (it must still step)."""
        if self.cfg.workers > 0:
            yield from _worker_batches(self, epoch, skip_batches)
            return
        yield from _prefetch(self._batches(epoch, skip_batches), self.cfg.prefetch_batches)

    def _batches(self, epoch: int, skip: int, worker: int = 0, workers: int = 1):
        """Batches skip, skip+1, ... of the epoch's plan, of which this worker reads every
        `workers`-th; a DataLoader interleaving its workers round-robin restores the order."""
        reader = _UnitReader({(i, p.index): p for i, p in self.parts}, self.cfg,
                             self._known_damage())
        for i, refs in enumerate(self.plan(epoch)):
            if i >= skip and (i - skip) % workers == worker:
                yield reader.load(refs)

    def _known_damage(self) -> dict[tuple[int, int, int], Damage]:
        """Damaged samples found before reading, keyed like SampleRef (store, part, index)."""
        index = {s.url: i for i, s in enumerate(self.stores)}
        return {(index[d.store], d.part, d.sample): d for d in self.damage
                if d.sample is not None}

    def has_trainable_block(self) -> bool:
        """Whether any sample drawn (store weight > 0) holds a valid anchor within
        max_length. Reads loss masks a read unit at a time and stops at the first one found,
        so a usable store costs one small read. A unit that cannot be read is read sample by
        sample; when no block is found and some sample could not be read, that is damage
        (refused, or under skip_corrupt left to the reader), not "nothing to train on"."""
        weights = self.cfg.store_weights
        damage: list[Damage] = []
        for store_i, part in self.parts:
            if weights is not None and weights[store_i] <= 0:
                continue
            for mask in self._loss_masks(part, damage):
                if (mask[1:-1] & mask[2:]).any():  # blocks.valid_anchor_mask
                    return True
        refuse_unless_skipping(damage, self.cfg.skip_corrupt)
        return False

    def _loss_masks(self, part: Part, damage: list[Damage]) -> Iterator[np.ndarray]:
        """Each sample's loss mask (cut to max_length) a read unit at a time; a sample that
        cannot be read is added to `damage` instead."""
        offsets = part.offsets()
        cut = self.cfg.max_length

        def tokens(s: int) -> tuple[int, int]:
            t0, t1 = int(offsets[s]), int(offsets[s + 1])
            return t0, min(t1, t0 + cut) if cut else t1

        def read(t0: int, t1: int) -> np.ndarray:
            return part.read_tokens(t0, t1, ("loss_mask",))["loss_mask"].astype(bool)

        def read_span(a: int, b: int) -> list[np.ndarray]:
            start = int(offsets[a])
            unit = read(start, int(offsets[b]))
            return [unit[t0 - start : t1 - start] for t0, t1 in map(tokens, range(a, b))]

        spans = sample_spans(np.diff(offsets), part.store.shard_tokens)
        for _, mask, broken in read_by_span(part.store.url, part.index, spans, read_span,
                                            lambda s: read(*tokens(s))):
            if broken is not None:
                damage.append(broken)
            else:
                yield mask


class _EpochDataset(torch.utils.data.IterableDataset):
    """One epoch's batches for DataLoader workers; pickles as URLs and settings only."""

    def __init__(self, loader: StoreLoader, epoch: int, skip: int):
        self.args = ([s.url for s in loader.stores], loader.cfg, loader.rank, loader.world,
                     loader.damage)
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        loader = StoreLoader(*self.args)  # zarr's event loop does not survive a fork: reopen
        try:
            for batch in loader._batches(self.epoch, self.skip, worker, workers):
                yield (batch, None)  # a tuple, so an empty-rank None passes through
        except StoreError as e:  # sent as text: the DataLoader would wrap it in a traceback
            yield (None, str(e))


def _unwrap(item):
    return item


def _worker_batches(loader: StoreLoader, epoch: int, skip: int) -> Iterator[Batch | None]:
    data = torch.utils.data.DataLoader(
        _EpochDataset(loader, epoch, skip), batch_size=None, collate_fn=_unwrap,
        num_workers=loader.cfg.workers, multiprocessing_context="spawn",
        prefetch_factor=max(1, loader.cfg.prefetch_batches))
    for batch, error in data:
        if error is not None:
            raise StoreError(error)
        yield batch


_SMALL_ARRAYS = ("input_ids", "loss_mask", "verifier_topk_ids", "verifier_topk_logits",
                 "verifier_lse")


class _UnitReader:
    """Reads the small per-token arrays a read unit at a time (one request per array instead of
    one per sample) and each sample's context on its own. Units stay in a least-recently-used
    cache bounded in tokens; one evicted too early is simply read again. A sample found
    damaged (before reading, or by its checksum now) is skipped or refused per the config."""

    def __init__(self, parts: dict[tuple[int, int], Part], cfg: LoaderConfig,
                 known: dict[tuple[int, int, int], Damage] | None = None):
        self.parts = parts
        self.known = known or {}
        self.skip = cfg.skip_corrupt
        self.broken_units: set[tuple] = set()
        self.max_length = cfg.max_length
        self.pad_to = cfg.pad_to
        self.capacity = cfg.unit_cache_tokens
        self.cache: OrderedDict[tuple, tuple[int, dict[str, np.ndarray]]] = OrderedDict()
        self.cached_tokens = 0
        self.served: dict[tuple, int] = {}

    def _unit(self, part: Part, key: tuple, unit: tuple[int, int]):
        """(first token, small arrays) of a read unit; None when some chunk of it is damaged."""
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        if key in self.broken_units:
            return None
        offsets = part.offsets()
        start, stop = int(offsets[unit[0]]), int(offsets[unit[1]])
        try:
            entry = (start, part.read_tokens(start, stop, _SMALL_ARRAYS))
        except Exception:  # then each sample is read alone, so that only damaged ones are named
            self.broken_units.add(key)
            return None
        self.cache[key] = entry
        self.cached_tokens += stop - start
        while self.cached_tokens > self.capacity and len(self.cache) > 1:
            _, (_, old) = self.cache.popitem(last=False)
            self.cached_tokens -= len(old["input_ids"])
        return entry

    def _served(self, key: tuple, unit_samples: int) -> None:
        """Drop a unit once all its samples were served: the cache then holds the units in
        flight, not every unit of a store smaller than its bound (measured: peak RSS grew
        with store size). A unit some of whose samples go elsewhere (other ranks, damage)
        stays until the bound evicts it."""
        served = self.served.get(key, 0) + 1
        if served < unit_samples:
            self.served[key] = served
            return
        self.served.pop(key, None)
        entry = self.cache.pop(key, None)
        if entry is not None:
            self.cached_tokens -= len(entry[1]["input_ids"])

    def _tokens(self, r: SampleRef) -> tuple[int, int]:
        """The part's token range [t0, t1) read for sample r (cut to max_length)."""
        offsets = self.parts[(r.store, r.part)].offsets()
        t0, t1 = int(offsets[r.index]), int(offsets[r.index + 1])
        return t0, min(t1, t0 + self.max_length) if self.max_length else t1

    def _read(self, r: SampleRef, context: torch.Tensor) -> Sample:
        """Sample r, its context read into `context` ([length, n, H], e.g. a batch row)."""
        part = self.parts[(r.store, r.part)]
        t0, t1 = self._tokens(r)
        key = (r.store, r.part, r.unit)
        unit = self._unit(part, key, r.unit)
        if unit is None:
            arrays = part.read_tokens(t0, t1, _SMALL_ARRAYS)
        else:
            base, small = unit
            arrays = {k: v[t0 - base : t1 - base].copy() for k, v in small.items()}
            self._served(key, r.unit[1] - r.unit[0])
        dtype = part.store.meta.hidden_dtype
        arrays |= part.read_tokens(t0, t1, ("context",),
                                   out={"context": hidden_to_numpy(context, dtype)})
        return sample_from_arrays(arrays, dtype, part.sources()[r.index])

    def load(self, refs: list[SampleRef]) -> Batch | None:
        if not refs:
            return None
        # Each sample's context is decoded straight into its row of the batch: no second copy
        # of the largest array (measured ~10 % of the loader's time).
        meta = next(iter(self.parts.values())).store.meta
        lengths = [t1 - t0 for t0, t1 in map(self._tokens, refs)]
        context = torch.empty(len(refs), _round_up(max(lengths), self.pad_to),
                              meta.num_context_layers, meta.target.hidden_size,
                              dtype=torch_dtype(meta.hidden_dtype))
        samples, kept, skipped = [], [], []
        for row, r in enumerate(refs):
            damage = self.known.get((r.store, r.part, r.index))
            if damage is None:
                url = self.parts[(r.store, r.part)].store.url
                sample, damage = read_guarded(
                    url, r.part, r.index,
                    lambda r=r, row=row: self._read(r, context[row, :lengths[row]]))
            if damage is None:
                samples.append(sample)
                kept.append(r)
            elif self.skip:
                skipped.append(damage)
            else:
                raise refusal([damage])
        if not samples:
            return empty_batch(next(iter(self.parts.values())).store, skipped)
        # with samples left out, rows no longer line up: collate copies (damage is rare)
        batch = collate(samples, kept, self.pad_to, None if skipped else context)
        batch.skipped = skipped
        return batch


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


def _prefetch(batches: Iterator[Batch], depth: int) -> Iterator[Batch]:
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
