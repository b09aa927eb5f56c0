"""Stream a store into padded training batches: deterministic, rank-disjoint, bounded memory.

The order of an epoch is a PLAN computed from sample lengths alone (the stores' offsets, a few
bytes per sample): parts are opened lazily a window at a time, their read units (runs of
samples about one shard long) shuffled across the window, and samples then drawn at random
from a buffer bounded in tokens into GLOBAL batches. Rank r of W takes samples r, r+W, ... of
each global batch, so a run on W ranks sees exactly the batches of a run on one. Because the
plan never looks at hidden states, resuming at batch N replays it without reading data, and
every rank computes it without talking to the others. Data is read per sample; the sharded
context array makes that a read of only the inner chunks the sample covers.

Never touches labels or noise: a batch carries the stored arrays as they are.
"""

import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash.store_schema import Part, Sample, Store, StoreError, open_store
from dflash.store_schema.sample import sample_from_arrays


@dataclass
class LoaderConfig:
    """How the store is streamed into batches."""

    batch_tokens: int = 16384
    """Padded tokens per GLOBAL batch (samples x longest sample) at most, summed over ranks;
    one longer sample still forms a batch of its own."""
    shuffle_buffer_tokens: int = 65536
    """Tokens held for shuffling samples; bounds the loader's memory with batch_tokens."""
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

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _read_units(lengths: np.ndarray, unit_tokens: int) -> list[tuple[int, int]]:
    """Runs [i, j) of consecutive samples holding about unit_tokens tokens each."""
    units, i, acc = [], 0, 0
    for j, n in enumerate(lengths):
        acc += int(n)
        if acc >= unit_tokens:
            units.append((i, j + 1))
            i, acc = j + 1, 0
    if i < len(lengths):
        units.append((i, len(lengths)))
    return units


def plan_epoch(
    parts: list[tuple[int, Part]], cfg: LoaderConfig, epoch: int
) -> Iterator[list[SampleRef]]:
    """The global batches of one epoch, from sample lengths only."""
    rng = np.random.default_rng([cfg.seed, epoch])
    weights = cfg.store_weights
    order = rng.permutation(len(parts))
    buffer: list[SampleRef] = []
    buffered = 0
    batch: list[SampleRef] = []
    for w in range(0, len(order), cfg.part_window):
        units = []
        for store_i, part in (parts[i] for i in order[w : w + cfg.part_window]):
            lengths = part.sample_lengths()
            if cfg.max_length:
                lengths = np.minimum(lengths, cfg.max_length)
            weight = 1.0 if weights is None else weights[store_i]
            for a, b in _read_units(lengths, part.store.shard_tokens):
                copies = int(weight) + int(rng.random() < weight - int(weight))
                units += [[SampleRef(store_i, part.index, s, int(lengths[s]), (a, b))
                           for s in range(a, b)]] * copies
        for u in rng.permutation(len(units)):
            for ref in units[u]:
                buffer.append(ref)
                buffered += ref.length
                while buffered > cfg.shuffle_buffer_tokens:
                    ref_out = buffer.pop(int(rng.integers(len(buffer))))
                    buffered -= ref_out.length
                    batch = yield from _add(batch, ref_out, cfg.batch_tokens)
    while buffer:
        ref_out = buffer.pop(int(rng.integers(len(buffer))))
        batch = yield from _add(batch, ref_out, cfg.batch_tokens)
    if batch:
        yield batch


def _add(batch: list[SampleRef], ref: SampleRef, budget: int):
    """Append ref to batch, first yielding the batch if the padded size would exceed budget."""
    longest = max([r.length for r in batch] + [ref.length])
    if batch and longest * (len(batch) + 1) > budget:
        yield batch
        batch = []
    batch.append(ref)
    return batch


def collate(samples: list[Sample], refs: list[SampleRef], pad_to: int = 1) -> Batch:
    """Pad samples to the longest, rounded up to a multiple of `pad_to` (few distinct shapes
    keep compiled kernels from recompiling); padding is never a loss position."""
    b, t = len(samples), _round_up(max(len(s) for s in samples), pad_to)
    s0 = samples[0]
    n, h = s0.context.shape[1:]
    k = s0.topk_ids.shape[1]
    out = Batch(
        input_ids=torch.zeros(b, t, dtype=torch.int64),
        loss_mask=torch.zeros(b, t, dtype=torch.bool),
        context=torch.zeros(b, t, n, h, dtype=s0.context.dtype),
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
        out.context[i, :n_i] = s.context
        out.topk_ids[i, :n_i] = s.topk_ids
        out.topk_logits[i, :n_i] = s.topk_logits
        out.lse[i, :n_i] = s.lse
    return out


class StoreLoader:
    """Batches of one epoch at a time from one or more stores, read ahead in a thread."""

    def __init__(self, urls: list[str], cfg: LoaderConfig, rank: int = 0, world: int = 1):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.stores: list[Store] = [open_store(u) for u in urls]
        first = self.stores[0].meta
        for s in self.stores[1:]:
            diffs = first.target_mismatches(s.meta) + [
                d for d in first.mismatches(s.meta) if d.startswith(("hidden_dtype", "top_k"))]
            if diffs:
                raise StoreError(f"{s.url} does not match {self.stores[0].url}: {diffs}")
        self.parts = [(i, p) for i, s in enumerate(self.stores) for p in s.parts() if p.complete]
        if not self.parts:
            raise StoreError(f"no complete part in {urls}: finish extraction first")
        weights = cfg.store_weights
        if weights is not None and (len(weights) != len(urls) or min(weights) < 0):
            raise StoreError(f"store_weights {weights} must give one weight >= 0 per store "
                             f"({len(urls)} stores)")

    def plan(self, epoch: int) -> Iterator[list[SampleRef]]:
        """This rank's share of each global batch (possibly empty when W > batch size)."""
        for batch in plan_epoch(self.parts, self.cfg, epoch):
            yield batch[self.rank :: self.world]

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
        reader = _UnitReader({(i, p.index): p for i, p in self.parts}, self.cfg)
        for i, refs in enumerate(self.plan(epoch)):
            if i >= skip and (i - skip) % workers == worker:
                yield reader.load(refs)


class _EpochDataset(torch.utils.data.IterableDataset):
    """One epoch's batches for DataLoader workers; pickles as URLs and settings only."""

    def __init__(self, loader: StoreLoader, epoch: int, skip: int):
        self.args = ([s.url for s in loader.stores], loader.cfg, loader.rank, loader.world)
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        loader = StoreLoader(*self.args)  # zarr's event loop does not survive a fork: reopen
        for batch in loader._batches(self.epoch, self.skip, worker, workers):
            yield (batch,)  # a tuple, so an empty-rank None passes through the DataLoader


def _unwrap(item):
    return item


def _worker_batches(loader: StoreLoader, epoch: int, skip: int) -> Iterator[Batch | None]:
    data = torch.utils.data.DataLoader(
        _EpochDataset(loader, epoch, skip), batch_size=None, collate_fn=_unwrap,
        num_workers=loader.cfg.workers, multiprocessing_context="spawn",
        prefetch_factor=max(1, loader.cfg.prefetch_batches))
    for (batch,) in data:
        yield batch


_SMALL_ARRAYS = ("input_ids", "loss_mask", "verifier_topk_ids", "verifier_topk_logits",
                 "verifier_lse")


class _UnitReader:
    """Reads the small per-token arrays a read unit at a time (one request per array instead of
    one per sample) and each sample's context on its own. Units stay in a least-recently-used
    cache bounded in tokens; one evicted too early is simply read again."""

    def __init__(self, parts: dict[tuple[int, int], Part], cfg: LoaderConfig):
        self.parts = parts
        self.max_length = cfg.max_length
        self.pad_to = cfg.pad_to
        self.capacity = cfg.unit_cache_tokens
        self.cache: OrderedDict[tuple, tuple[int, dict[str, np.ndarray]]] = OrderedDict()
        self.cached_tokens = 0

    def _unit(self, part: Part, key: tuple, unit: tuple[int, int]):
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        offsets = part.offsets()
        start, stop = int(offsets[unit[0]]), int(offsets[unit[1]])
        entry = (start, part.read_tokens(start, stop, _SMALL_ARRAYS))
        self.cache[key] = entry
        self.cached_tokens += stop - start
        while self.cached_tokens > self.capacity and len(self.cache) > 1:
            _, (_, old) = self.cache.popitem(last=False)
            self.cached_tokens -= len(old["input_ids"])
        return entry

    def _sample(self, r: SampleRef) -> Sample:
        part = self.parts[(r.store, r.part)]
        base, small = self._unit(part, (r.store, r.part, r.unit), r.unit)
        offsets = part.offsets()
        t0, t1 = int(offsets[r.index]), int(offsets[r.index + 1])
        if self.max_length:
            t1 = min(t1, t0 + self.max_length)
        arrays = {k: v[t0 - base : t1 - base] for k, v in small.items()}
        arrays["context"] = part.array("context")[t0:t1]
        return sample_from_arrays(arrays, part.store.meta.hidden_dtype, part.sources()[r.index])

    def load(self, refs: list[SampleRef]) -> Batch | None:
        if not refs:
            return None
        return collate([self._sample(r) for r in refs], refs, self.pad_to)


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
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # surfaced in the consumer, not lost in the thread
            q.put(e)

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
