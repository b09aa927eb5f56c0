"""Create and open stores (local path or fsspec URL) and reach their parts and frozen rows."""

import shutil
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import zarr
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

from dflash_train.dtypes import torch_dtype
from dflash_train.json_fields import Fields
from dflash_train.store_schema.chunks import child_names, missing_chunks
from dflash_train.store_schema.errors import StoreError, one_line
from dflash_train.store_schema.frozen import FrozenRecord, digest, file_path, read_record
from dflash_train.store_schema.layout import (
    FILES_GROUP,
    FROZEN_KEY,
    META_KEY,
    PARTS_GROUP,
    SCHEMA_VERSION,
    TARGET_ARRAYS,
    TARGET_GROUP,
    hidden_from_numpy,
    hidden_to_numpy,
    part_path,
    storage_dtype,
    token_compressors,
)
from dflash_train.store_schema.meta import StoreMeta
from dflash_train.store_schema.part import Part, PartWriter, commit_record

LAYOUT_KEY = "dflash_layout"  # root attrs: how arrays are chunked (not provenance)
COPYING_KEY = "dflash_copying_from"
"""Root attr of a store copy_store is still writing (the source's URL), removed once the copy
is whole: a copy cut short is refused by every reader, where an object store offers no rename
to keep it out of sight until then."""
SHARD_MULTIPLE = 8
"""shard_tokens is a multiple of this: create_store's rule, which a reader checks again."""
# Every chunk of a frozen array is stored, even one equal to the fill value (zarr skips those
# by default), so that an absent chunk always means damage.
_PRESENT = {"write_empty_chunks": True}


def local_path(url: str) -> Path | None:
    """The filesystem path of a store given as a path or file:// URL; None for an object
    store (s3://, gs://, memory://, ...)."""
    if "://" in url and not url.startswith("file://"):
        return None
    return Path(url.removeprefix("file://"))


def zarr_store(url: str, read_only: bool):
    """The zarr store behind `url`: a LocalStore for paths, an FsspecStore for URLs."""
    path = local_path(url)
    if path is None:
        try:
            return FsspecStore.from_url(url, read_only=read_only)
        except Exception as e:  # fsspec raises many types for a bad URL or missing backend
            raise StoreError(f"cannot open {url}: {e}") from e
    if read_only and not path.exists():
        raise StoreError(f"{url}: no such store")
    return LocalStore(path, read_only=read_only)


def _has_any_key(zstore) -> bool:
    """Whether `zstore` holds an object; a leftover of a local write cut short (`*.partial`:
    say the store's first zarr.json, torn by a kill) is none."""
    async def first():
        async for key in zstore.list_prefix(""):
            if not key.endswith(".partial"):
                return True
        return False

    return sync(first())


def store_exists(url: str) -> bool:
    """Whether anything is stored at `url` (a path that does not exist holds nothing)."""
    path = local_path(url)
    if path is not None and not path.exists():
        return False
    return _has_any_key(zarr_store(url, read_only=True))


def remove_local_store(url: str) -> None:
    """Delete the store at local path `url`, if any (a URL is left alone: no recursive
    delete here; a copy cut short there stays refused by readers, see COPYING_KEY)."""
    path = local_path(url)
    if path is not None and path.is_dir():
        shutil.rmtree(path)


def create_store(url: str, meta: StoreMeta, *, shard_tokens: int = 1024,
                 copying_from: str | None = None) -> "Store":
    """Create a store at `url`, or reopen it for resume if one with equal provenance is there.
    `copying_from`: a copy of that store, refused by readers until `Store.copy_done`."""
    if shard_tokens < 1 or shard_tokens % SHARD_MULTIPLE:
        raise StoreError(f"shard_tokens must be a positive multiple of {SHARD_MULTIPLE}, got "
                         f"{shard_tokens}")
    zstore = zarr_store(url, read_only=False)
    if _has_any_key(zstore):
        store = _open(url, zstore, mode="r+")
        diffs = store.meta.mismatches(meta)
        if diffs:
            raise StoreError(
                f"{url} already holds a store made differently; refusing to mix them:\n  "
                + "\n  ".join(diffs)
            )
        if PARTS_GROUP not in store.child_names(""):  # a creation cut short between its writes
            store.root.require_group(PARTS_GROUP)
        return store
    _remove_partials(zstore, "")  # a first write cut short; nobody else writes before this one
    root = zarr.create_group(zstore, attributes={
        META_KEY: meta.to_dict(),
        LAYOUT_KEY: {"shard_tokens": shard_tokens},
        **({COPYING_KEY: copying_from} if copying_from is not None else {}),
    })
    root.create_group(PARTS_GROUP)
    return Store(url, root, meta, mode="r+")


def _remove_partials(zstore, prefix: str) -> None:
    """Delete the `*.partial` files directly under `prefix` that local atomic writes cut short
    by a crash left (an object-store PUT leaves none). Callers hold the claim on what lies
    there: nobody else can have a write in flight in it."""
    if isinstance(zstore, LocalStore):
        for leftover in (Path(zstore.root) / prefix).glob("*.partial"):
            leftover.unlink(missing_ok=True)


def open_store(url: str, mode: Literal["r", "r+"] = "r") -> "Store":
    """Open an existing store; StoreError if it is missing, not a dflash store, or too new."""
    return _open(url, zarr_store(url, read_only=mode == "r"), mode)


def read_meta_dict(root: zarr.Group, url: str) -> dict:
    attrs = dict(root.attrs)
    if META_KEY not in attrs:
        raise StoreError(f"{url} is a zarr group but not a dflash store (no '{META_KEY}' attrs)")
    if COPYING_KEY in attrs:
        raise StoreError(f"{url} is an unfinished copy of {attrs[COPYING_KEY]} (a `dflash store "
                         "convert` into it was interrupted): remove it and convert again")
    d = attrs[META_KEY]
    if not isinstance(d, dict):
        raise StoreError(f"{url}: its '{META_KEY}' attributes are {type(d).__name__}, not an "
                         "object: the store's attributes were changed or torn; restore them "
                         "from a copy, or extract the store again")
    version = d.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise StoreError(f"{url}: its schema version {version!r} is not an integer: the "
                         "store's attributes were changed or torn; restore them from a copy, "
                         "or extract the store again")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{url} has schema version {version!r}; this dflash reads up to {SCHEMA_VERSION}. "
            "Upgrade dflash to read it."
        )
    return d


def read_shard_tokens(attrs: dict, url: str) -> int:
    """The layout's shard_tokens, checked once for every reader: each steps through a part
    a shard at a time, so a value create_store would refuse is a damaged store."""
    try:
        shard = Fields(attrs, f"{url}: root attributes", StoreError).mapping(LAYOUT_KEY) \
            .integer("shard_tokens", low=SHARD_MULTIPLE)
        if shard % SHARD_MULTIPLE:
            raise StoreError(f"{url}: shard_tokens {shard} is not a multiple of "
                             f"{SHARD_MULTIPLE}")
    except StoreError as e:
        raise StoreError(f"{e}; the store's '{LAYOUT_KEY}' attributes were changed or torn: "
                         "restore them from a copy, or extract the store again") from e
    return shard


def _open(url: str, zstore, mode: str) -> "Store":
    try:
        root = zarr.open_group(zstore, mode=mode)
    except Exception as e:  # zarr raises several types for a missing or torn group
        raise StoreError(f"{url} is not a readable zarr store: {e}") from e
    recorded = read_meta_dict(root, url)
    try:
        meta = StoreMeta.from_dict(recorded)
    except StoreError as e:
        raise StoreError(f"{url}: {e}; the store's attributes were changed or torn: restore "
                         "them from a copy, or extract the store again") from e
    return Store(url, root, meta, mode=mode)


class Store:
    """An open store. Parts are written by PartWriter and read through Part."""

    def __init__(self, url: str, root: zarr.Group, meta: StoreMeta, mode: str):
        self.url = url
        self.root = root
        self.meta = meta
        self.mode = mode
        self.shard_tokens = read_shard_tokens(dict(root.attrs), url)

    def __repr__(self) -> str:
        return f"Store({self.url!r}, parts={self.meta.num_parts})"

    def _require_writable(self) -> None:
        if self.mode == "r":
            raise StoreError(f"{self.url} is open read-only")

    # -- frozen target rows ------------------------------------------------------------

    def write_target_rows(
        self, embed_tokens: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor
    ) -> dict[str, str]:
        """Copy the frozen rows the drafter borrows, in the store's hidden dtype; returns the
        sha256 of each array as stored, by path (frozen.py keeps them in its record)."""
        self._require_writable()
        vocab, hidden = self.meta.target.vocab_size, self.meta.target.hidden_size
        rows = {"embed_tokens": embed_tokens, "lm_head": lm_head, "final_norm": final_norm}
        shapes = {"embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden),
                  "final_norm": (hidden,)}
        dt = self.meta.hidden_dtype
        group = self.root.require_group(TARGET_GROUP)
        digests = {}
        for name in TARGET_ARRAYS:
            t = rows[name].detach().to("cpu", dtype=torch.float32).to(torch_dtype(dt))
            if tuple(t.shape) != shapes[name]:
                raise StoreError(f"target row {name} has shape {tuple(t.shape)}, "
                                 f"expected {shapes[name]} from the store's provenance")
            chunks = (min(vocab, max(1, (64 << 20) // (2 * hidden))), hidden) if t.ndim == 2 \
                else (hidden,)
            arr = group.create_array(name, shape=t.shape, chunks=chunks,
                                     dtype=storage_dtype(dt), compressors=token_compressors(),
                                     overwrite=True, config=_PRESENT)
            data = hidden_to_numpy(t, dt)
            arr[...] = data
            digests[f"{TARGET_GROUP}/{name}"] = digest(data)
        return digests

    def target_rows(self) -> dict[str, torch.Tensor]:
        """embed_tokens [V, H], lm_head [V, H], final_norm [H] in the hidden dtype."""
        self._require_frozen_written()
        if TARGET_GROUP not in self.child_names(""):
            raise StoreError(f"{self.url} holds no frozen target rows; "
                             "was extract interrupted before writing them?")
        return {n: hidden_from_numpy(self.read_frozen(f"{TARGET_GROUP}/{n}"),
                                     self.meta.hidden_dtype) for n in TARGET_ARRAYS}

    # -- frozen arrays: target rows and carried files ----------------------------------

    def frozen_paths(self) -> list[str]:
        """Paths of the frozen arrays present: the target rows, then every carried file
        (listed, not opened: one may be torn)."""
        top = self.child_names("")
        paths = [f"{TARGET_GROUP}/{n}" for n in self.child_names(TARGET_GROUP)] \
            if TARGET_GROUP in top else []
        if FILES_GROUP in top:
            for group in self.child_names(FILES_GROUP):
                paths += [f"{FILES_GROUP}/{group}/{n}"
                          for n in self.child_names(f"{FILES_GROUP}/{group}")]
        return paths

    def frozen_problem(self, path: str, read_data: bool = True) -> tuple[str, str] | None:
        """(kind, message) of what is wrong with frozen array `path`, or None: its metadata
        unreadable ("metadata"), a chunk object absent, which zarr would read as zeros
        ("missing"), or (read_data) a chunk failing its checksum ("checksum"). validate
        reports it; read_frozen refuses it."""
        return self.frozen_data(path, read_data)[1]

    def read_frozen(self, path: str) -> np.ndarray:
        """Frozen array `path`, whole; StoreError naming it when it is damaged."""
        data, problem = self.frozen_data(path, read_data=True)
        if problem is not None:
            raise StoreError(f"{self.url}: {problem[1]}; refusing a damaged store: run "
                             f"`dflash store validate {self.url}` for every problem")
        return data

    def frozen_data(self, path: str, read_data: bool = True
                    ) -> tuple[np.ndarray | None, tuple[str, str] | None]:
        """(frozen array `path` whole when `read_data` and sound, else None; frozen_problem's
        answer): validate reads each once to check it and compare it with the frozen record."""
        try:
            arr = self.root[path]
        except KeyError:
            return None, ("missing", f"{path} is missing")
        except Exception as e:  # zarr surfaces a torn zarr.json as a JSON or metadata error
            return None, ("metadata", f"{path} metadata (zarr.json) is unreadable: "
                                      f"{one_line(e)}")
        if not isinstance(arr, zarr.Array):
            return None, ("layout", f"{path} is a group, not an array")
        missing = missing_chunks(arr)
        if missing:
            return None, ("missing", f"{path} chunk '{missing[0][2]}' is missing")
        if not read_data:
            return None, None
        try:
            return arr[...], None
        except Exception as e:  # codecs raise ValueError/RuntimeError on corrupt bytes
            return None, ("checksum", f"{path} cannot be read: {type(e).__name__}: "
                                      f"{one_line(e)}")

    # -- the frozen unit's record (frozen.py) -------------------------------------------

    def frozen_record(self) -> FrozenRecord:
        return read_record(dict(self.root.attrs), self.url)

    def set_frozen_record(self, record: dict) -> None:
        """Write the frozen unit's record: one write of the root metadata."""
        self._require_writable()
        self.root.attrs[FROZEN_KEY] = record

    def remove_frozen(self) -> None:
        """Delete the target rows and carried files (with the leftovers of their writes cut
        short) for frozen.write_frozen to write them again."""
        self._require_writable()
        top = self.child_names("")
        for group in (TARGET_GROUP, FILES_GROUP):
            if group in top:
                del self.root[group]

    def _require_frozen_written(self) -> None:
        if self.frozen_record().state == "unfinished":
            raise StoreError(
                f"{self.url}: its creation was cut short before the target rows and files "
                "were all written; re-run the same `dflash extract` to finish them")

    # -- opaque files (tokenizer) ------------------------------------------------------

    def copy_done(self) -> None:
        """Mark a copy made with create_store(copying_from=...) whole: readers accept it."""
        self._require_writable()
        del self.root.attrs[COPYING_KEY]

    def write_files(self, group: str, files: dict[str, bytes]) -> dict[str, str]:
        """Keep small files (e.g. the tokenizer) inside the store as uint8 arrays; returns
        the sha256 of each, by path (frozen.py keeps them in its record)."""
        self._require_writable()
        g = self.root.require_group(f"{FILES_GROUP}/{group}")
        digests = {}
        for name, data in files.items():
            a = np.frombuffer(data, dtype=np.uint8)
            arr = g.create_array(name, shape=a.shape, chunks=(max(1, a.size),), dtype=np.uint8,
                                 compressors=token_compressors(), overwrite=True,
                                 config=_PRESENT)
            if a.size:
                arr[...] = a
            digests[file_path(group, name)] = digest(a)
        return digests

    def read_files(self, group: str) -> dict[str, bytes]:
        """The files kept by write_files; StoreError naming a damaged one, or, where the
        frozen record lists them, one that is missing or differs from it."""
        self._require_frozen_written()
        record = self.frozen_record().sha256
        prefix = f"{FILES_GROUP}/{group}"
        if record:
            names = [p.removeprefix(prefix + "/") for p in record if p.startswith(prefix + "/")]
        elif group in (self.child_names(FILES_GROUP)
                       if FILES_GROUP in self.child_names("") else []):
            names = self.child_names(prefix)
        else:
            names = []
        if not names:
            raise StoreError(f"{self.url} holds no '{group}' files")
        files = {name: self.read_frozen(f"{prefix}/{name}") for name in sorted(names)}
        for name, data in files.items():
            want = record.get(f"{prefix}/{name}")
            if want is not None and digest(data) != want:
                raise StoreError(f"{self.url}: {prefix}/{name} differs from the store's "
                                 "record of it (changed after extract wrote it); refusing a "
                                 f"damaged store: run `dflash store validate {self.url}`")
        return {name: data.tobytes() for name, data in files.items()}

    # -- parts -------------------------------------------------------------------------

    def part_writer(self, index: int, row_start: int, row_stop: int,
                    flush_shards: int = 1) -> PartWriter:
        """Create part `index` (source rows [row_start, row_stop)) or resume it."""
        self._require_writable()
        if not 0 <= index < self.meta.num_parts:
            raise StoreError(f"part {index} is outside the plan of {self.meta.num_parts} parts")
        self._remove_torn_writes(index)
        return PartWriter(self, index, row_start, row_stop, flush_shards)

    def _remove_torn_writes(self, index: int) -> None:
        """Delete the `*.partial` temp files that atomic writes cut short by a crash left in
        part `index` (local disks; an object-store PUT leaves none). Only the part's writer,
        holding its claim, gets here: nobody else can have a write in flight in that part."""
        zstore = self.root.store
        if isinstance(zstore, LocalStore):
            part_dir = Path(zstore.root) / self.root.path / part_path(index)
            for leftover in part_dir.rglob("*.partial"):
                leftover.unlink(missing_ok=True)

    def part(self, index: int) -> Part:
        try:
            group = self.root[part_path(index)]
        except KeyError as e:
            raise StoreError(f"{self.url}: part {index} does not exist") from e
        except Exception as e:  # a torn zarr.json surfaces as a JSON or metadata error
            raise StoreError(f"{self.url}: part {index} metadata is unreadable: {e}") from e
        return Part(self, index, group)

    def child_names(self, path: str) -> list[str]:
        """Names directly under group `path` ("" for the root), listed without opening them."""
        prefix = "/".join(p for p in (self.root.path, path) if p)
        return child_names(self.root.store, prefix)

    def part_names(self) -> list[str]:
        """Names under parts/, listed without opening them (one may be torn). Leftovers of
        an atomic write cut short by a crash (`*.partial`, local disks) are not parts."""
        return self.child_names(PARTS_GROUP)

    def part_indices(self) -> list[int]:
        return [int(n) for n in self.part_names() if n.isdigit()]

    def parts(self) -> list[Part]:
        """Parts with a commit record, in index order. A part whose creation was torn by a
        crash has none: it holds nothing and counts as not started. A part whose metadata is
        unreadable is left out too: `unreadable_parts` names those."""
        found = []
        for i in self.part_indices():
            try:
                found.append(self.part(i))
            except StoreError:
                continue
        return found

    def unreadable_parts(self) -> list[int]:
        """Parts listed under parts/ whose group metadata (zarr.json) cannot be read, or whose
        commit record is damaged (part.commit_record): damaged, unlike a part whose creation
        a crash cut short before its commit record (it holds nothing: not started)."""
        bad = []
        for i in self.part_indices():
            try:
                group = self.root[part_path(i)]
            except KeyError:  # no metadata yet: a kill came before its first write
                continue
            except Exception:  # torn JSON, undecodable metadata
                bad.append(i)
                continue
            try:
                commit_record(dict(group.attrs), f"{self.url}: part {i}")
            except Exception:  # an absent or damaged commit record
                bad.append(i)
        return bad

    def unfinished_parts(self) -> list[int]:
        """Planned parts extraction has not completed (not started, being written, or stopped
        mid-way): train and eval leave them out. Unreadable part metadata is damage instead."""
        complete = {p.index for p in self.parts() if p.complete}
        unreadable = set(self.unreadable_parts())
        planned = range(max([self.meta.num_parts, *(i + 1 for i in self.part_indices())]))
        return [i for i in planned if i not in complete and i not in unreadable]

    @property
    def complete(self) -> bool:
        """Every planned part complete, and the frozen unit not left unfinished."""
        parts = self.parts()
        return (len(parts) == self.meta.num_parts and all(p.complete for p in parts)
                and self.frozen_record().state != "unfinished")

    @property
    def num_samples(self) -> int:
        return sum(p.num_samples for p in self.parts())

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts())

