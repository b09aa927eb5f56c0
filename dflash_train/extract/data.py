"""Input rows for extract: JSON lines, JSON arrays or parquet files of chats or pairs.

Owns reading, validating and numbering rows (a row is one chat; rows of several files are
numbered in order). A row is `{"messages": [{"role", "content"}]}`, ShareGPT's
`{"conversations": [{"from", "value"}]}` or `{"prompt", "response"[, "system"]}`. Every row
is validated when the source is opened, so a bad line stops the run before anything is
written. A JSON array is read as a stream (memory: the largest row plus a read block, and
four integers per row); one cut off mid-row (a download that stopped) is refused unless
`allow_truncated`, which keeps the complete rows before the cut. Each row's bytes are
fingerprinted when indexed and checked when the row is read again, so a file edited while
extract runs is refused instead of mixed into the store under its old hash. Never tokenizes
and never touches a model.
"""

import codecs
import hashlib
import json
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from dflash_train.extract.errors import ExtractError
from dflash_train.hashing import file_sha256

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a chat may use; anything else is refused."""
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant"}
"""ShareGPT speaker names (`from`) as chat roles: the names FastChat-style datasets use."""
MAX_ROW_BYTES = 64 << 20
"""Longest single row of a JSON array; a longer one is refused (it bounds the read buffer)."""
_READ_BLOCK = 1 << 20
_SPACE = re.compile(r"[ \t\n\r]*")

Chat = list[dict[str, Any]]
Kind = Literal["jsonl", "json-array", "parquet"]


@dataclass
class _File:
    path: str
    sha256: str
    kind: Kind
    locators: array
    """Per row: byte offset of its line / array element, or its parquet row index."""
    lines: array
    """Per row: 1-based line number where it starts (parquet: the row index), for messages."""
    sizes: array = field(default_factory=lambda: array("q"))
    """json-array: per row, its length in bytes."""
    row_digests: array = field(default_factory=lambda: array("q"))
    """jsonl / json-array: per row, a 64-bit hash of its bytes, checked when read again."""
    empty_skipped: list[int] = field(default_factory=list)
    """Lines of ShareGPT rows with no turn to learn from (none, or replies only), left out."""
    leading_replies_dropped: int = 0
    """ShareGPT rows whose leading assistant turns were dropped (see _conversations)."""


class ChatSource:
    """Validated rows of one or more input files, read back on demand by global row index."""

    def __init__(self, files: list[_File], notes: list[str] | None = None):
        self.files = files
        self.notes = notes or []
        """What opening the files decided that the user should hear (rows kept past a cut)."""
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
        unit = "parquet row" if f.kind == "parquet" else "line"
        return f"{f.path}:{unit} {f.lines[i]} (row {row})"

    def chat(self, row: int) -> Chat:
        """The messages of `row`, normalised to [{role, content, ...}]."""
        return to_chat(self.record(row), self.where(row))

    def record(self, row: int) -> Any:
        """`row` as the file holds it (validated when the source was opened)."""
        f, i = self._locate(row)
        try:
            return self._record(f, i)
        except OSError as e:  # the file changed or vanished since it was indexed
            raise ExtractError(f"{self.where(row)}: cannot read the input again "
                               f"({e.strerror or e})") from e

    def _record(self, f: _File, i: int) -> Any:
        if f.kind == "parquet":
            if f.path not in self._tables:
                if file_sha256(f.path) != f.sha256:
                    raise ExtractError(_changed(f.path))
                self._tables[f.path] = pq.read_table(f.path)
            return self._tables[f.path].slice(f.locators[i], 1).to_pylist()[0]
        with open(f.path, "rb") as fh:
            fh.seek(f.locators[i])
            raw = fh.readline() if f.kind == "jsonl" else fh.read(f.sizes[i])
        if _row_digest(raw) != f.row_digests[i]:
            raise ExtractError(_changed(f.path, f.lines[i]))
        return json.loads(raw)

    def _locate(self, row: int) -> tuple[_File, int]:
        if not 0 <= row < self.num_rows:
            raise ExtractError(f"row {row} is outside the source's {self.num_rows} rows")
        for f, start in zip(reversed(self.files), reversed(self._starts), strict=True):
            if row >= start:
                return f, row - start
        raise AssertionError("unreachable")


def _row_digest(raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big", signed=True)


def _changed(path: str, line: int | None = None) -> str:
    at = f" (the row at line {line} no longer holds the bytes it held)" if line else ""
    return (f"{path}: the file changed after extract read it{at}; a store holds one version "
            "of its input: finish editing it, then extract into a new --out")


def to_chat(record: Any, where: str) -> Chat:
    """A record as messages: {"messages": [...]}, ShareGPT's {"conversations": [...]} or
    {"prompt", "response"[, "system"]} (the first of these a row holds)."""
    if not isinstance(record, dict):
        raise ExtractError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _messages(record["messages"], where)
    if "conversations" in record:
        return _conversations(record["conversations"], where)
    if "prompt" in record and "response" in record:
        prompt = _text(record["prompt"], where, "'prompt'")
        response = _text(record["response"], where, "'response'")
        system = record.get("system")
        system = None if system is None else _text(system, where, "'system'")
        chat = [{"role": "system", "content": system}] if system else []
        return chat + [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": response}]
    raise ExtractError(
        f"{where}: a row needs 'messages' (chat), 'conversations' (ShareGPT) or 'prompt' and "
        f"'response'; got keys {sorted(record)}"
    )


def _text(value: Any, where: str, what: str) -> str:
    """`value` if it is text a tokenizer can take: a str with no lone surrogate (JSON's
    "\\ud800" escape, or the bytes ED A0 80 that json.loads lets through as one)."""
    if not isinstance(value, str):
        raise ExtractError(f"{where}: {what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ExtractError(f"{where}: {what} is not UTF-8 text (a lone surrogate "
                           f"U+{ord(value[e.start]):04X} at character {e.start})") from e
    return value


def _messages(messages: Any, where: str) -> Chat:
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
        _text(m["content"], where, f"message {j} content")
        chat.append({k: v for k, v in m.items() if v is not None})
    first = next((m["role"] for m in chat if m["role"] != "system"), None)
    if first == "assistant":
        raise ExtractError(f"{where}: the chat opens with an assistant turn, with no user turn "
                           "before it to answer; start it with the user's message")
    return chat


def _conversations(turns: Any, where: str) -> Chat:
    """ShareGPT turns as a chat. Leading assistant turns are dropped: ShareGPT_V3 splits long
    conversations into rows, and 6,358 of its 17,545 rows open with a reply to a turn in
    another row; FastChat-style trainers drop that reply too. A row of replies only is []."""
    if not isinstance(turns, list):
        raise ExtractError(f"{where}: 'conversations' must be a list of turns "
                           "({\"from\": ..., \"value\": ...})")
    chat = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise ExtractError(f"{where}: conversation turn {j} needs 'from' and 'value'")
        role = SHAREGPT_ROLES.get(t["from"]) if isinstance(t["from"], str) else None
        if role is None:
            raise ExtractError(f"{where}: conversation turn {j} is from unknown speaker "
                               f"{t['from']!r}; expected one of {tuple(SHAREGPT_ROLES)}")
        _text(t["value"], where, f"conversation turn {j} value")
        chat.append({"role": role, "content": t["value"]})
    opening = next((j for j, m in enumerate(chat) if m["role"] != "assistant"), len(chat))
    return chat[opening:]


def open_source(paths: list[str], *, allow_truncated: bool = False) -> ChatSource:
    """Index and validate every row of `paths`; ExtractError names the first bad line.

    `allow_truncated`: keep the complete rows of a JSON array cut off mid-row (and say so in
    the source's notes) instead of refusing the file."""
    if not paths:
        raise ExtractError("no --data given")
    files, notes, start = [], [], 0
    for p in paths:
        f, note = _index_file(p, start, allow_truncated)
        twin = next((g for g in files if g.sha256 == f.sha256), None)
        if twin is not None:
            same = "is" if twin.path == f.path else f"holds the same bytes as {twin.path}"
            raise ExtractError(f"--data {p} {same}, given before: every row would be "
                               "extracted twice (pass each file once)")
        files.append(f)
        notes += [note] if note else []
        if f.leading_replies_dropped:
            notes.append(f"{p}: dropped the opening assistant turns of "
                         f"{f.leading_replies_dropped} ShareGPT rows (replies to a turn that "
                         "is not in the row)")
        if f.empty_skipped:
            shown = ", ".join(map(str, f.empty_skipped[:5]))
            more = ", ..." if len(f.empty_skipped) > 5 else ""
            notes.append(f"{p}: left out {len(f.empty_skipped)} ShareGPT rows with no turn to "
                         f"learn from (an empty 'conversations' list, or replies only; lines "
                         f"{shown}{more})")
        start += len(f.locators)
    source = ChatSource(files, notes)
    if source.num_rows == 0:
        raise ExtractError(f"{', '.join(paths)}: no rows (empty input)")
    return source


def _index_file(path: str, start: int, allow_truncated: bool) -> tuple[_File, str | None]:
    p = Path(path)
    if p.is_dir():
        raise ExtractError(f"--data {path}: is a directory; pass .jsonl, .json or .parquet files")
    if not p.is_file():
        raise ExtractError(f"--data {path}: no such file")
    suffix = p.suffix.lower()
    resolved = str(p.resolve())
    if suffix in (".jsonl", ".json", ".ndjson"):
        if _first_byte(resolved) == b"[":
            return _index_json_array(resolved, start, allow_truncated)
        return _index_jsonl(resolved, start), None
    if suffix in (".parquet", ".pq"):
        return _index_parquet(resolved, start), None
    raise ExtractError(f"--data {path}: unknown format; use .jsonl, .json or .parquet")


def _first_byte(path: str) -> bytes:
    """The first byte that is not whitespace (b"" for a blank file)."""
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 16), b""):
            text = block.lstrip(b" \t\r\n")
            if text:
                return text[:1]
    return b""


def _index_jsonl(path: str, start: int) -> _File:
    digest = hashlib.sha256()
    f = _File(path, "", "jsonl", array("q"), array("q"))
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            digest.update(raw)
            if raw.strip():
                where = f"{path}:line {lineno} (row {start + len(f.locators)})"
                try:
                    record = json.loads(raw)
                except UnicodeDecodeError as e:
                    raise ExtractError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                                       f"at column {e.start + 1})") from e
                except json.JSONDecodeError as e:
                    raise ExtractError(f"{where}: malformed JSON ({e})") from e
                except RecursionError as e:
                    raise ExtractError(_too_deep(where)) from e
                _add_row(f, record, raw, offset, lineno, where)
            offset += len(raw)
    f.sha256 = digest.hexdigest()
    return f


def _add_row(f: _File, record: Any, raw: bytes, offset: int, line: int, where: str) -> None:
    """Validate a row and index it. ShareGPT rows with no turn to learn from (ShareGPT_V3
    holds 126 empty ones, and rows of replies only) are skipped and counted, not refused:
    filtering a 125 MB array by hand is no fix. Any other malformed row is an error."""
    chat = to_chat(record, where)
    sharegpt = "messages" not in record and "conversations" in record
    if sharegpt and len(chat) < len(record["conversations"]) and chat:
        f.leading_replies_dropped += 1
    if not chat:
        f.empty_skipped.append(line)
        return
    f.locators.append(offset)
    f.lines.append(line)
    f.row_digests.append(_row_digest(raw))
    if f.kind == "json-array":
        f.sizes.append(len(raw))


def _too_deep(where: str) -> str:
    return f"{where}: JSON nested deeper than the parser's recursion limit; flatten the row"


class _Text:
    """A UTF-8 file read block by block as text, tracking the byte offset and line of `pos`.

    `buf[pos:]` is the text not consumed yet; consumed text is dropped at each refill, so the
    buffer holds about one block plus the row being parsed."""

    def __init__(self, path: str, digest):
        self.path = path
        self._fh = open(path, "rb")  # noqa: SIM115 -- closed by close()
        self._digest = digest
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._read = 0
        self.buf, self.pos, self.byte, self.line = "", 0, 0, 1
        self.eof = False

    def close(self) -> None:
        self._fh.close()

    def refill(self, at_least: int = 0) -> None:
        """Drop consumed text and append a block, or `at_least` more bytes if that is more
        (fewer at the end of the file)."""
        self.buf, self.pos = self.buf[self.pos :], 0
        raw = self._fh.read(max(at_least, _READ_BLOCK))
        self._digest.update(raw)
        pending = len(self._utf8.getstate()[0])
        try:
            self.buf += self._utf8.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            if raw or e.reason != "unexpected end of data":
                at = self._read - pending + e.start
                raise ExtractError(f"{self.path}: not UTF-8 text at byte {at}") from e
            # a file cut inside a character: that row is cut off anyway
        self._read += len(raw)
        self.eof = not raw

    def advance(self, to: int) -> None:
        """Consume buf[pos:to]."""
        piece = self.buf[self.pos : to]
        self.byte += len(piece.encode("utf-8"))
        self.line += piece.count("\n")
        self.pos = to

    def peek(self) -> str:
        """Skip whitespace; the next character, or "" at the end of the file."""
        while True:
            self.advance(_SPACE.match(self.buf, self.pos).end())
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.eof:
                return ""
            self.refill()


def _index_json_array(path: str, start: int, allow_truncated: bool) -> tuple[_File, str | None]:
    """Index a JSON array of rows as a stream; (file, note about a cut kept, or None)."""
    digest = hashlib.sha256()
    f = _File(path, "", "json-array", array("q"), array("q"))
    text = _Text(path, digest)
    try:
        cut = _scan_array(text, start, f)
    finally:
        text.close()
    f.sha256 = digest.hexdigest()
    if cut is None:
        return f, None
    byte, line = cut
    rows = len(f.locators)
    what = (f"{path}: the JSON array is cut off at byte {byte} (line {line}) after "
            f"{rows} complete rows")
    if not allow_truncated:
        raise ExtractError(f"{what}; the file is incomplete (download it again), or pass "
                           f"--allow-truncated to use those {rows} rows")
    return f, f"{what}; using those {rows} rows (--allow-truncated)"


def _scan_array(text: _Text, start: int, f: _File) -> tuple[int, int] | None:
    """Validate and locate every row of the array; (byte, line) of a cut, None if whole."""
    decoder = json.JSONDecoder()
    path = text.path
    text.peek()
    text.advance(text.pos + 1)  # the "[" that made this a JSON array
    expect_row = True
    while True:
        c = text.peek()
        if c == "":
            return text.byte, text.line
        if c == "]" and (not expect_row or not f.locators):
            text.advance(text.pos + 1)
            if text.peek():
                raise ExtractError(f"{path}:line {text.line}: data after the JSON array "
                                   f"(byte {text.byte})")
            return None
        if not expect_row:
            if c != ",":
                raise ExtractError(f"{path}:line {text.line}: malformed JSON (expected ',' or "
                                   f"']' after row {start + len(f.locators) - 1}, got {c!r})")
            text.advance(text.pos + 1)
            expect_row = True
            continue
        where = f"{path}:line {text.line} (row {start + len(f.locators)})"
        line, offset = text.line, text.byte
        decoded = _decode_row(text, decoder, where)
        if decoded is None:
            return text.byte, text.line
        record, end = decoded
        raw = text.buf[text.pos:end].encode("utf-8")
        text.advance(end)
        expect_row = False
        _add_row(f, record, raw, offset, line, where)


def _decode_row(text: _Text, decoder: json.JSONDecoder, where: str) -> tuple[Any, int] | None:
    """(row, end) of the JSON value at text.pos, reading more text while it may be
    incomplete; None when the file ends inside it."""
    while True:
        try:
            return decoder.raw_decode(text.buf, text.pos)
        except RecursionError as e:
            raise ExtractError(_too_deep(where)) from e
        except json.JSONDecodeError as e:
            # an error well before the end of what is buffered is real, except an
            # unterminated string, whose rest may simply not be read yet
            margin = 1 if text.eof else 16
            if not (e.msg.startswith("Unterminated string") or e.pos >= len(text.buf) - margin):
                at = text.byte + len(text.buf[text.pos : e.pos].encode("utf-8"))
                raise ExtractError(f"{where}: malformed JSON ({e.msg} at byte {at})") from e
            if text.eof:
                return None
            if len(text.buf) - text.pos > MAX_ROW_BYTES:
                raise ExtractError(f"{where}: a row longer than {MAX_ROW_BYTES >> 20} MiB (or "
                                   "malformed JSON)") from e
            text.refill(at_least=len(text.buf) - text.pos)  # doubles: parsing stays linear


def _index_parquet(path: str, start: int) -> _File:
    sha256 = file_sha256(path)
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise ExtractError(f"{path}: cannot read parquet ({e})") from e
    row = 0
    for batch in table.to_batches():
        for record in batch.to_pylist():
            to_chat(record, f"{path}:parquet row {row} (row {start + row})")
            row += 1
    rows = array("q", range(row))
    return _File(path, sha256, "parquet", rows, rows)
