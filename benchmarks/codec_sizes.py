"""Size per token by context codec on real hidden states, and the codec's effect on eval tau.

A real store (the embedded target's bf16 states) is rewritten once per codec through the
ordinary part writer, with only the context array's codec chain swapped; each copy's bytes on
disk are measured and the same drafter evaluated offline on it. A lossless codec must give
the very same metrics (asserted). The synthetic 5 x 5120 sizes are in store_io.py. Not a test.
"""

from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numcodecs
import numpy as np
from zarr.codecs import Crc32cCodec, ZstdCodec

from benchmarks.report import Row
from dflash_train.store_schema.subset import copy_store

CODECS = {
    "none": lambda *dtypes: [Crc32cCodec()],  # (hidden dtype, context dtype)
    "zstd-1": lambda *dtypes: [ZstdCodec(level=1), Crc32cCodec()],
    "shuffle+zstd-1 (default)": None,  # the store's own context_compressors
}


@contextmanager
def context_codec(name: str):
    """Write stores whose context array uses codec `name` (the default: unchanged)."""
    make = CODECS[name]
    if make is None:
        yield
        return
    with mock.patch("dflash_train.store_schema.part.context_compressors", make):
        yield


def context_bytes_per_token(url: str) -> tuple[float, float]:
    """(stored context bytes / token, raw context bytes / token) of a local store."""
    from dflash_train.store_schema import open_store
    from dflash_train.store_schema.layout import storage_dtype

    store = open_store(url)
    root = Path(url)
    stored = sum(f.stat().st_size for p in store.parts()
                 for f in (root / "parts" / f"{p.index:05d}" / "context").rglob("*")
                 if f.is_file() and f.name != "zarr.json")
    m = store.meta
    raw = m.num_context_layers * m.target.hidden_size * \
        np.dtype(storage_dtype(m.hidden_dtype)).itemsize  # fp32 stores (CPU extract) too
    return stored / store.num_tokens, raw


def real_compression(url: str) -> list[Row]:
    """Compression of the default codec on a real store, whole store and context alone."""
    from dflash_train.store_schema import open_store
    from dflash_train.store_schema.info import summarize

    s = summarize(open_store(url))
    stored, raw = context_bytes_per_token(url)
    return [Row("1 write", "compression ratio, real bf16 states (default codec)",
                f"{raw / stored:.2f}x context, {s.compression_ratio:.2f}x whole part "
                f"({stored:.0f} of {raw:.0f} B/token context)")]


def real_sizes_in_memory(url: str) -> list[Row]:
    """Each codec on the real context bits in memory (no zarr), like store_io's synthetic."""
    from dflash_train.store_schema import open_store

    store = open_store(url)
    bits = np.concatenate([p.array("context")[:] for p in store.parts()])
    tokens = bits.shape[0]
    rows = []
    for name, codec, data in (
        ("none", None, bits),
        ("zstd-1", numcodecs.Zstd(level=1), bits),
        ("shuffle+zstd-1", numcodecs.Zstd(level=1),
         numcodecs.Shuffle(elementsize=2).encode(np.ascontiguousarray(bits))),
    ):
        size = len(codec.encode(np.ascontiguousarray(data))) if codec else bits.nbytes
        rows.append(Row("6 size", f"real context {bits.shape[1]}x{bits.shape[2]}, {name} "
                        "(in memory)", f"{size / tokens:.0f} B/token ({bits.nbytes / size:.2f}x)"))
    return rows


def bench(root: Path, held_out: str, checkpoint: str) -> list[Row]:
    """Rows of item 6 on real states: bytes on disk per codec and offline tau per codec."""
    from benchmarks.eval_speed import offline_summary

    rows, summaries = [], {}
    for name in CODECS:
        url = str(root / f"codec-{name.split()[0]}.zarr")
        with context_codec(name):
            copy_store(held_out, url)
        stored, raw = context_bytes_per_token(url)
        summaries[name] = offline_summary(url, checkpoint)
        rows.append(Row("6 size", f"real store, context codec {name}",
                        f"{stored:.0f} B/token context ({raw / stored:.2f}x), offline tau "
                        f"{summaries[name]['mean_tau']:.4f}"))
    first = next(iter(summaries.values()))
    same = all(s == first for s in summaries.values())
    assert same, "a lossless codec changed the eval metrics"
    rows.append(Row("6 size", "lossless codecs: identical eval metrics (every field)",
                    "identical" if same else "DIFFERENT", "identical", same))
    return rows
