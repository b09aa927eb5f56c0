"""What eval does about a damaged store: refuse it, or (with --skip-corrupt) skip and list;
and the parts it leaves out because extraction has not finished them (as train does).

Owns the policy only: the checks themselves live in dflash_train.store_schema.integrity (a
structural check before reading that reads no chunk data; a guard naming the sample whose
bytes fail their checksum while reading). Never repairs a store and never drops a sample
without listing it in the report.
"""

from dataclasses import dataclass, field

from dflash_train.evaluate.errors import EvalError
from dflash_train.store_schema import Damage, Store, StoreError, check_before_reading, refusal
from dflash_train.store_schema.integrity import refuse_unless_skipping


@dataclass
class DamagePolicy:
    """Damage known before reading, whether to skip it, and what was skipped."""

    known: list[Damage] = field(default_factory=list)
    """Found by the structural check before reading."""
    skip: bool = False
    """Skip (and list) damaged samples; False refuses the store at the first one."""
    skipped: list[Damage] = field(default_factory=list)
    """Every damaged sample or part left out, in the order met."""
    unfinished: list[int] = field(default_factory=list)
    """Parts extraction has not marked complete: never read, like train."""

    def __post_init__(self) -> None:
        self._parts = {d.part for d in self.known if d.sample is None}
        self._samples = {(d.part, d.sample): d for d in self.known if d.sample is not None}
        self.skipped += [d for d in self.known if d.sample is None]  # never read at all

    def part_is_left_out(self, part: int) -> bool:
        """Damaged (known before reading) or unfinished: none of its samples is read."""
        return part in self._parts or part in self.unfinished

    def known_damage(self, part: int, sample: int) -> Damage | None:
        return self._samples.get((part, sample))

    def handle(self, damage: Damage) -> None:
        """List a damaged sample as skipped, or refuse the store naming it."""
        if not self.skip:
            raise EvalError(str(refusal([damage])))
        self.skipped.append(damage)

    def report(self) -> dict:
        """JSON-ready: how many samples (and whole parts) were skipped, and which."""
        return {"samples": sum(d.sample is not None for d in self.skipped),
                "parts": sum(d.sample is None for d in self.skipped),
                "skipped": [d.as_dict() for d in self.skipped]}


def check_store(store: Store, skip: bool) -> DamagePolicy:
    """The structural check over every complete part (the ones eval reads); EvalError (one
    line naming store, part and sample) unless `skip`, and always for damage to the store's
    own metadata. Unfinished parts are left out, listed in `unfinished`."""
    parts = store.parts()
    damage = check_before_reading(store, [p.index for p in parts if p.complete])
    try:
        refuse_unless_skipping(damage, skip)
    except StoreError as e:
        raise EvalError(str(e)) from e
    return DamagePolicy(known=damage, skip=skip, unfinished=store.unfinished_parts())
