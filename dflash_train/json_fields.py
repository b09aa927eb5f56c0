"""Checked reads of the JSON records we write and read back (best.json, log records, store
attributes, server replies): every field is checked for presence, type and range, and a
failure names the file (or source) and the field.

JSON has one number type, and Python reads `true` as an int: a boolean is never taken for a
number here, and an integer is bounded by what a float (and an int64 step counter) can hold.
Reads only; never repairs a record.
"""

import math
from collections.abc import Mapping
from typing import Any

from dflash_train.errors import DflashError

LARGEST_INT = 2**53
"""The largest integer a JSON number keeps exactly in every reader (a double's mantissa)."""


def show_value(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Fields:
    """One JSON object read field by field: `Fields(raw, "RUN/best.json", TrainError)`.

    Each accessor returns the checked value or raises `error` naming `where` and the field.
    """

    def __init__(self, raw: Any, where: str, error: type[DflashError]):
        if not isinstance(raw, Mapping):
            raise error(f"{where}: expected a JSON object, got {show_value(raw)}")
        self.raw, self.where, self.error = raw, where, error

    def _fail(self, name: str, value: Any, wanted: str) -> DflashError:
        return self.error(f"{self.where}: field {name!r} is {show_value(value)}, not {wanted}")

    def get(self, name: str) -> Any:
        if name not in self.raw:
            raise self.error(f"{self.where}: field {name!r} is missing")
        return self.raw[name]

    def integer(self, name: str, low: int | None = None, high: int = LARGEST_INT) -> int:
        """An integer in [low, high] (a bool or a float is refused)."""
        value = self.get(name)
        if not is_integer(value) or value > high or (low is not None and value < low):
            bounds = f" in [{low if low is not None else -LARGEST_INT}, {high}]"
            raise self._fail(name, value, f"an integer{bounds}")
        return value

    def number(self, name: str, finite: bool = True) -> float:
        """A JSON number as a float; NaN and Inf only when `finite` is False."""
        value = self.get(name)
        if not is_number(value) or (finite and not math.isfinite(value)):
            raise self._fail(name, value, "a finite number" if finite else "a number")
        return float(value)

    def text(self, name: str, choices: tuple[str, ...] | None = None) -> str:
        value = self.get(name)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            raise self._fail(name, value, f"one of {choices}" if choices else "a string")
        return value

    def mapping(self, name: str) -> "Fields":
        value = self.get(name)
        if not isinstance(value, Mapping):
            raise self._fail(name, value, "an object")
        return Fields(value, f"{self.where} [{name!r}]", self.error)

    def sequence(self, name: str) -> list:
        value = self.get(name)
        if not isinstance(value, list):
            raise self._fail(name, value, "a list")
        return value


def is_integer(value: Any) -> bool:
    """A JSON integer a double keeps exactly; not a boolean."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= LARGEST_INT


def is_number(value: Any) -> bool:
    """A JSON number (NaN and Inf included); not a boolean, nor an integer a double cannot
    hold."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, float) or abs(value) <= LARGEST_INT
