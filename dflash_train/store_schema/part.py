"""A part: one worker's slice of the source rows, its tokens laid along one flat axis.

Crash safety. The writer appends whole shards of `shard_tokens` tokens; after each flush it
writes, in order: (1) array sizes, (2) the token data, (3) the offsets and source rows of the
samples that now lie wholly on disk, (4) the commit record (part attrs). Every object write is
atomic (rename on local disks, a single PUT on object stores), and nothing trusts data beyond
the commit record, so a crash at any point leaves a part whose committed counters match disk.
A resumed writer reloads the committed tokens of the last, partly filled shard and carries on.
"""

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import zarr

from dflash_train.store_schema import fp8
from dflash_train.store_schema.errors import StoreError, one_line
from dflash_train.store_schema.layout import (
    CONTEXT_INNER_TOKENS,
    PART_KEY,
    SAMPLE_ARRAYS,
    SAMPLE_CHUNK,
    TOKEN_CHUNK_SHARDS,
    context_compressors,
    context_storage_dtype,
    has_nonfinite_hidden,
    hidden_from_numpy,
    part_path,
    storage_dtype,
    token_arrays,
    token_compressors,
)
from dflash_train.store_schema.sample import Sample, sample_from_arrays, sample_to_arrays
from dflash_train.store_schema.shards import ShardCodec, check_buffer

if TYPE_CHECKING:
    from dflash_train.store_schema.store import Store


_RECORD_COUNTS = ("row_start", "row_stop", "committed_samples", "committed_tokens")


def commit_record(attrs: dict, where: str) -> dict | None:
    """The commit record in a part's attributes, checked field by field; None when it has
    none: its creation was cut short before the record, nothing was committed, and every
    reader takes it as not started. StoreError naming the field when the record is damaged
    (a field missing or of another type: JSON booleans are no counts)."""
    raw = attrs.get(PART_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise StoreError(f"{where}: commit record: {one_line(repr(raw), 60)}, not an object "
                         "(its attributes were changed or torn)")
    for key in (*_RECORD_COUNTS, "complete"):
        value = raw.get(key)
        if key not in raw:
            wrong = f"no {key}"
        elif key == "complete":
            wrong = None if isinstance(value, bool) else \
                f"{key} is {one_line(repr(value), 60)}, not true or false"
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            wrong = f"{key} is {one_line(repr(value), 60)}, not a count >= 0"
        else:
            wrong = None
        if wrong:
            raise StoreError(f"{where}: commit record: {wrong} (its attributes were changed "
                             "or torn)")
    return raw


class Part:
    """Read access to one part's committed samples."""

    def __init__(self, store: "Store", index: int, group: zarr.Group):
        self.store = store
        self.index = index
        self.group = group
        record = commit_record(dict(group.attrs), f"{store.url}: part {index}")
        if record is None:
            raise StoreError(f"{store.url}: part {index} has no commit record (torn creation?)")
        self.record = record
        self.row_start = record["row_start"]
        self.row_stop = record["row_stop"]
        self.num_samples = record["committed_samples"]
        self.num_tokens = record["committed_tokens"]
        self.complete = record["complete"]
        self._offsets: np.ndarray | None = None
        self._sources: np.ndarray | None = None
        self._coders: dict[str, ShardCodec | None] = {}

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        return f"Part({self.index}, samples={self.num_samples}, tokens={self.num_tokens}, {state})"

    def next_row(self) -> int:
        """The source row a writer resuming this part starts at."""
        return int(self.sources()[-1]) + 1 if self.num_samples else self.row_start

    def array(self, name: str) -> zarr.Array:
        try:
            return self.group[name]
        except KeyError as e:
            raise StoreError(f"{self.store.url}: part {self.index} lacks array {name}") from e
        except Exception as e:  # zarr surfaces a torn zarr.json as a JSON or metadata error
            raise self.damaged(name, "metadata (zarr.json) is unreadable", e) from e

    def damaged(self, name: str, what: str, error: Exception) -> StoreError:
        """The error naming this part's array `name` as damaged, and the way to see more."""
        url = self.store.url
        return StoreError(f"{url}: part {self.index} metadata: array {name} {what}: "
                          f"{type(error).__name__}: {one_line(error)}; refusing a damaged "
                          f"store: run `dflash store validate {url}` for every problem")

    def _read_sample_array(self, name: str, count: int) -> np.ndarray:
        """The first `count` entries of a per-sample array: every sample's location hangs on
        them, so damage there is damage to the whole part. (A lost chunk reads as zeros,
        which validate's offset and source-row checks catch, except where zeros are right.)"""
        arr = self.array(name)
        try:
            return arr[:count]
        except Exception as e:  # codecs raise ValueError/RuntimeError on corrupt bytes
            raise self.damaged(name, "cannot be read", e) from e

    def offsets(self) -> np.ndarray:
        """int64 [num_samples + 1]: sample i spans tokens offsets[i]:offsets[i+1]."""
        if self._offsets is None:
            self._offsets = self._read_sample_array("sample_offsets", self.num_samples + 1)
        return self._offsets

    def sources(self) -> np.ndarray:
        if self._sources is None:
            self._sources = self._read_sample_array("sample_source", self.num_samples)
        return self._sources

    def sample_lengths(self) -> np.ndarray:
        return np.diff(self.offsets())

    def read_tokens(
        self, start: int, stop: int, names: tuple[str, ...] | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Token arrays (all of layout.TOKEN_ARRAYS, or `names`) of tokens [start, stop)
        within the committed range, `context` in the hidden dtype's stored form however it
        is stored (an fp8 store's is dequantized here, the one place readers meet fp8);
        those named in `out` are read into its arrays (C-contiguous, of that dtype and the
        read's shape), e.g. straight into a batch, without another copy."""
        self._check_span(start, stop)
        names = names or tuple(a.name for a in token_arrays(None))
        out = out or {}
        return {name: self._read_fp8_context(start, stop, out.get(name))
                if name == "context" and self.store.meta.fp8
                else self._read(name, start, stop, out.get(name)) for name in names}

    def read_stored(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Every token array of tokens [start, stop) exactly as stored (fp8 bits and scales
        included): what a resumed writer buffers again."""
        self._check_span(start, stop)
        return {a.name: self._read(a.name, start, stop, None)
                for a in token_arrays(self.store.meta.context_dtype)}

    def _check_span(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.num_tokens:
            raise StoreError(f"part {self.index}: tokens [{start}, {stop}) outside the "
                             f"{self.num_tokens} committed")

    def _read_fp8_context(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        meta = self.store.meta
        shape = (stop - start, meta.num_context_layers, meta.target.hidden_size)
        if out is None:
            out = np.empty(shape, storage_dtype(meta.hidden_dtype))
        else:
            check_buffer(out, shape, np.dtype(storage_dtype(meta.hidden_dtype)))
        codes = self._read("context", start, stop, None)
        scales = self._read("context_scale", start, stop, None)
        fp8.dequantize_into(codes, scales, hidden_from_numpy(out, meta.hidden_dtype))
        return out

    def _read(self, name: str, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        """Through dflash's shard coder (concurrent requests, parallel decode) where it applies."""
        if name not in self._coders:
            self._coders[name] = ShardCodec.of(self.array(name), immutable=self.complete)
        coder = self._coders[name]
        if coder:
            return coder.read(start, stop, out)
        array = self.array(name)
        if out is None:
            return array[start:stop]
        check_buffer(out, (stop - start, *array.shape[1:]), np.dtype(array.dtype))
        out[...] = array[start:stop]
        return out

    def sample(self, i: int) -> Sample:
        if not 0 <= i < self.num_samples:
            raise StoreError(f"part {self.index}: sample {i} outside [0, {self.num_samples})")
        off = self.offsets()
        arrays = self.read_tokens(int(off[i]), int(off[i + 1]))
        return sample_from_arrays(arrays, self.store.meta.hidden_dtype, self.sources()[i])

    def iter_samples(self, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
        """Samples start..stop in order, read a span (sample_spans) at a time."""
        stop = self.num_samples if stop is None else min(stop, self.num_samples)
        off, src = self.offsets(), self.sources()
        spans = sample_spans(np.diff(off[start : stop + 1]), self.store.shard_tokens)
        for i, j in ((start + a, start + b) for a, b in spans):
            t0 = int(off[i])
            arrays = self.read_tokens(t0, int(off[j]))
            for s in range(i, j):
                a, b = int(off[s]) - t0, int(off[s + 1]) - t0
                yield sample_from_arrays({k: v[a:b] for k, v in arrays.items()},
                                         self.store.meta.hidden_dtype, src[s])


def sample_spans(lengths: Sequence[int], span_tokens: int) -> list[tuple[int, int]]:
    """Runs [i, j) of consecutive samples holding at least span_tokens tokens each (the last
    may hold fewer): what one read of a part covers, a shard or more of tokens."""
    spans, i, acc = [], 0, 0
    for j, n in enumerate(lengths):
        acc += int(n)
        if acc >= span_tokens:
            spans.append((i, j + 1))
            i, acc = j + 1, 0
    if i < len(lengths):
        spans.append((i, len(lengths)))
    return spans


def _token_array_spec(store: "Store", name: str) -> tuple[tuple[int, ...], type, dict]:
    """Inner shape, storage dtype and chunking / codec keyword arguments of a token array."""
    meta = store.meta
    shard = store.shard_tokens
    spec = next(a for a in token_arrays(meta.context_dtype) if a.name == name)
    if spec.width == "context":
        n, h = meta.num_context_layers, meta.target.hidden_size
        inner = min(CONTEXT_INNER_TOKENS, shard)
        return (n, h), context_storage_dtype(meta.hidden_dtype, meta.context_dtype), {
            "chunks": (inner, 1, h), "shards": (shard, n, h),
            "compressors": context_compressors(meta.hidden_dtype, meta.context_dtype)}
    inner_shape = {"top_k": (meta.top_k,), "layers": (meta.num_context_layers,)}.get(
        spec.width, ())
    return inner_shape, spec.dtype, {"chunks": (shard * TOKEN_CHUNK_SHARDS, *inner_shape),
                                     "compressors": token_compressors()}


def _split_rows(pieces: list[np.ndarray], n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The first n rows (axis 0) of the pieces' concatenation and the rest, as views."""
    head, tail, seen = [], [], 0
    for p in pieces:
        if seen >= n:
            tail.append(p)
        elif seen + len(p) <= n:
            head.append(p)
        else:
            head.append(p[:n - seen])
            tail.append(p[n - seen:])
        seen += len(p)
    return head, tail


class PartWriter:
    """Appends samples to one part, in source-row order, committing after every
    `flush_shards` whole shards (and at finish)."""

    def __init__(self, store: "Store", index: int, row_start: int, row_stop: int,
                 flush_shards: int = 1):
        """`flush_shards`: whole shards buffered before a write and commit. Every commit
        rewrites the small arrays' last chunk and several zarr.json files, a fixed cost worth
        spreading over a few shards when writing fast; a crash loses at most that many shards
        of work, and memory holds at most that many plus one."""
        if not 0 <= row_start <= row_stop:
            raise StoreError(f"part {index}: bad row range [{row_start}, {row_stop})")
        self.store = store
        self.index = index
        self.row_start, self.row_stop = row_start, row_stop
        self._meta = store.meta
        self._shard = store.shard_tokens
        self._flush_tokens = self._shard * max(1, flush_shards)
        path = part_path(index)
        record = None
        if path in store.root:
            record = commit_record(dict(store.root[path].attrs), f"{store.url}: part {index}")
        if record is None:  # new, or creation torn before its record: nothing was committed
            self.group = self._create(path)
        else:
            if (record["row_start"], record["row_stop"]) != (row_start, row_stop):
                raise StoreError(
                    f"{store.url}: part {index} holds rows [{record['row_start']}, "
                    f"{record['row_stop']}), asked for [{row_start}, {row_stop}): "
                    "was the dataset or the number of parts changed?")
            self.group = store.root[path]
        # every chunk stored, even one equal to the fill value (zarr skips those by default):
        # a long prompt's all-False loss_mask chunk must not pass for a lost one
        self._arrays = {name: arr.with_config({"write_empty_chunks": True})
                        for name, arr in self.group.arrays()}
        self._coders = {name: c for name, arr in self._arrays.items()
                        if (c := ShardCodec.of(arr)) is not None}
        part = Part(store, index, self.group)
        self.committed_samples = part.num_samples
        self.committed_tokens = part.num_tokens
        self.complete = part.complete
        self.next_row = part.next_row()
        self._pending: list[tuple[int, int]] = []  # (end token, source row) not yet committed
        self._buffer: dict[str, list[np.ndarray]] = {
            a.name: [] for a in token_arrays(self._meta.context_dtype)}
        self._buffer_start = self.committed_tokens - self.committed_tokens % self._shard
        self._buffer_tokens = 0
        self._token_end = self.committed_tokens
        if self._buffer_start < self.committed_tokens:  # reload the partly filled shard
            for name, a in part.read_stored(self._buffer_start, self.committed_tokens).items():
                self._buffer[name].append(a)
            self._buffer_tokens = self.committed_tokens - self._buffer_start

    def _create(self, path: str) -> zarr.Group:
        group = self.store.root.require_group(path)
        for a in token_arrays(self._meta.context_dtype):
            inner, dtype, encoding = _token_array_spec(self.store, a.name)
            group.create_array(a.name, shape=(0, *inner), dtype=dtype, overwrite=True,
                               **encoding)
        for name, dtype in SAMPLE_ARRAYS.items():
            group.create_array(name, shape=(0,), chunks=(SAMPLE_CHUNK,), dtype=dtype,
                               compressors=token_compressors(), overwrite=True)
        group["sample_offsets"].resize((1,))
        group["sample_offsets"][0:1] = np.zeros(1, np.int64)
        group.attrs[PART_KEY] = self._record(0, 0, False)  # last: the part now exists
        return group

    def _record(self, samples: int, tokens: int, complete: bool) -> dict:
        return {"row_start": self.row_start, "row_stop": self.row_stop,
                "committed_samples": samples, "committed_tokens": tokens, "complete": complete}

    @property
    def pending_samples(self) -> int:
        return len(self._pending)

    def append(self, sample: Sample) -> None:
        """Buffer a sample; full shards are written and committed as they fill."""
        number = self.committed_samples + len(self._pending)
        where = f"part {self.index} sample {number} (source row {sample.source_row})"
        if self.complete:
            raise StoreError(f"{where}: part {self.index} is already complete")
        if not self.next_row <= sample.source_row < self.row_stop:
            raise StoreError(f"{where}: source row must be in [{self.next_row}, "
                             f"{self.row_stop}) (rows are appended once, in order)")
        m = self._meta
        arrays = sample_to_arrays(sample, n=m.num_context_layers, hidden=m.target.hidden_size,
                                  top_k=m.top_k, hidden_dtype=m.hidden_dtype, where=where)
        if has_nonfinite_hidden(arrays["context"], m.hidden_dtype):
            raise StoreError(f"{where}: context holds NaN or Inf")
        if m.fp8:
            arrays["context"], arrays["context_scale"] = fp8.quantize(sample.context)
        if not (np.isfinite(arrays["verifier_topk_logits"]).all()
                and np.isfinite(arrays["verifier_lse"]).all()):
            raise StoreError(f"{where}: verifier logits hold NaN or Inf")
        for name, a in arrays.items():
            self._buffer[name].append(a)
        self._buffer_tokens += len(sample)
        self._token_end += len(sample)
        self._pending.append((self._token_end, sample.source_row))
        self.next_row = sample.source_row + 1
        if self._buffer_tokens >= self._flush_tokens:
            self._flush(final=False)

    def _write_tokens(self, name: str, start: int, stop: int, pieces: list[np.ndarray]) -> None:
        """Tokens [start, stop), held by `pieces` (buffered arrays, in order): whole shards
        through dflash's parallel shard coder where it applies, which gathers its chunks from
        the pieces without joining them first; the rest (a part's last, partial shard), and
        arrays the coder does not take, through zarr."""
        whole = (stop - start) // self._shard * self._shard
        coder = self._coders.get(name)
        if coder is not None and whole and start % self._shard == 0:
            shards, pieces = _split_rows(pieces, whole)
            coder.write(start // self._shard, shards)
            start += whole
        if start < stop:
            self._arrays[name][start:stop] = np.concatenate(pieces)

    def finish(self) -> None:
        """Write what is buffered and mark the part complete."""
        if not self.complete:
            self._flush(final=True)

    def _flush(self, final: bool) -> None:
        end = self._buffer_start + self._buffer_tokens
        write_to = end if final else end - end % self._shard
        count = write_to - self._buffer_start
        if count <= 0 and not final:
            return
        split = {k: _split_rows(v, count) for k, v in self._buffer.items()}
        for name, arr in self._arrays.items():  # (1) sizes: exact when final, else grown
            if name in SAMPLE_ARRAYS:
                continue
            if final or arr.shape[0] < write_to:
                arr.resize((write_to, *arr.shape[1:]))
        if count > 0:  # (2) token data, whole shards except the last
            for name, (head, _) in split.items():
                self._write_tokens(name, self._buffer_start, write_to, head)
        done = [p for p in self._pending if p[0] <= write_to]
        if done:  # (3) sample offsets and rows
            c = self.committed_samples
            ends = np.array([p[0] for p in done], np.int64)
            rows = np.array([p[1] for p in done], np.int64)
            offsets, sources = self._arrays["sample_offsets"], self._arrays["sample_source"]
            offsets.resize((c + 1 + len(done),))
            sources.resize((c + len(done),))
            offsets[c + 1:] = ends
            sources[c:] = rows
            self.committed_samples += len(done)
            self.committed_tokens = int(ends[-1])
            self._pending = self._pending[len(done):]
        self.group.attrs[PART_KEY] = self._record(  # (4) the commit record, last
            self.committed_samples, self.committed_tokens, final)
        self.complete = final
        self._buffer = {k: tail for k, (_, tail) in split.items()}
        self._buffer_start = write_to
        self._buffer_tokens = end - write_to
