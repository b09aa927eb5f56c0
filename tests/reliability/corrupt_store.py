"""Ways to damage a real store on disk, and the samples each one must be blamed on.

Each damage names the file it hits and which samples of part 0 an honest check must name,
derived from the store's own offsets (not from the code under test).
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from dflash_train.store_schema.layout import part_path
from tests.train.conftest import build_store

SHARD_TOKENS = 64  # build_store's shard size: context shard i holds tokens [64 i, 64 i + 64)
TOKEN_CHUNK = SHARD_TOKENS * 16  # the small per-token arrays are chunked 16 shards long


def make_store(url: str) -> str:
    """Two complete parts of 12 samples (20..49 tokens each), float32 context."""
    build_store(url)
    return url


def copy_store(src: str, dst: Path) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def offsets(url: str, part: int = 0) -> np.ndarray:
    group = zarr.open_group(url, mode="r")[part_path(part)]
    count = group.attrs["dflash_part"]["committed_samples"]
    return group["sample_offsets"][: count + 1]


def samples_overlapping(url: str, start: int, stop: int, part: int = 0) -> set[int]:
    off = offsets(url, part)
    return {i for i in range(len(off) - 1) if off[i] < stop and off[i + 1] > start}


def _file(url: str, part: int, *rel: str) -> Path:
    return Path(url) / part_path(part) / Path(*rel)


def flip_context_bytes(url: str) -> set[int]:
    """Three bytes flipped inside part 0's context shard 1 (inside its first inner chunk)."""
    f = _file(url, 0, "context", "c", "1", "0", "0")
    data = bytearray(f.read_bytes())
    for i in (40, 41, 97):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    return samples_overlapping(url, SHARD_TOKENS, 2 * SHARD_TOKENS)


def truncate_context_shard(url: str) -> set[int]:
    """Part 0's context shard 2 cut to half its length (its shard index is lost)."""
    f = _file(url, 0, "context", "c", "2", "0", "0")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return samples_overlapping(url, 2 * SHARD_TOKENS, 3 * SHARD_TOKENS)


def truncate_token_chunk(url: str) -> set[int]:
    """Part 0's input_ids chunk (all its tokens here) cut to half its length."""
    f = _file(url, 0, "input_ids", "c", "0")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return samples_overlapping(url, 0, TOKEN_CHUNK)


def delete_context_shard(url: str) -> set[int]:
    """Part 0's context shard 3 deleted (zarr alone would read it back as zeros)."""
    _file(url, 0, "context", "c", "3", "0", "0").unlink()
    return samples_overlapping(url, 3 * SHARD_TOKENS, 4 * SHARD_TOKENS)


def _tear(f: Path) -> None:
    f.write_text(f.read_text()[: f.stat().st_size // 2])


def tear_part_group_json(url: str) -> None:
    """Part 0's group zarr.json (holding its commit record) cut in half."""
    _tear(_file(url, 0, "zarr.json"))


def tear_context_array_json(url: str) -> None:
    """Part 0's context array zarr.json cut in half."""
    _tear(_file(url, 0, "context", "zarr.json"))


def tear_offsets_array_json(url: str) -> None:
    """Part 0's sample_offsets array zarr.json cut in half."""
    _tear(_file(url, 0, "sample_offsets", "zarr.json"))


@dataclass(frozen=True)
class Case:
    """A damage and what a check must blame: samples of part 0, or its metadata (None)."""

    name: str
    damage: object


SAMPLE_CASES = [Case("flipped_context_bytes", flip_context_bytes),
                Case("truncated_context_shard", truncate_context_shard),
                Case("truncated_token_chunk", truncate_token_chunk),
                Case("deleted_context_shard", delete_context_shard)]
METADATA_CASES = [Case("torn_part_group_json", tear_part_group_json),
                  Case("torn_context_array_json", tear_context_array_json),
                  Case("torn_offsets_array_json", tear_offsets_array_json)]
ALL_CASES = SAMPLE_CASES + METADATA_CASES


def apply(case: Case, url: str) -> set[int] | None:
    """Damage the store; the samples of part 0 to blame, or None for part 0's metadata."""
    blamed = case.damage(url)
    return blamed if case in SAMPLE_CASES else None
