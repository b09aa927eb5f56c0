"""The corpus of the embedded tiny target: the running Python's own standard library source.

Owns which files count (no tests, no codec tables, no generated data, no duplicates), the
split into train and held-out files (by a hash of the file's relative path, so it does not
depend on listing order), the "continue this code" examples cut from a file's lines, and the
repeated-4-gram share that measures how much a greedy continuation loops. Never tokenizes
and never touches a model.
"""

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

USER_PREFIX = "Continue this Python code:\n"
"""How every prompt of the embedded set starts; the target is trained on exactly this."""
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings",
                "pydoc_data", "__pycache__", "_bundled", "turtledemo", "lib2to3"}
"""Directories left out: tests and fixtures, codec tables, generated data, installed packages."""
MAX_FILE_BYTES = 400_000
"""Larger files are generated tables, not code anyone writes."""
MAX_LINE_CHARS = 120
"""Examples never contain a longer line (long lines are mostly data literals)."""


@dataclass(frozen=True)
class SourceFile:
    """One stdlib file: its path relative to the stdlib root and its text."""

    name: str
    text: str

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """Every kept .py file under `root` (default: this Python's stdlib), sorted, deduplicated."""
    root = root or stdlib_root()
    seen: set[str] = set()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen or len(text.splitlines()) < 12:
            continue
        seen.add(digest)
        files.append(SourceFile(rel.as_posix(), text))
    return files


def split_of(name: str, held_out_percent: int = 15) -> str:
    """'held_out' for about `held_out_percent` % of files, chosen by a hash of the name."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
    return "held_out" if bucket < held_out_percent else "train"


def _clean_window(lines: list[str], start: int, stop: int) -> bool:
    window = lines[start:stop]
    return (all(len(line) <= MAX_LINE_CHARS for line in window)
            and sum(1 for line in window if line.strip()) >= (stop - start) // 2)


def continuation_example(source: SourceFile, rng: random.Random, *,
                         prompt_lines: tuple[int, int] = (6, 16),
                         max_answer_lines: int = 8,
                         tries: int = 8) -> tuple[str, str] | None:
    """(prompt, answer): a run of lines asking for a continuation, and the paragraph after it.

    The answer runs from the line after the prompt up to (not including) the next blank
    line, and is kept only if that blank line comes within `max_answer_lines`: a target
    trained on these learns that an answer ends where the code's paragraph ends, which is
    what keeps its greedy continuations short and out of loops. None when no clean window
    (short lines, mostly non-blank, a paragraph end in reach) is found in `tries` draws.
    """
    lines = source.lines
    for _ in range(tries):
        n_prompt = rng.randint(*prompt_lines)
        if len(lines) < n_prompt + 2:
            return None
        start = rng.randrange(len(lines) - n_prompt - 1)
        mid = start + n_prompt
        if not lines[start].strip() or not lines[mid].strip():
            continue
        stop = next((i for i in range(mid + 1, min(len(lines), mid + max_answer_lines + 1))
                     if not lines[i].strip()), None)
        if stop is not None and _clean_window(lines, start, stop):
            return (USER_PREFIX + "\n".join(lines[start:mid]),
                    "\n".join(lines[mid:stop]))
    return None


def repeated_ngram_share(ids: list[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total): n-grams of `ids` that already occurred earlier in `ids`, and all."""
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated, max(0, len(ids) - n + 1)
