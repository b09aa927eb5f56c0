"""Which stored objects an array's data should lie in, and which of them are absent.

Zarr reads a chunk (or shard) object that is not there as the array's fill value, without a
word, so a lost object would pass for zeros. Every reader and validate ask this module before
trusting an array; it lists object names only and never reads chunk data.
"""

from collections.abc import Iterator
from itertools import product

import zarr
from zarr.core.sync import sync


def existing_keys(zstore, prefix: str) -> set[str]:
    """Every object name under `prefix` (one listing, no data read)."""

    async def collect():
        return {k async for k in zstore.list_prefix(prefix)}

    return sync(collect())


def child_names(zstore, prefix: str) -> list[str]:
    """Names directly under `prefix`, without opening them (one may be torn); the group's own
    zarr.json and the leftovers of an atomic write cut short by a crash (`*.partial`, local
    disks) are not children."""

    async def names():
        return sorted([n async for n in zstore.list_dir(prefix)
                       if n != "zarr.json" and not n.endswith(".partial")])

    return sync(names())


def chunk_objects(arr: zarr.Array, rows: int | None = None) -> Iterator[tuple[int, int, str]]:
    """(first row, stop row, object name) of every chunk object (a whole shard for a sharded
    array) holding rows [0, rows) of `arr` (default: all of them)."""
    grid = arr.shards or arr.chunks
    rows = arr.shape[0] if rows is None else rows
    counts = [-(-rows // grid[0])] + [-(-n // g) for n, g in zip(arr.shape[1:], grid[1:],
                                                                  strict=True)]
    for coords in product(*(range(c) for c in counts)):
        start = coords[0] * grid[0]
        key = f"{arr.path}/{arr.metadata.encode_chunk_key(coords)}"
        yield start, min(start + grid[0], rows), key


def missing_chunks(arr: zarr.Array, rows: int | None = None,
                   keys: set[str] | None = None) -> list[tuple[int, int, str]]:
    """The chunk objects of rows [0, rows) that are not stored; `keys`: the names already
    listed under the array (listed here when None)."""
    keys = existing_keys(arr.store, arr.path) if keys is None else keys
    return [c for c in chunk_objects(arr, rows) if c[2] not in keys]
