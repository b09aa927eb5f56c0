"""Stream a store into padded training batches: deterministic, rank-disjoint, bounded memory.

This module owns the loader (`StoreLoader`): it opens and checks the stores, takes this rank's
share of each global batch of the epoch's plan (epoch_plan.py), reads the samples a read unit
at a time into a padded Batch (batch.py), ahead of the step in a thread (prefetch.py) or in
DataLoader workers. Rank r of W takes samples r, r+W, ... of each global batch, so a run on W
ranks sees exactly the batches of a run on one. Data is read per sample; the sharded context
array makes that a read of only the inner chunks the sample covers.

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

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch

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
from dflash_train.train.batch import Batch, collate, empty_batch, pin_mmap_threshold, round_up
from dflash_train.train.epoch_plan import SampleRef, plan_epoch
from dflash_train.train.loader_config import LoaderConfig, weights_text
from dflash_train.train.options import option_name
from dflash_train.train.prefetch import prefetch


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
        yield from prefetch(self._batches(epoch, skip_batches), self.cfg.prefetch_batches)

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
        context = torch.empty(len(refs), round_up(max(lengths), self.pad_to),
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
