"""The feature-store contract: the only package that knows how a store is laid out on disk.

Every stage reads and writes hs.zarr through these names. Layout: layout.py; provenance:
meta.py; writing and reading parts: part.py (whole context shards, coded in parallel:
shards.py); checking a store: validate.py; which chunk objects an array needs and lacks:
chunks.py; what readers do about damage: integrity.py; a store of some of another's samples:
subset.py.
"""

from dflash_train.store_schema.errors import StoreError
from dflash_train.store_schema.integrity import Damage, check_before_reading, read_guarded, refusal
from dflash_train.store_schema.layout import SCHEMA_VERSION
from dflash_train.store_schema.meta import (
    CreatedWith,
    SourceInfo,
    StoreMeta,
    TargetInfo,
    TokenizerInfo,
    target_differences,
)
from dflash_train.store_schema.part import Part, PartWriter
from dflash_train.store_schema.sample import Sample
from dflash_train.store_schema.store import Store, create_store, open_store
from dflash_train.store_schema.validate import Finding, validate

__all__ = [
    "SCHEMA_VERSION",
    "CreatedWith",
    "Damage",
    "Finding",
    "Part",
    "PartWriter",
    "Sample",
    "SourceInfo",
    "Store",
    "StoreError",
    "StoreMeta",
    "TargetInfo",
    "TokenizerInfo",
    "check_before_reading",
    "create_store",
    "open_store",
    "read_guarded",
    "refusal",
    "target_differences",
    "validate",
]
