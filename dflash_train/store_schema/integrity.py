"""What a reader (train, eval) does about a damaged store: refuse it, or skip what is damaged.

Two cheap guards, no full scan:
- before reading, `check_before_reading`: validate(check_data=False) over the parts a stage
  will read: commit records, array metadata, offsets and the presence of every shard object,
  and the metadata and chunk objects of the frozen target rows and carried files. It reads
  the offsets and lists object names, never chunk data, so it costs O(parts + shard
  objects), not O(store bytes). A missing shard must be caught here: zarr would read it as
  zeros. `store stats` runs the same check before it reads.
- while reading, `read_guarded`: a sample whose bytes fail their crc32c or do not decode
  becomes a `Damage` naming store, part and sample, instead of a codec traceback;
  `read_by_span` reads a shard of tokens at a time and falls back to reading sample by
  sample only where a span fails, so that only the damaged samples are named.
Damage found either way is refused (`refusal`) unless the caller opted in to skipping it.
This module never decides that policy itself and never repairs anything.
"""

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from dflash_train.store_schema.errors import StoreError, one_line
from dflash_train.store_schema.store import Store
from dflash_train.store_schema.validate import validate

T = TypeVar("T")
SKIP_HINT = "--skip-corrupt"
"""The flag of train and eval that skips damaged samples; named in every refusal."""


@dataclass(frozen=True)
class Damage:
    """A damaged sample, or a whole part (sample None: its metadata is unreadable)."""

    store: str
    part: int | None
    """None: the store itself (schema, layout); such damage can never be skipped."""
    sample: int | None
    reason: str

    def __str__(self) -> str:
        if self.part is None:
            where = "store metadata"
        elif self.sample is None:
            where = f"part {self.part} metadata"
        else:
            where = f"part {self.part} sample {self.sample}"
        return f"{self.store}: {where}: {self.reason}"

    def as_dict(self) -> dict:
        return {"store": self.store, "part": self.part, "sample": self.sample,
                "reason": self.reason}


def check_before_reading(store: Store, parts: Iterable[int]) -> list[Damage]:
    """Damage in the parts a stage will read, and in any part whose metadata is unreadable
    (Store.parts() leaves such a part out, which would otherwise drop it silently)."""
    wanted = set(parts) | set(store.unreadable_parts())
    damage = []
    for f in validate(store, check_data=False):
        if f.part is None or f.part in wanted:
            reason = one_line(f"[{f.kind}] {f.message}")
            damage.append(Damage(store.url, f.part, f.sample, reason))
    return damage


def read_guarded(store_url: str, part: int, sample: int, read: Callable[[], T]
                 ) -> tuple[T | None, Damage | None]:
    """read(), or the Damage naming the sample when its bytes cannot be read or decoded."""
    try:
        return read(), None
    except Exception as e:  # zarr and the codecs raise ValueError, RuntimeError, OSError, ...
        reason = one_line(f"cannot be read: {type(e).__name__}: {e}")
        return None, Damage(store_url, part, sample, reason)


def read_by_span(store_url: str, part: int, spans: Iterable[tuple[int, int]],
                 read_span: Callable[[int, int], Sequence[T]], read_one: Callable[[int], T]
                 ) -> Iterator[tuple[int, T | None, Damage | None]]:
    """(sample, what was read, None) for each sample of `spans` in order, each span read at
    once by read_span(i, j); a span that fails is read again sample by sample by read_one(s),
    where a damaged sample gives (sample, None, its Damage). Lazy: a span is read only when
    the caller reaches it."""
    for a, b in spans:
        values, _ = read_guarded(store_url, part, a, lambda a=a, b=b: read_span(a, b))
        for s in range(a, b):
            if values is not None:
                yield s, values[s - a], None
            else:
                value, damage = read_guarded(store_url, part, s, lambda s=s: read_one(s))
                yield s, value, damage


def refusal(damage: list[Damage]) -> StoreError:
    """One line naming the first damage, how much more there is, and the way out."""
    first = damage[0]
    more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
    skippable = all(d.part is not None for d in damage)
    way_out = f"; pass {SKIP_HINT} to skip the damaged samples" if skippable else ""
    return StoreError(f"{first}{more}; refusing a damaged store: run `dflash store validate "
                      f"{first.store}` for every problem{way_out}")


def unskippable(damage: list[Damage]) -> list[Damage]:
    """Damage no skipping can step around: the store's own metadata."""
    return [d for d in damage if d.part is None]


def refuse_unless_skipping(damage: list[Damage], skip: bool) -> None:
    """The refusal (StoreError) for damage found before reading, unless the caller skips it;
    damage to the store's own metadata is refused even then."""
    if damage and (not skip or unskippable(damage)):
        raise refusal(unskippable(damage) or damage)
