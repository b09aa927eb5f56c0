"""One row of the benchmark table, and the table as printed and as written to the docs.

Owns formatting only; never measures anything.
"""

from dataclasses import dataclass


@dataclass
class Row:
    """One measured ratio (or size) and the goal it is held against."""

    item: str
    """The issue's item number and name, e.g. "1 write"."""
    what: str
    """What is divided by what."""
    value: str
    """The measured ratio / size, with its absolute numbers in brackets."""
    goal: str = ""
    """The goal, e.g. ">= 0.7x"; empty when the row is informative only."""
    met: bool | None = None
    """Whether the goal is met; None without a goal."""


def verdict(row: Row) -> str:
    return "" if row.met is None else ("met" if row.met else "MISSED")


def format_table(rows: list[Row]) -> str:
    """Aligned plain-text columns: item, what, value, goal, verdict."""
    cells = [("item", "what", "value", "goal", "")] + [
        (r.item, r.what, r.value, r.goal, verdict(r)) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(5)).rstrip()
                     for c in cells)


def format_markdown(rows: list[Row]) -> str:
    lines = ["| item | what | value | goal | |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.item} | {r.what} | {r.value} | {r.goal} | {verdict(r)} |" for r in rows]
    return "\n".join(lines)
