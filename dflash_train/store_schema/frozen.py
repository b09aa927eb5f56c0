"""A store's frozen unit: the target rows and the carried files (the target's config, the
tokenizer) written once after the store is created, committed whole or written again.

Its record, the root attribute `dflash_frozen` (layout.FROZEN_KEY), is the commit:
- `{"complete": false}`, written before the unit's first array: the unit is unfinished.
  Readers refuse its rows and files, validate leaves them alone (work in flight), and the next
  writer deletes them and writes the whole unit again.
- `{"complete": true, "sha256": {path: hex}}`, written last in one object write (a rename on
  a local disk, one PUT on an object store) once every array is stored: the sha256 of each
  array's stored bytes by path (`target/embed_tokens`, `files/tokenizer/tokenizer.json`, ...).
  It lists every file kept, so validate names a file that is missing, differs or was added,
  and `Store.read_files` refuses one that differs.
- absent: a store written before the record existed (or assembled piece by piece through the
  Store methods, as tests do). Its rows and files are trusted as present, as they always
  were; validate can check that each is readable, not that none is missing or changed.
Never decides what goes into the unit: extract and copy_store hand it the rows and files.
"""

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from dflash_train.store_schema.errors import StoreError
from dflash_train.store_schema.layout import FILES_GROUP, FROZEN_KEY, TARGET_ARRAYS, TARGET_GROUP

if TYPE_CHECKING:
    from dflash_train.store_schema.store import Store

FrozenState = Literal["whole", "unfinished", "unrecorded"]


@dataclass(frozen=True)
class FrozenRecord:
    """What a store's root attributes say about its frozen unit."""

    state: FrozenState
    """whole: committed; unfinished: being written, or a write cut short; unrecorded: a store
    made before the record."""
    sha256: dict[str, str] = field(default_factory=dict)
    """sha256 of every array of a whole unit, by path; empty otherwise."""


def read_record(attrs: dict, url: str) -> FrozenRecord:
    """The frozen record in a store's root `attrs`; StoreError naming it when malformed."""
    if FROZEN_KEY not in attrs:
        return FrozenRecord("unrecorded")
    raw = attrs[FROZEN_KEY]
    if isinstance(raw, dict) and raw.get("complete") is False:
        return FrozenRecord("unfinished")
    digests = raw.get("sha256") if isinstance(raw, dict) else None
    if not (isinstance(raw, dict) and raw.get("complete") is True and _is_digest_map(digests)):
        raise StoreError(f"{url}: its frozen-unit record (root attribute '{FROZEN_KEY}') is "
                         f"malformed: {str(raw)[:200]}; the store was damaged or edited: "
                         "extract it again")
    return FrozenRecord("whole", dict(digests))


def _is_digest_map(digests) -> bool:
    return isinstance(digests, dict) and all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in digests.items())


def digest(a: np.ndarray) -> str:
    """sha256 of an array's bytes in C order: what the record holds for a stored array."""
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()


def target_row_paths() -> list[str]:
    return [f"{TARGET_GROUP}/{name}" for name in TARGET_ARRAYS]


def file_path(group: str, name: str) -> str:
    return f"{FILES_GROUP}/{group}/{name}"


def write_frozen(store: "Store", rows: dict[str, torch.Tensor],
                 files: dict[str, dict[str, bytes]]) -> None:
    """Write the frozen unit whole: mark it unfinished, delete what an earlier write left,
    write the target rows (`rows`: embed_tokens, lm_head, final_norm) and every file group,
    then the record. One writer at a time: the caller holds the store's claim on it."""
    store.set_frozen_record({"complete": False})
    store.remove_frozen()
    digests = store.write_target_rows(rows["embed_tokens"], rows["lm_head"],
                                      rows["final_norm"])
    for group, named in files.items():
        digests.update(store.write_files(group, named))
    store.set_frozen_record({"complete": True, "sha256": dict(sorted(digests.items()))})


def frozen_written(store: "Store", files: dict[str, dict[str, bytes]]) -> bool:
    """Whether the unit needs no writing: its record says it is whole; or, in a store made
    before the record, every target row and every one of `files` is present (then it is
    left as it is: nothing of it can be checked against a record)."""
    record = store.frozen_record()
    if record.state != "unrecorded":
        return record.state == "whole"
    wanted = set(target_row_paths()) | {file_path(group, name)
                                        for group, named in files.items() for name in named}
    return wanted <= set(store.frozen_paths())
