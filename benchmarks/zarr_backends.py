"""The same store through other Zarr v3 engines: zarr-python's default codec pipeline, the
`zarrs` Rust codec pipeline (zarr-python's frontend, Rust codecs), and tensorstore.

    pip install -e ".[bench]"    (optional: a missing engine is reported, not fatal)

Measured side by side on one store (synthetic bf16, the store's own codecs: sharding,
blosc shuffle + zstd-1, crc32c), against dflash's own shard coder (store_schema/shards.py,
what the part writer and the loader use for the context array):
  write    the context array, whole shards: zarr-python (default, zarrs) vs dflash's coder
  read     every sample's context in shuffled order: zarr-python (default, zarrs),
           tensorstore, dflash's coder
Every engine must read the same values (a digest of all samples), also from the shards
dflash's coder wrote: the store stays plain Zarr v3. Not a test.
"""

import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from benchmarks.report import Row

ZARRS_PIPELINE = "zarrs.ZarrsCodecPipeline"


def available(module: str) -> str | None:
    """None when `module` imports, else why not."""
    try:
        __import__(module)
    except Exception as e:  # ImportError, or a binary wheel that fails to load
        return f"{type(e).__name__}: {e}"
    return None


@contextmanager
def pipeline(name: str):
    """Run zarr-python with the default codec pipeline or with zarrs' ("zarrs")."""
    if name == "default":
        yield
        return
    import zarr

    with zarr.config.set({"codec_pipeline.path": ZARRS_PIPELINE}):
        yield


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_of(runs: dict, rounds: int = 3) -> dict[str, float]:
    """Fastest of `rounds` timings per engine, the engines taking turns within each round
    (on a noisy shared machine a single timing of each moved by 2x between runs)."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            best[name] = min(best[name], timed(fn))
    return best


def read_with(engine: str, order) -> int:
    with pipeline(engine):
        return read_zarr(order)


def write_context(where: Path, like: Path, data: np.ndarray, engine: str) -> None:
    """The context array `data` [T, n, H] into a new array shaped and coded like `like`."""
    import zarr

    from dflash_train.store_schema.shards import ShardCodec

    src = zarr.open_array(str(like), mode="r")
    arr = zarr.create_array(str(where), shape=data.shape, dtype=src.dtype, chunks=src.chunks,
                            shards=src.shards, compressors=src.compressors)
    whole = data.shape[0] // arr.shards[0] * arr.shards[0]
    if engine == "dflash":
        ShardCodec.of(arr).write(0, data[:whole])
        arr[whole:] = data[whole:]
    else:
        with pipeline(engine):
            arr[:] = data


def spans(url: str) -> list[tuple[Path, int, int]]:
    """(context array directory, first token, stop) of every sample, in a fixed random order."""
    from dflash_train.store_schema import open_store

    out = []
    for part in open_store(url).parts():
        off = part.offsets()
        where = Path(url) / "parts" / f"{part.index:05d}" / "context"
        out += [(where, int(a), int(b)) for a, b in zip(off[:-1], off[1:], strict=True)]
    order = np.random.default_rng(0).permutation(len(out))
    return [out[i] for i in order]


def read_zarr(order, digest=None) -> int:
    import zarr

    arrays: dict = {}
    total = 0
    for where, a, b in order:
        if where not in arrays:
            arrays[where] = zarr.open_array(str(where), mode="r")
        total += _seen(arrays[where][a:b], digest)
    return total


def read_dflash(order, digest=None) -> int:
    import zarr

    from dflash_train.store_schema.shards import ShardCodec

    coders: dict = {}
    total = 0
    for where, a, b in order:
        if where not in coders:
            coders[where] = ShardCodec.of(zarr.open_array(str(where), mode="r"), immutable=True)
        total += _seen(coders[where].read(a, b), digest)
    return total


def read_tensorstore(order, digest=None) -> int:
    import tensorstore as ts

    arrays: dict = {}
    total = 0
    for where, a, b in order:
        if where not in arrays:
            arrays[where] = ts.open({"driver": "zarr3", "kvstore": {
                "driver": "file", "path": str(where)}}, read=True).result()
        total += _seen(arrays[where][a:b].read().result(), digest)
    return total


def _seen(values: np.ndarray, digest) -> int:
    if digest is not None:
        digest.update(np.ascontiguousarray(values).tobytes())
    return values.nbytes


def digest_of(read, order) -> str:
    import hashlib

    h = hashlib.sha256()
    read(order, h)
    return h.hexdigest()


def bench(root: Path, url: str, meta, items, raw_bytes: int) -> list[Row]:
    """Rows of item 8 on the store at `url` (written by store_io with the same items)."""
    import torch

    rows = []
    missing = {m: why for m in ("zarrs", "tensorstore") if (why := available(m))}
    for m, why in missing.items():
        rows.append(Row("8 engines", f"{m} unavailable", why))
    order = spans(url)
    like = order[0][0]
    data = torch.cat([s.context for s in items]).view(torch.int16).numpy().view(np.uint16)
    mb_s = lambda t: f"{raw_bytes / t / 1e6:.0f} MB/s"  # noqa: E731
    writers = ["default", "dflash"] + ([] if "zarrs" in missing else ["zarrs"])
    def write(e):
        shutil.rmtree(root / f"w-{e}.zarr", ignore_errors=True)
        write_context(root / f"w-{e}.zarr", like, data, e)

    t_write = best_of({e: (lambda e=e: write(e)) for e in writers})
    readers = {"default": read_zarr, "dflash": read_dflash}
    if "tensorstore" not in missing:
        readers["tensorstore"] = read_tensorstore
    reads = {e: (lambda f=f: f(order)) for e, f in readers.items()}
    if "zarrs" not in missing:
        reads["zarrs"] = lambda: read_with("zarrs", order)
    t_read = best_of(reads)
    # every engine reads the same values, from the store (dflash-coded) and from each writer's
    truth = digest_of(read_zarr, order)
    for engine, read in readers.items():
        if digest_of(read, order) != truth:
            rows.append(Row("8 engines", f"{engine} read different values", "MISMATCH"))
    for e in writers:
        copy = [(root / f"w-{e}.zarr", a, b) for _, a, b in order]
        if digest_of(read_zarr, copy) != truth:
            rows.append(Row("8 engines", f"shards written by {e} read back different", "MISMATCH"))
    for what, times in (("write: context shards", t_write),
                        ("read: per-sample context, shuffled", t_read)):
        base = times["default"]
        rows.append(Row("8 engines", f"{what}, zarr-python default pipeline", mb_s(base)))
        rows += [Row("8 engines", f"{what}, {engine} / default", f"{base / t:.2f}x ({mb_s(t)})")
                 for engine, t in times.items() if engine != "default"]
    return rows
