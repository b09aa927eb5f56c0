"""Input rows for extract: jsonl or parquet files of chats or prompt/response pairs.

Owns reading, validating and numbering rows (a row is one chat; rows of several files are
numbered in order). Every row is validated when the source is opened, so a bad line stops the
run before anything is written. Never tokenizes and never touches a model.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash_train.extract.errors import ExtractError

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a chat may use; anything else is refused."""

Chat = list[dict[str, Any]]


@dataclass
class _File:
    path: str
    sha256: str
    kind: str
    """"jsonl" or "parquet"."""
    locators: list[int]
    """Per row: byte offset of its line (jsonl) or its row index (parquet)."""
    lines: list[int]
    """Per row: 1-based line number (jsonl) or row index (parquet), for error messages."""


class ChatSource:
    """Validated rows of one or more input files, read back on demand by global row index."""

    def __init__(self, files: list[_File]):
        self.files = files
        self._starts = []
        n = 0
        for f in files:
            self._starts.append(n)
            n += len(f.locators)
        self.num_rows = n
        self._tables: dict[str, Any] = {}

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    @property
    def sha256(self) -> list[str]:
        return [f.sha256 for f in self.files]

    def where(self, row: int) -> str:
        """'file:line N (row R)' for error messages."""
        f, i = self._locate(row)
        unit = "line" if f.kind == "jsonl" else "parquet row"
        return f"{f.path}:{unit} {f.lines[i]} (row {row})"

    def chat(self, row: int) -> Chat:
        """The messages of `row`, normalised to [{role, content, ...}]."""
        f, i = self._locate(row)
        try:
            record = self._record(f, i)
        except OSError as e:  # the file changed or vanished since it was indexed
            raise ExtractError(f"{self.where(row)}: cannot read the input again "
                               f"({e.strerror or e})") from e
        return to_chat(record, self.where(row))

    def _record(self, f: _File, i: int) -> Any:
        if f.kind == "jsonl":
            with open(f.path, "rb") as fh:
                fh.seek(f.locators[i])
                return json.loads(fh.readline())
        if f.path not in self._tables:
            self._tables[f.path] = pq.read_table(f.path)
        return self._tables[f.path].slice(f.locators[i], 1).to_pylist()[0]

    def _locate(self, row: int) -> tuple[_File, int]:
        if not 0 <= row < self.num_rows:
            raise ExtractError(f"row {row} is outside the source's {self.num_rows} rows")
        for f, start in zip(reversed(self.files), reversed(self._starts), strict=True):
            if row >= start:
                return f, row - start
        raise AssertionError("unreachable")


def to_chat(record: Any, where: str) -> Chat:
    """A record as messages: {"messages": [...]} or {"prompt", "response"[, "system"]}."""
    if not isinstance(record, dict):
        raise ExtractError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ExtractError(f"{where}: 'messages' must be a non-empty list")
        chat = []
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ExtractError(f"{where}: message {j} needs 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ExtractError(
                    f"{where}: message {j} has unknown role {m['role']!r}; expected one of {ROLES}"
                )
            if not isinstance(m["content"], str):
                raise ExtractError(f"{where}: message {j} content must be a string")
            chat.append({k: v for k, v in m.items() if v is not None})
        return chat
    if "prompt" in record and "response" in record:
        prompt, response = record["prompt"], record["response"]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ExtractError(f"{where}: 'prompt' and 'response' must be strings")
        chat = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        return chat + [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": response}]
    raise ExtractError(
        f"{where}: a row needs 'messages' (chat) or 'prompt' and 'response'; got keys "
        f"{sorted(record)}"
    )


def open_source(paths: list[str]) -> ChatSource:
    """Index and validate every row of `paths`; ExtractError names the first bad line."""
    if not paths:
        raise ExtractError("no --data given")
    files = [_index_file(p) for p in paths]
    source = ChatSource(files)
    if source.num_rows == 0:
        raise ExtractError(f"{', '.join(paths)}: no rows (empty input)")
    return source


def _index_file(path: str) -> _File:
    p = Path(path)
    if p.is_dir():
        raise ExtractError(f"--data {path}: is a directory; pass .jsonl or .parquet files")
    if not p.is_file():
        raise ExtractError(f"--data {path}: no such file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _index_jsonl(str(p.resolve()))
    if suffix in (".parquet", ".pq"):
        return _index_parquet(str(p.resolve()))
    raise ExtractError(f"--data {path}: unknown format; use .jsonl or .parquet")


def _index_jsonl(path: str) -> _File:
    digest = hashlib.sha256()
    offsets, lines = [], []
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            digest.update(raw)
            if raw.strip():
                where = f"{path}:line {lineno}"
                try:
                    record = json.loads(raw)
                except UnicodeDecodeError as e:
                    raise ExtractError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                                       f"at column {e.start + 1})") from e
                except json.JSONDecodeError as e:
                    raise ExtractError(f"{where}: malformed JSON ({e})") from e
                to_chat(record, where)
                offsets.append(offset)
                lines.append(lineno)
            offset += len(raw)
    return _File(path, digest.hexdigest(), "jsonl", offsets, lines)


def _index_parquet(path: str) -> _File:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise ExtractError(f"{path}: cannot read parquet ({e})") from e
    row = 0
    for batch in table.to_batches():
        for record in batch.to_pylist():
            to_chat(record, f"{path}:parquet row {row}")
            row += 1
    return _File(path, digest.hexdigest(), "parquet", list(range(row)), list(range(row)))
