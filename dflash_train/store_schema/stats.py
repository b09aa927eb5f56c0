"""Per-context-layer statistics over a whole store, computed lazily in parallel with dask.

Hidden states carry a few outlier channels hundreds of times larger than the rest, so training
noise is scaled per layer by these numbers (RMS by default). They are cached in the store's
attrs with the token count they were computed on, and recomputed when that count changes.
A caller that cannot cache (train opens stores read-only) bounds its cost with `max_tokens`:
whole shards evenly spaced over every part, so the estimate sees the whole store's variety
while reading a fixed number of bytes however large the store grows.

Damage is never averaged in. Before reading, the parts get the readers' structural check
(integrity.check_before_reading: metadata, offsets, every shard object present, since zarr
reads a missing one as zeros); while reading, a shard whose bytes fail their checksum is
caught. Either is a StoreError naming part and array, or, when the caller skips damage (train
--skip-corrupt), left out: a part with structural damage is not read at all; a shard failing
its checksum is read as zeros, which add nothing to the sums, squares or absmax, and its
tokens are taken off the count. Statistics that left anything out are never cached.
"""

import threading
from dataclasses import asdict, dataclass, field

import dask
import dask.array as da
import numpy as np

from dflash_train.store_schema.errors import StoreError
from dflash_train.store_schema.integrity import check_before_reading, refuse_unless_skipping
from dflash_train.store_schema.layout import storage_dtype
from dflash_train.store_schema.store import Store
from dflash_train.store_schema.validate import samples_in

STATS_KEY = "dflash_stats"
_NAMED = 5
"""Damaged parts or shards an error names before it counts the rest: one readable line."""


@dataclass
class LayerStats:
    """Statistics of one context layer over every committed token."""

    layer_id: int
    mean: float
    rms: float
    absmax: float
    outlier_channels: list[int]
    """Channels with the largest RMS, largest first."""
    outlier_rms: list[float]


@dataclass
class StoreStats:
    tokens: int
    layers: list[LayerStats]
    left_out: list[str] = field(default_factory=list)
    """Damage skipped (skip_damaged): parts or shards whose tokens are not in the numbers."""

    @property
    def rms(self) -> list[float]:
        return [layer.rms for layer in self.layers]


def _as_float32(block: np.ndarray, hidden_dtype: str) -> np.ndarray:
    if hidden_dtype == "bfloat16":  # bf16 bits are the top half of a float32
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block.astype(np.float32)


class _GuardedContext:
    """A part's context array as dask reads it: a block that cannot be read is a StoreError
    naming its samples, or (skip) zeros whose token count is remembered."""

    def __init__(self, store: Store, part, skip: bool, damaged: list[tuple[str, int]]):
        self.arr = part.array("context")
        self.part, self.url, self.skip, self.damaged = part, store.url, skip, damaged
        self.shape, self.ndim = self.arr.shape, self.arr.ndim
        self.dtype = np.dtype(storage_dtype(store.meta.hidden_dtype))  # fp8 is read dequantized
        self.fp8 = store.meta.fp8
        self.lock = threading.Lock()

    def __getitem__(self, key):
        rows = key[0] if isinstance(key, tuple) else key
        start, stop, _ = rows.indices(self.shape[0])
        try:
            if self.fp8:  # the part's reader dequantizes; the statistics are of what trains
                rest = key[1:] if isinstance(key, tuple) else ()
                return self.part.read_tokens(start, stop, ("context",))["context"][
                    (slice(None), *rest)]
            return self.arr[key]
        except Exception as e:  # a checksum or decode failure in this shard
            if not self.skip:
                samples = samples_in(self.part.offsets(), start, stop)
                named = f"samples {samples[0]}..{samples[-1]}" if samples else "no sample"
                raise StoreError(
                    f"{self.url}: part {self.part.index} {named} (tokens [{start}, {stop})): "
                    f"context cannot be read: {type(e).__name__}: {e}; run `dflash store "
                    f"validate {self.url}`") from e
            with self.lock:
                self.damaged.append((f"part {self.part.index} context tokens [{start}, "
                                     f"{stop}): {type(e).__name__}", stop - start))
            shape = (stop - start, *self.shape[1:])
            return np.zeros(shape, self.dtype)[(slice(None), *key[1:])]


def _sound_parts(store: Store, skip: bool, exclude_parts, left_out: list[str]) -> list:
    """The parts to read: all but `exclude_parts`, refused (StoreError naming part and
    array) if any has structural damage, or, when skipping, without the damaged ones."""
    parts = [p for p in store.parts() if p.index not in exclude_parts]
    damage = [d for d in check_before_reading(store, [p.index for p in parts])
              if d.part not in exclude_parts]
    refuse_unless_skipping(damage, skip)
    damaged = {d.part for d in damage}
    left_out += [f"part {i}: {next(d.reason for d in damage if d.part == i)}"
                 for i in sorted(damaged)]
    return [p for p in parts if p.index not in damaged]


def _context(store: Store, parts: list, skip: bool, damaged: list[tuple[str, int]],
             max_tokens: int | None) -> list[da.Array]:
    parts = [p for p in parts if p.num_tokens]
    shards = [(p, i) for p in parts for i in range(-(-p.num_tokens // store.shard_tokens))]
    if max_tokens is not None and len(shards) * store.shard_tokens > max_tokens:
        keep = max(1, max_tokens // store.shard_tokens)
        shards = [shards[int(j)] for j in np.linspace(0, len(shards) - 1, keep).round()]
    arrays, out = {}, []
    for part, i in shards:
        if part.index not in arrays:
            arr = _GuardedContext(store, part, skip, damaged)
            chunks = (store.shard_tokens, *arr.shape[1:])
            arrays[part.index] = da.from_array(arr, chunks=chunks, asarray=False)
        x = arrays[part.index][i * store.shard_tokens : min(part.num_tokens,
                                                            (i + 1) * store.shard_tokens)]
        out.append(x.map_blocks(_as_float32, store.meta.hidden_dtype, dtype=np.float32))
    return out


def _nothing_to_read(store: Store, left_out: list[str]) -> StoreError:
    """Why no token is left to read: every part or shard holding any was skipped as damaged
    (named: the user asked to skip damage, not to be told the store is empty), or none has
    any."""
    if left_out:
        named = "; ".join(left_out[:_NAMED]) + (f"; ... ({len(left_out)} in all)"
                                                 if len(left_out) > _NAMED else "")
        return StoreError(f"{store.url}: no statistics: every part holding tokens is damaged "
                          f"and was left out (--skip-corrupt): {named}; run "
                          f"`dflash store validate {store.url}` for every problem")
    return StoreError(f"{store.url} has no committed tokens to compute statistics on")


def compute_stats(store: Store, top_channels: int = 8, workers: int | None = None,
                  skip_damaged: bool = False, exclude_parts=(),
                  max_tokens: int | None = None, checked_parts=None) -> StoreStats:
    """Mean, RMS, absmax and the largest channels of each context layer (float64 sums).

    skip_damaged: leave out shards that cannot be read instead of raising; exclude_parts:
    parts not to read at all (their metadata is damaged); max_tokens: read at most about
    this many tokens, as whole shards evenly spaced over the store (None: every token);
    checked_parts: the only parts to read, which the caller has already given the structural
    check (train's loader), so it is not repeated (a whole-store listing on object storage)."""
    left_out: list[str] = []
    if checked_parts is None:
        parts = _sound_parts(store, skip_damaged, set(exclude_parts), left_out)
    else:
        wanted = set(checked_parts) - set(exclude_parts)
        parts = [p for p in store.parts() if p.index in wanted]
    damaged: list[tuple[str, int]] = []
    pieces = _context(store, parts, skip_damaged, damaged, max_tokens)
    if not pieces:
        raise _nothing_to_read(store, left_out)
    x = da.concatenate(pieces, axis=0)  # [T, n, H]
    sums = x.astype(np.float64).sum(axis=0)
    squares = (x.astype(np.float64) ** 2).sum(axis=0)
    absmax = abs(x).max(axis=0)
    with dask.config.set(scheduler="threads", num_workers=workers):
        sums, squares, absmax = dask.compute(sums, squares, absmax)
    tokens, hidden = x.shape[0] - sum(n for _, n in damaged), x.shape[2]
    left_out += [what for what, _ in damaged]
    if tokens <= 0:
        raise _nothing_to_read(store, left_out)
    layers = []
    for i, layer_id in enumerate(store.meta.context_layer_ids):
        channel_rms = np.sqrt(squares[i] / tokens)
        top = np.argsort(-channel_rms)[:top_channels]
        layers.append(LayerStats(
            layer_id=layer_id,
            mean=float(sums[i].sum() / (tokens * hidden)),
            rms=float(np.sqrt(squares[i].sum() / (tokens * hidden))),
            absmax=float(absmax[i].max()),
            outlier_channels=[int(c) for c in top],
            outlier_rms=[float(channel_rms[c]) for c in top],
        ))
    return StoreStats(tokens=int(tokens), layers=layers, left_out=left_out)


def store_stats(store: Store, *, recompute: bool = False, cache: bool = True,
                skip_damaged: bool = False, exclude_parts=(),
                max_tokens: int | None = None, checked_parts=None) -> StoreStats:
    """The cached statistics if still current, else computed (over at most `max_tokens`
    tokens; cached when writable and every token was read)."""
    tokens = store.num_tokens
    cached = dict(store.root.attrs).get(STATS_KEY)
    if cached and not recompute and cached.get("tokens") == tokens:
        return StoreStats(tokens=tokens, layers=[LayerStats(**d) for d in cached["layers"]])
    stats = compute_stats(store, skip_damaged=skip_damaged, exclude_parts=exclude_parts,
                          max_tokens=max_tokens, checked_parts=checked_parts)
    if cache and store.mode != "r" and stats.tokens == tokens and not stats.left_out:
        store.root.attrs[STATS_KEY] = {"tokens": stats.tokens,
                                       "layers": [asdict(s) for s in stats.layers]}
    return stats
