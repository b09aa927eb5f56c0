"""The same store through other Zarr v3 engines: zarr-python's default codec pipeline, the
`zarrs` Rust codec pipeline (zarr-python's frontend, Rust codecs), and tensorstore.

    pip install -e ".[bench]"    (optional: a missing engine is reported, not fatal)

Measured side by side on one store (synthetic bf16, the store's own codecs: sharding,
blosc shuffle + zstd-1, crc32c):
  write    part writer with the default pipeline vs with zarrs
  read     the training loader, one shuffled epoch, default vs zarrs
  read     every sample's context in shuffled order: zarr-python (default, zarrs), tensorstore
Reported, not adopted. Not a test.
"""

import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from report import Row

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


def write_store(url: str, meta, items) -> None:
    from dflash.store_schema import create_store

    writer = create_store(url, meta).part_writer(0, 0, len(items))
    for s in items:
        writer.append(s)
    writer.finish()


def loader_epoch(url: str) -> int:
    from store_io import SAMPLE_TOKENS

    from dflash.train.data import LoaderConfig, StoreLoader

    cfg = LoaderConfig(batch_tokens=4 * SAMPLE_TOKENS, shuffle_buffer_tokens=8 * SAMPLE_TOKENS,
                       prefetch_batches=2)
    return sum(b.num_tokens for b in StoreLoader([url], cfg).epoch(0) if b is not None)


def spans(url: str) -> list[tuple[Path, int, int]]:
    """(context array directory, first token, stop) of every sample, in a fixed random order."""
    from dflash.store_schema import open_store

    out = []
    for part in open_store(url).parts():
        off = part.offsets()
        where = Path(url) / "parts" / f"{part.index:05d}" / "context"
        out += [(where, int(a), int(b)) for a, b in zip(off[:-1], off[1:], strict=True)]
    order = np.random.default_rng(0).permutation(len(out))
    return [out[i] for i in order]


def read_zarr(order) -> int:
    import zarr

    arrays: dict = {}
    total = 0
    for where, a, b in order:
        if where not in arrays:
            arrays[where] = zarr.open_array(str(where), mode="r")
        total += arrays[where][a:b].nbytes
    return total


def read_tensorstore(order) -> int:
    import tensorstore as ts

    arrays: dict = {}
    total = 0
    for where, a, b in order:
        if where not in arrays:
            arrays[where] = ts.open({"driver": "zarr3", "kvstore": {
                "driver": "file", "path": str(where)}}, read=True).result()
        total += arrays[where][a:b].read().result().nbytes
    return total


def bench(root: Path, url: str, meta, items, raw_bytes: int) -> list[Row]:
    """Rows of item 8 on the store at `url` (written by store_io with the same items)."""
    rows = []
    missing = {m: why for m in ("zarrs", "tensorstore") if (why := available(m))}
    for m, why in missing.items():
        rows.append(Row("8 engines", f"{m} unavailable", why))
    order = spans(url)
    mb_s = lambda t: f"{raw_bytes / t / 1e6:.0f} MB/s"  # noqa: E731
    t_write = {"default": timed(lambda: write_store(str(root / "eng-default.zarr"), meta, items))}
    t_read = {"default": timed(lambda: read_zarr(order))}
    t_loader = {"default": timed(lambda: loader_epoch(url))}
    if "zarrs" not in missing:
        try:
            with pipeline("zarrs"):
                t_write["zarrs"] = timed(lambda: write_store(str(root / "eng-zarrs.zarr"), meta,
                                                             items))
                t_read["zarrs"] = timed(lambda: read_zarr(order))
                t_loader["zarrs"] = timed(lambda: loader_epoch(url))
            with pipeline("zarrs"):  # the store zarrs wrote, read back by the default engine
                written = read_zarr(spans(str(root / "eng-zarrs.zarr")))
            assert written == read_zarr(order), "zarrs wrote a different amount of context"
        except Exception as e:  # an unsupported codec or a pipeline bug: report it
            rows.append(Row("8 engines", "zarrs pipeline failed", f"{type(e).__name__}: {e}"))
    if "tensorstore" not in missing:
        try:
            ts_bytes = read_tensorstore(order)
            assert ts_bytes == read_zarr(order), "tensorstore read a different amount"
            t_read["tensorstore"] = timed(lambda: read_tensorstore(order))
        except Exception as e:
            rows.append(Row("8 engines", "tensorstore failed", f"{type(e).__name__}: {e}"))
    for what, times in (("write: part writer", t_write), ("read: loader epoch", t_loader),
                        ("read: per-sample context, shuffled", t_read)):
        base = times["default"]
        rows.append(Row("8 engines", f"{what}, zarr-python default pipeline", mb_s(base)))
        rows += [Row("8 engines", f"{what}, {engine} / default", f"{base / t:.2f}x ({mb_s(t)})")
                 for engine, t in times.items() if engine != "default"]
    return rows
