"""Whole shards of a sharded array, coded by dflash with many inner chunks at once.

Why: zarr-python codes a shard's inner chunks with a per-chunk Python and copy overhead that
caps a part writer at a few hundred MB/s on one core, while one H200 extracting a 27B target
at real width produces ~3 GB/s of hidden states (benchmarks/gpu.py measured extraction 11.7x
slower than the bare forward with zarr-python writing). A full shard is just bytes in Zarr
v3's `sharding_indexed` format, so it is built here: every inner chunk through the array's
own codec chain (bytes, blosc, crc32c) on a thread pool (blosc and crc32c release the GIL),
then the chunk index (uint64 offset / length pairs and their crc32c) at the end. Reads take
the same path the other way. Only an array whose metadata declares exactly that chain gets
it (`ShardCodec.of` returns None otherwise); the stored objects are ordinary Zarr v3 shards
that zarr-python, zarrs and tensorstore read (tests check zarr-python both ways).
"""

import asyncio
import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import product

import google_crc32c
import numpy as np
import zarr
from numcodecs import Blosc
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

THREADS_ENV = "DFLASH_CODEC_THREADS"
"""Threads that code inner chunks (default: every core)."""
INDEX_CACHE_SHARDS = 4096
"""Shard indexes kept per array (a few hundred bytes each)."""
EMPTY = 2**64 - 1  # an index entry of a chunk that is not stored
_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
_pool: ThreadPoolExecutor | None = None
_scratch = threading.local()  # each decoding thread's reusable chunk buffer


def blosc_of(b: BloscCodec) -> Blosc:
    """numcodecs' Blosc with the settings of a Zarr BloscCodec: the same bytes, decoded
    without Zarr's per-chunk machinery."""
    return Blosc(cname=b.cname.value, clevel=b.clevel, shuffle=_SHUFFLE[b.shuffle.value],
                 blocksize=b.blocksize, typesize=b.typesize)


class ShardDamage(ValueError):
    """A shard whose index or an inner chunk fails its checksum or does not decode."""


def codec_threads() -> int:
    return max(1, int(os.environ.get(THREADS_ENV) or os.cpu_count() or 1))


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(codec_threads(), thread_name_prefix="dflash-codec")
    return _pool


def _thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """This thread's reusable byte buffer `name`, at least `nbytes` long. Chunks are decoded
    on the pool's threads; allocating per chunk there grew glibc's per-thread arenas
    (measured: the loader's RSS rose ~30 MB over an epoch, flat with reused buffers)."""
    buffer = getattr(_scratch, name, None)
    if buffer is None or len(buffer) < nbytes:
        buffer = np.empty(nbytes, np.uint8)
        setattr(_scratch, name, buffer)
    return buffer


def _crc(data) -> bytes:
    return int(google_crc32c.value(data)).to_bytes(4, "little")


def _little(codec) -> bool:
    return isinstance(codec, BytesCodec) and (codec.endian is None
                                              or codec.endian.value == "little")


def check_buffer(out: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """A caller's buffer to read into must be exactly what is read: no broadcast, no cast."""
    if out.shape != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"a buffer to read into must be a C-contiguous {dtype} array shaped "
                         f"{tuple(shape)}; got {out.dtype} {out.shape}")


def _gather(pieces: list[np.ndarray], lo: int, hi: int, rest: tuple[slice, ...]) -> np.ndarray:
    """Rows [lo, hi) of the pieces' concatenation along axis 0, `rest` applied to the other
    axes, as one C-contiguous array."""
    found, start = [], 0
    for p in pieces:
        a, b = max(lo, start), min(hi, start + len(p))
        if a < b:
            found.append(p[a - start:b - start][(slice(None), *rest)])
        start += len(p)
        if start >= hi:
            break
    return np.ascontiguousarray(found[0]) if len(found) == 1 else np.concatenate(found)


@dataclass(frozen=True)
class ShardCodec:
    """How one array's shards are laid out and coded."""

    array: zarr.Array
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    blosc: Blosc
    indexes: OrderedDict | None = None
    """Shard indexes already read (most recent last), kept only for shards that can no longer
    change (a complete part's): a read then costs one round of requests, not two."""

    @classmethod
    def of(cls, array: zarr.Array, immutable: bool = False) -> "ShardCodec | None":
        """The codec for `array`, or None unless its chain is exactly the one coded here.
        `immutable`: no shard of the array will be written again, so indexes may be kept."""
        codecs = getattr(array.metadata, "codecs", ())
        if sys.byteorder != "little" or len(codecs) != 1 or not isinstance(codecs[0],
                                                                            ShardingCodec):
            return None
        sharding = codecs[0]
        inner, index = sharding.codecs, sharding.index_codecs
        if not (len(inner) == 3 and _little(inner[0]) and isinstance(inner[1], BloscCodec)
                and isinstance(inner[2], Crc32cCodec) and len(index) == 2 and _little(index[0])
                and isinstance(index[1], Crc32cCodec)
                and sharding.index_location.value == "end"):
            return None
        return cls(array, tuple(array.shards), tuple(sharding.chunk_shape), blosc_of(inner[1]),
                   OrderedDict() if immutable else None)

    @property
    def chunks_per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape, strict=True))

    def _index_bytes(self) -> int:
        return int(np.prod(self.chunks_per_shard)) * 16 + 4

    def _chunk_slices(self, coords: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(i * c, (i + 1) * c) for i, c in zip(coords, self.chunk_shape,
                                                                strict=True))

    def _encode_chunk(self, chunk: np.ndarray) -> tuple[bytes, bytes]:
        data = self.blosc.encode(np.ascontiguousarray(chunk))
        return data, _crc(data)  # joined once, with the whole shard: one copy, not two

    def encode(self, shards: np.ndarray | list[np.ndarray]) -> list[bytes]:
        """Whole shards stacked along axis 0 -> one `sharding_indexed` object per shard.
        `shards` may be a list of arrays read as their concatenation along axis 0 (e.g. the
        samples a writer buffered): each inner chunk is gathered from them on the pool, so
        the data is copied once, in parallel, instead of joined first."""
        pieces = [shards] if isinstance(shards, np.ndarray) else shards
        rows = sum(len(p) for p in pieces)
        if (any(p.shape[1:] != self.shard_shape[1:] for p in pieces)
                or rows % self.shard_shape[0]):
            raise ValueError(f"shapes {[p.shape for p in pieces]} are not whole shards of "
                             f"{self.shard_shape}")
        dtype = np.dtype(self.array.dtype)
        if any(p.dtype != dtype for p in pieces):  # blosc codes bytes: no silent cast
            raise ValueError(f"dtypes {sorted({str(p.dtype) for p in pieces})} are not the "
                             f"array's {dtype}")
        count = rows // self.shard_shape[0]
        coords = list(product(*map(range, self.chunks_per_shard)))  # C order
        jobs = [(s * self.shard_shape[0], self._chunk_slices(c)) for s in range(count)
                for c in coords]

        def code(job):
            first_row, (rows_in_shard, *rest) = job
            return self._encode_chunk(_gather(pieces, first_row + rows_in_shard.start,
                                              first_row + rows_in_shard.stop, tuple(rest)))

        coded = list(_executor().map(code, jobs))
        objects = []
        for s in range(count):
            body = coded[s * len(coords):(s + 1) * len(coords)]
            lengths = np.array([len(data) + 4 for data, _ in body], dtype="<u8")
            index = np.stack([np.cumsum(lengths) - lengths, lengths], axis=-1)
            index = index.reshape(*self.chunks_per_shard, 2).tobytes()
            objects.append(b"".join([*(piece for pair in body for piece in pair), index,
                                     _crc(index)]))
        return objects

    def _key(self, shard: int) -> str:
        root = self.array.store_path.path
        key = self.array.metadata.encode_chunk_key((shard, *(0,) * (len(self.shard_shape) - 1)))
        return f"{root}/{key}" if root else key

    def write(self, first_shard: int, shards: np.ndarray | list[np.ndarray]) -> None:
        """Store whole shards from shard number `first_shard` on (the array is already sized);
        `shards` as for `encode`."""
        objects = self.encode(shards)
        store, proto = self.array.store_path.store, default_buffer_prototype()

        async def put_all():
            await asyncio.gather(*(store.set(self._key(first_shard + i),
                                             proto.buffer.from_bytes(obj))
                                   for i, obj in enumerate(objects)))

        sync(put_all())

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of axis 0 (every other axis whole), into `out` when given; see
        read_many."""
        return self.read_many([(start, stop)], None if out is None else [out])[0]

    def read_many(self, spans: list[tuple[int, int]],
                  outs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Rows [start, stop) of axis 0 for each span, into `outs` when given (C-contiguous,
        shaped [stop - start, *rest]). One round of requests for the shard indexes not yet
        known, one for every needed inner chunk's byte range, all at once; then each chunk
        is checked and decoded once on the pool and copied to every span that needs it.
        ShardDamage for a missing shard, a failed checksum or a chunk that does not decode."""
        rows, per_shard = self.chunk_shape[0], self.shard_shape[0] // self.chunk_shape[0]
        users = _chunk_users(spans, rows)
        shards = sorted({b // per_shard for b in users})
        store, proto = self.array.store_path.store, default_buffer_prototype()
        rest = list(product(*map(range, self.chunks_per_shard[1:])))

        async def fetch(key: str, byte_range):
            buf = await store.get(key, proto, byte_range=byte_range)
            if buf is None:
                raise ShardDamage(f"shard object '{key}' is missing")
            return buf.as_numpy_array()  # uint8, a view of what the store read: no copy

        async def fetch_all():
            known = {s: self.indexes[s] for s in shards if self.indexes and s in self.indexes}
            todo = [s for s in shards if s not in known]
            raw = await asyncio.gather(*(fetch(self._key(s), SuffixByteRequest(
                self._index_bytes())) for s in todo))
            index = known | dict(zip(todo, map(self._parse_index, todo, raw), strict=True))
            self._remember(index)
            wanted = [(b, r, index[b // per_shard][b % per_shard][j]) for b in users
                      for j, r in enumerate(rest)]
            stored = [w for w in wanted if w[2][0] != EMPTY]
            data = await asyncio.gather(*(fetch(self._key(b // per_shard), RangeByteRequest(
                int(o), int(o + n))) for b, _, (o, n) in stored))
            return wanted, dict(zip([(b, r) for b, r, _ in stored], data, strict=True))

        outs = self._span_buffers(spans, outs)
        wanted, data = sync(fetch_all())
        fill = self.array.metadata.fill_value

        def place(item):
            b, r, _ = item
            chunk = None
            if (b, r) in data:
                chunk = self._decode_chunk(data[(b, r)], self._key(b // per_shard))
            where = tuple(slice(i * c, (i + 1) * c) for i, c in zip(r, self.chunk_shape[1:],
                                                                     strict=True))
            for i in users[b]:
                start, stop = spans[i]
                lo, hi = max(start, b * rows), min(stop, (b + 1) * rows)
                target = (slice(lo - start, hi - start), *where)
                # a chunk left out of the index holds the fill value
                outs[i][target] = fill if chunk is None else chunk[lo - b * rows:hi - b * rows]

        list(_executor().map(place, wanted))
        return outs

    def _span_buffers(self, spans: list[tuple[int, int]],
                      outs: list[np.ndarray] | None) -> list[np.ndarray]:
        """One array per span, shaped [stop - start, *rest]: `outs` checked, or new ones."""
        dtype = np.dtype(self.array.dtype)
        shapes = [(stop - start, *self.shard_shape[1:]) for start, stop in spans]
        if outs is None:
            return [np.empty(shape, dtype) for shape in shapes]
        for out, shape in zip(outs, shapes, strict=True):
            check_buffer(out, shape, dtype)
        return outs

    def _remember(self, index: dict[int, np.ndarray]) -> None:
        if self.indexes is None:
            return
        for shard, entries in index.items():
            self.indexes[shard] = entries
            self.indexes.move_to_end(shard)
        while len(self.indexes) > INDEX_CACHE_SHARDS:
            self.indexes.popitem(last=False)

    def _parse_index(self, shard: int, raw: np.ndarray) -> np.ndarray:
        body, crc = raw[:-4], raw[-4:].tobytes()
        if len(raw) != self._index_bytes() or _crc(body) != crc:
            raise ShardDamage(f"shard index of '{self._key(shard)}' fails its checksum")
        return body.copy().view("<u8").reshape(self.chunks_per_shard[0], -1, 2)

    def _decode_chunk(self, raw: np.ndarray, key: str) -> np.ndarray:
        """The chunk's values in this thread's decode buffer: valid until it decodes again.
        raw: the stored bytes as uint8 (the data, then its crc32c)."""
        body = raw[:-4]
        if len(raw) < 4 or _crc(body) != raw[-4:].tobytes():
            raise ShardDamage(f"an inner chunk of '{key}' fails its checksum")
        dtype = np.dtype(self.array.dtype)
        nbytes = int(np.prod(self.chunk_shape)) * dtype.itemsize
        buffer = _thread_buffer("decode", nbytes)
        try:
            self.blosc.decode(body, out=buffer[:nbytes])
        except Exception as e:
            raise ShardDamage(f"an inner chunk of '{key}' does not decode: {e}") from e
        return buffer[:nbytes].view(dtype).reshape(self.chunk_shape)


def _chunk_users(spans: list[tuple[int, int]], rows: int) -> dict[int, list[int]]:
    """Inner-chunk row (along axis 0, `rows` rows each) -> the spans [start, stop) that
    need it."""
    users: dict[int, list[int]] = {}
    for i, (start, stop) in enumerate(spans):
        for b in range(start // rows, -(-stop // rows)):
            users.setdefault(b, []).append(i)
    return users
