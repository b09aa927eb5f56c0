"""Provenance recorded in every store: which target, tokenizer, layers and data made it.

Stages compare it before trusting a store: a resumed extract, a training run and an eval all
refuse a store whose provenance differs from what they expect, naming every differing field.
"""

import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from dflash_train.json_fields import show_value
from dflash_train.store_schema.errors import StoreError
from dflash_train.store_schema.layout import (
    CONTEXT_DTYPES,
    FP8_CONTEXT,
    HIDDEN_DTYPES,
    schema_version_for,
)

SAMPLING_KEY = "sampling"
"""The key of `StoreMeta.extra` that records how sampled answers were drawn."""
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")
"""What it holds: target_model/sampling.py's SamplingConfig, field for field."""
DRAWN_BY_KEY = "drawn_by"
"""The key of `StoreMeta.extra` that names who drew sampled answers when it was not our keyed
sampler: SERVER_DRAWN, or absent."""
SERVER_DRAWN = "server"
"""Sampled by a server with a seed per request (extract --server): its own random stream, so
live decoding cannot draw those answers again."""


@dataclass
class TargetInfo:
    """The target model whose states the store holds."""

    name_or_path: str
    revision: str | None
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    config_sha256: str
    weights_sha256: str | None = None
    """The weights' identity: a transformers directory's sampled fingerprint
    (target/weights.py), a GGUF file's whole-content sha256. When both sides of a comparison
    have one it replaces the path (a copy elsewhere is the same target, other weights at the
    same path are not); a store made before it existed (None) is checked by path."""


def target_differences(a: TargetInfo, b: TargetInfo) -> list[tuple[str, Any, Any]]:
    """(field, a's value, b's value) for every field where `a` and `b` are not the same target:
    the one same-target rule of extract's resume, eval --online / --served and StoreMeta.

    The weights name the target where both have a fingerprint (a copy at another path is the
    same target, other weights at the same path are not); else its path does (a hub id, or a
    store made before fingerprints)."""
    both = a.weights_sha256 is not None and b.weights_sha256 is not None
    ignored = "name_or_path" if both else "weights_sha256"
    return [(f.name, getattr(a, f.name), getattr(b, f.name)) for f in fields(TargetInfo)
            if f.name != ignored and getattr(a, f.name) != getattr(b, f.name)]


@dataclass
class TokenizerInfo:
    """The tokenizer and chat rendering that produced input_ids and loss_mask."""

    sha256: str
    chat_template_sha256: str | None
    enable_thinking: bool


@dataclass
class SourceInfo:
    """The input dataset."""

    paths: list[str]
    sha256: list[str]
    max_length: int
    regenerated: bool
    """Responses replaced by the target's own output (offline tau is then exact): greedy,
    or sampled as StoreMeta.sampling says."""
    num_rows: int
    """Rows in the input dataset; parts split these rows."""


@dataclass
class CreatedWith:
    """Software and hardware that wrote the store. Informational: never compared."""

    dflash: str
    torch: str
    transformers: str
    device: str
    kernels: str


@dataclass
class StoreMeta:
    """Everything a later stage needs to know about how a store was made."""

    target: TargetInfo
    tokenizer: TokenizerInfo
    source: SourceInfo
    created_with: CreatedWith
    context_layer_ids: list[int]
    """Target layers concatenated as drafter context; id k = HF hidden_states[k + 1]."""
    top_k: int
    """Verifier top-k logits stored per token (argmax first)."""
    hidden_dtype: str
    """Logical dtype of context and target rows: bfloat16 | float16 | float32. Readers hand
    out context in it whatever the context is stored as."""
    num_parts: int
    """Parts planned; part p holds a fixed slice of the source rows."""
    context_dtype: str | None = None
    """How context is stored: None in the hidden dtype; "float8_e4m3": E4M3 values with one
    float32 scale per token and layer (store_schema/fp8.py), dequantized on read. Left out
    of the recorded provenance when None, so a default store's bytes are what they were."""
    schema_version: int | None = None
    """None: the version this store is written with (layout.schema_version_for)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance a stage adds (compared like the rest)."""

    def __post_init__(self) -> None:
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise StoreError(f"hidden_dtype {self.hidden_dtype!r} is not one of {HIDDEN_DTYPES}")
        if not self.context_layer_ids:
            raise StoreError("context_layer_ids is empty: a store needs at least one layer")
        if self.context_dtype is not None and self.context_dtype not in CONTEXT_DTYPES:
            raise StoreError(f"context_dtype {self.context_dtype!r} is not one of "
                             f"{CONTEXT_DTYPES} (or none: the hidden dtype)")
        needed = schema_version_for(self.context_dtype)
        if self.schema_version is None:
            self.schema_version = needed
        elif self.schema_version < needed:  # an old writer cannot have made this store
            raise StoreError(f"schema version {self.schema_version} cannot hold "
                             f"{self.context_dtype} context (needs {needed})")
        if self.top_k < 1 or self.num_parts < 1:
            raise StoreError(f"top_k ({self.top_k}) and num_parts ({self.num_parts}) must be >= 1")

    @property
    def sampling(self) -> dict[str, Any] | None:
        """How a regenerated store's answers were drawn ({temperature, top_p, top_k, seed}:
        SamplingConfig(**it) draws them again); None: greedy, or the dataset's answers. Only a
        sampled store records it, so a greedy store's provenance is what it always was."""
        s = self.extra.get(SAMPLING_KEY)
        if s is not None and not (isinstance(s, dict) and sorted(s) == sorted(SAMPLING_FIELDS)
                                  and self.source.regenerated):
            raise StoreError(f"store provenance is damaged: extra.{SAMPLING_KEY} is "
                             f"{show_value(s)}, not the {SAMPLING_FIELDS} of regenerated answers")
        return s

    @property
    def server_drawn(self) -> bool:
        """Whether the sampled answers came from a server's own random stream (extract
        --server): figures on them are in-distribution, but no live decode draws the same
        tokens, so offline and live rounds cannot be compared one by one."""
        by = self.extra.get(DRAWN_BY_KEY)
        if by is None:
            return False
        if by != SERVER_DRAWN or self.sampling is None:
            raise StoreError(f"store provenance is damaged: extra.{DRAWN_BY_KEY} is "
                             f"{show_value(by)}, not {SERVER_DRAWN!r} beside sampling settings")
        return True

    @property
    def num_context_layers(self) -> int:
        return len(self.context_layer_ids)

    @property
    def fp8(self) -> bool:
        return self.context_dtype == FP8_CONTEXT

    @property
    def context_encoding(self) -> str:
        """What the stored context bits are: the context dtype, else the hidden dtype."""
        return self.context_dtype or self.hidden_dtype

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["context_dtype"] is None:
            del d["context_dtype"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StoreMeta":
        wrong = _wrong_types(cls, d)
        if wrong:
            raise StoreError(f"store provenance is damaged: {wrong}")
        try:
            nested = {
                "target": TargetInfo(**d["target"]),
                "tokenizer": TokenizerInfo(**d["tokenizer"]),
                "source": SourceInfo(**d["source"]),
                "created_with": CreatedWith(**d["created_with"]),
            }
            flat = {f.name: d[f.name] for f in fields(cls) if f.name not in nested and f.name in d}
            meta = cls(**nested, **flat)
        except (KeyError, TypeError) as e:
            raise StoreError(f"store provenance is malformed or incomplete: {e}") from e
        if meta.num_parts > max(1, meta.source.num_rows):  # extract's plan: a row per part
            raise StoreError(f"store provenance is damaged: num_parts {meta.num_parts} is "
                             f"more than the source's {meta.source.num_rows} rows")
        return meta

    def mismatches(self, other: "StoreMeta") -> list[str]:
        """'field: this != other' for every differing field, created_with excepted. The
        target is its weights fingerprint where both have one, else its path; the data is
        its files' sha256 where both record them, else their paths (a moved dataset is the
        same data)."""
        a, b = self.to_dict(), other.to_dict()
        for d in (a, b):
            d.pop("created_with")
            d.pop("target")  # compared by the one same-target rule
        if self.source.sha256 and other.source.sha256:
            for d in (a, b):
                d["source"].pop("paths")
        diffs = list(_diff(a, b)) + [(f"target.{k}", va, vb)
                                     for k, va, vb in target_differences(self.target, other.target)]
        return [f"{k}: {va!r} != {vb!r}" for k, va, vb in sorted(diffs, key=lambda d: d[0])]

    def target_mismatches(self, other: "StoreMeta") -> list[str]:
        """Differences that make features incompatible: another target, tokenizer or layer set.

        Stores that differ only in data, parts, top-k or chat options hold the same features."""
        keys = ("target.", "tokenizer.sha256", "context_layer_ids")
        return [d for d in self.mismatches(other) if d.startswith(keys)]


def _wrong_types(cls, d: Any, prefix: str = "") -> str | None:
    """The first field of `d` (the recorded provenance) that is not of the type `cls`
    declares for it, as 'field is value, not type'; None when all are. A missing field is
    left to the constructor, which names it."""
    if not isinstance(d, dict):
        return f"{prefix.rstrip('.') or 'the provenance'} is {show_value(d)}, not an object"
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name not in d:
            continue
        hint, value, key = hints[f.name], d[f.name], prefix + f.name
        if is_dataclass(hint):
            wrong = _wrong_types(hint, value, f"{key}.")
            if wrong:
                return wrong
        elif not _fits(value, hint):
            return f"{key} is {show_value(value)}, not {_type_name(hint)}"
    return None


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of type `hint` (a boolean is no number here)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return (isinstance(value, int) or hint is float and isinstance(value, float)) \
            and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
          type(None): "null"}


def _type_name(hint: Any) -> str:
    """`hint` as a JSON reader says it: 'a list of integers', 'a string or null'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return "a list of " + _type_name(args[0]).split(" ", 1)[1] + "s"
    if origin is dict:
        return "an object"
    return _NAMES.get(hint, str(hint))


def _diff(a: Any, b: Any, prefix: str = ""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            yield from _diff(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip("."), a, b
