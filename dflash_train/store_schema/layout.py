"""Where everything lives in a store and how it is encoded: the only place that names zarr paths.

A store is a Zarr v3 group; samples are ragged, so each part lays its tokens along one flat
axis and records where each sample starts in `sample_offsets`.

Schema versions. v1: context in the hidden dtype. v2 adds fp8 context (`context` holds E4M3
bits as uint8, `context_scale` one float32 per token and layer; fp8.py). Only an fp8 store is
written as v2: a default store stays v1, byte for byte as before, so older dflash keeps
reading it, while older dflash refuses an fp8 store by its version instead of misreading its
uint8 context as bf16 bits.
"""

from dataclasses import dataclass

import numpy as np
import torch
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

SCHEMA_VERSION = 2
"""The newest schema this code reads (and the version of the stores it writes with fp8)."""
PLAIN_SCHEMA_VERSION = 1
"""The version of a store whose context is in the hidden dtype."""
META_KEY = "dflash"  # root attrs key holding the provenance (StoreMeta)
PART_KEY = "dflash_part"  # part attrs key holding the commit record
FROZEN_KEY = "dflash_frozen"  # root attrs key holding the frozen unit's record (frozen.py)

PARTS_GROUP = "parts"
TARGET_GROUP = "target"
FILES_GROUP = "files"

# Token arrays other than `context` are small per token; chunking them like the context would
# make one object per few KB. They are chunked `TOKEN_CHUNK_SHARDS` shards long instead and
# rewritten whole (atomically) on each commit.
TOKEN_CHUNK_SHARDS = 16
SAMPLE_CHUNK = 65536
# Inner chunk of the sharded context array: (CONTEXT_INNER_TOKENS, 1, H) so a reader can fetch
# one layer of a few hundred tokens, and a checksum failure names a 256-token span.
CONTEXT_INNER_TOKENS = 256
ZSTD_LEVEL = 1  # level 1 codes at ~1 GB/s per core; higher levels gain little on hidden states

HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
# zarr has no bfloat16: its bit pattern is stored as uint16 and the logical dtype recorded.
_STORAGE_DTYPE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}

FP8_CONTEXT = "float8_e4m3"
CONTEXT_DTYPES = (FP8_CONTEXT,)
"""Context encodings other than the hidden dtype itself (StoreMeta.context_dtype)."""


def schema_version_for(context_dtype: str | None) -> int:
    """The version a store is written with: the oldest schema that can describe it."""
    return SCHEMA_VERSION if context_dtype == FP8_CONTEXT else PLAIN_SCHEMA_VERSION


@dataclass(frozen=True)
class TokenArray:
    """An array laid along a part's token axis: shape [T, *inner]."""

    name: str
    dtype: type
    width: str | None = None
    """None for [T]; "top_k" for [T, k]; "layers" for [T, n]; "context" for [T, n, H]
    (sharded)."""


TOKEN_ARRAYS = (
    TokenArray("input_ids", np.int32),
    TokenArray("loss_mask", np.bool_),
    TokenArray("context", np.uint16, "context"),  # dtype replaced by the store's hidden dtype
    TokenArray("verifier_topk_ids", np.int32, "top_k"),
    TokenArray("verifier_topk_logits", np.float32, "top_k"),
    TokenArray("verifier_lse", np.float32),
)
CONTEXT_SCALE = TokenArray("context_scale", np.float32, "layers")
"""fp8 stores only: the scale of each (token, context layer) row of `context`."""
SAMPLE_ARRAYS = {"sample_offsets": np.int64, "sample_source": np.int64}
TARGET_ARRAYS = ("embed_tokens", "lm_head", "final_norm")


def part_path(index: int) -> str:
    return f"{PARTS_GROUP}/{index:05d}"


def token_arrays(context_dtype: str | None) -> tuple[TokenArray, ...]:
    """The token arrays of a store whose context is `context_dtype` (None: the hidden dtype)."""
    return TOKEN_ARRAYS + (CONTEXT_SCALE,) if context_dtype == FP8_CONTEXT else TOKEN_ARRAYS


def storage_dtype(hidden_dtype: str) -> type:
    return _STORAGE_DTYPE[hidden_dtype]


def context_storage_dtype(hidden_dtype: str, context_dtype: str | None) -> type:
    """What the `context` array holds: E4M3 bits (uint8) in an fp8 store, else the hidden
    dtype's stored form."""
    return np.uint8 if context_dtype == FP8_CONTEXT else storage_dtype(hidden_dtype)


def hidden_to_numpy(t: torch.Tensor, hidden_dtype: str) -> np.ndarray:
    """A hidden-state tensor as the numpy array that is written (bf16 -> its uint16 bits)."""
    t = t.detach().to("cpu").contiguous()
    if hidden_dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def hidden_from_numpy(a: np.ndarray, hidden_dtype: str) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if hidden_dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def nonfinite_hidden(a: np.ndarray, hidden_dtype: str) -> np.ndarray:
    """Boolean mask of NaN/Inf entries, read straight from the stored bits (no conversion);
    `hidden_dtype` may also be FP8_CONTEXT (E4M3 bits)."""
    if hidden_dtype == FP8_CONTEXT:
        return (a & 0x7F) == 0x7F  # E4M3 has no Inf; its NaN is exponent and mantissa all ones
    if hidden_dtype == "bfloat16":
        return (a & 0x7F80) == 0x7F80  # exponent all ones: Inf or NaN
    return ~np.isfinite(a)


_SCAN_BLOCK = 1 << 18
"""Entries per block of `has_nonfinite_hidden`: its temporaries stay in the CPU cache."""


def has_nonfinite_hidden(a: np.ndarray, hidden_dtype: str) -> bool:
    """Whether any entry is NaN/Inf: `nonfinite_hidden(a).any()` a block at a time, without
    full-size temporaries (measured 2.5x faster on a 52 MB bf16 sample, which the part writer
    checks before buffering it)."""
    flat = a.reshape(-1)
    return any(nonfinite_hidden(flat[i:i + _SCAN_BLOCK], hidden_dtype).any()
               for i in range(0, flat.size, _SCAN_BLOCK))


def token_compressors() -> list:
    return [ZstdCodec(level=ZSTD_LEVEL), Crc32cCodec()]


# Hidden states compress far better once the bytes of each value are grouped (the high byte
# holds sign + exponent, which vary little): measured on synthetic bf16 states with outlier
# channels (benchmarks/store_io.py), zstd-1 alone gives 1.29x, blosc byte-shuffle + zstd-1
# over 256 KiB blocks 1.84x, and decodes twice as fast. Blosc is a core Zarr v3 codec.
BLOSC_BLOCK_BYTES = 1 << 18


def context_compressors(hidden_dtype: str, context_dtype: str | None = None) -> list:
    """fp8 codes are one byte, so the byte shuffle is a no-op there; bit shuffle measured 11 %
    larger than none on SmolLM2 states (2613 vs 2358 B/token over 4096 tokens)."""
    typesize = np.dtype(context_storage_dtype(hidden_dtype, context_dtype)).itemsize
    return [BloscCodec(cname="zstd", clevel=ZSTD_LEVEL, shuffle="shuffle", typesize=typesize,
                       blocksize=BLOSC_BLOCK_BYTES), Crc32cCodec()]
