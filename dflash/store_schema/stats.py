"""Per-context-layer statistics over a whole store, computed lazily in parallel with dask.

Hidden states carry a few outlier channels hundreds of times larger than the rest, so training
noise is scaled per layer by these numbers (RMS by default). They are cached in the store's
attrs with the token count they were computed on, and recomputed when that count changes.
"""

from dataclasses import asdict, dataclass

import dask
import dask.array as da
import numpy as np

from dflash.store_schema.errors import StoreError
from dflash.store_schema.store import Store

STATS_KEY = "dflash_stats"


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

    @property
    def rms(self) -> list[float]:
        return [layer.rms for layer in self.layers]


def _as_float32(block: np.ndarray, hidden_dtype: str) -> np.ndarray:
    if hidden_dtype == "bfloat16":  # bf16 bits are the top half of a float32
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block.astype(np.float32)


def _context(store: Store) -> list[da.Array]:
    out = []
    for part in store.parts():
        if part.num_tokens == 0:
            continue
        arr = part.array("context")
        chunks = (store.shard_tokens, *arr.shape[1:])
        x = da.from_zarr(arr, chunks=chunks)[: part.num_tokens]
        out.append(x.map_blocks(_as_float32, store.meta.hidden_dtype, dtype=np.float32))
    return out


def compute_stats(store: Store, top_channels: int = 8, workers: int | None = None) -> StoreStats:
    """Mean, RMS, absmax and the largest channels of each context layer (float64 sums)."""
    pieces = _context(store)
    if not pieces:
        raise StoreError(f"{store.url} has no committed tokens to compute statistics on")
    x = da.concatenate(pieces, axis=0)  # [T, n, H]
    sums = x.astype(np.float64).sum(axis=0)
    squares = (x.astype(np.float64) ** 2).sum(axis=0)
    absmax = abs(x).max(axis=0)
    with dask.config.set(scheduler="threads", num_workers=workers):
        sums, squares, absmax = dask.compute(sums, squares, absmax)
    tokens, hidden = x.shape[0], x.shape[2]
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
    return StoreStats(tokens=int(tokens), layers=layers)


def store_stats(store: Store, *, recompute: bool = False, cache: bool = True) -> StoreStats:
    """The cached statistics if still current, else computed (and cached when writable)."""
    tokens = store.num_tokens
    cached = dict(store.root.attrs).get(STATS_KEY)
    if cached and not recompute and cached.get("tokens") == tokens:
        return StoreStats(tokens=tokens, layers=[LayerStats(**d) for d in cached["layers"]])
    stats = compute_stats(store)
    if cache and store.mode != "r":
        store.root.attrs[STATS_KEY] = {"tokens": stats.tokens,
                                       "layers": [asdict(s) for s in stats.layers]}
    return stats
