"""A store's summary for people: what it holds, how big it is, how far extraction got."""

from dataclasses import dataclass

from zarr.core.sync import sync

from dflash.store_schema.layout import PARTS_GROUP, TOKEN_ARRAYS
from dflash.store_schema.store import Store


@dataclass
class StoreSummary:
    """Counts and sizes of a store (committed data only)."""

    samples: int
    tokens: int
    parts_planned: int
    parts_complete: int
    parts_incomplete: list[int]
    parts_missing: list[int]
    bytes_on_disk: int
    """Every object in the store, target rows and tokenizer included."""
    part_bytes_on_disk: int
    logical_part_bytes: int
    """Uncompressed size of the committed token arrays."""

    @property
    def bytes_per_token(self) -> float:
        return self.part_bytes_on_disk / self.tokens if self.tokens else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.logical_part_bytes / self.part_bytes_on_disk if self.part_bytes_on_disk else 0.0


def summarize(store: Store) -> StoreSummary:
    parts = store.parts()
    zstore = store.root.store
    prefix = store.root.path
    root_prefix = f"{prefix}/" if prefix else ""
    per_token = 0
    for spec in TOKEN_ARRAYS:
        if parts:
            arr = parts[0].array(spec.name)
            per_token += arr.dtype.itemsize * max(1, _prod(arr.shape[1:]))
    present = {p.index for p in parts}
    return StoreSummary(
        samples=sum(p.num_samples for p in parts),
        tokens=sum(p.num_tokens for p in parts),
        parts_planned=store.meta.num_parts,
        parts_complete=sum(p.complete for p in parts),
        parts_incomplete=[p.index for p in parts if not p.complete],
        parts_missing=[i for i in range(store.meta.num_parts) if i not in present],
        bytes_on_disk=sync(zstore.getsize_prefix(prefix)) if prefix else _total(zstore),
        part_bytes_on_disk=sync(zstore.getsize_prefix(f"{root_prefix}{PARTS_GROUP}")),
        logical_part_bytes=per_token * sum(p.num_tokens for p in parts),
    )


def _total(zstore) -> int:
    async def total():
        n = 0
        async for key in zstore.list():
            n += await zstore.getsize(key)
        return n

    return sync(total())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
