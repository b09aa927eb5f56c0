"""Input rows: ShareGPT conversations as a JSON array or JSON lines, cut-off arrays, bad rows.

Every expectation is computed independently of the streaming reader: json.loads of the whole
text, and byte offsets found by searching the bytes written.
"""

import json

import pytest
from click.testing import CliRunner

import dflash_train.extract.data as data
from dflash_train.extract.command import extract
from dflash_train.extract.data import SHAREGPT_ROLES, open_source, to_chat
from dflash_train.extract.errors import ExtractError

# Non-ASCII text (2-, 3- and 4-byte UTF-8), escapes and newlines inside values: byte
# offsets differ from character offsets, and a small read block splits characters.
CONVERSATIONS = [
    [("human", "héllo cat \u2603"), ("gpt", "yes no\nthe dog 🐕")],
    [("system", "be brief"), ("human", 'say "two"'), ("gpt", "two\\three"),
     ("human", "and?"), ("chatgpt", "five")],
    [("user", "how are you"), ("bard", "fine thanks")],
    [("human", "what is red"), ("bing", "red is a colour ünd blue")],
]


def sharegpt_rows(conversations=CONVERSATIONS) -> list[dict]:
    return [{"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}
            for i, turns in enumerate(conversations)]


def write_array(path, rows, *, cut: int | None = None) -> bytes:
    """A pretty-printed JSON array as json.dump writes it (ShareGPT's layout), optionally
    cut after `cut` bytes; returns the bytes written."""
    raw = json.dumps(rows, indent=2, ensure_ascii=False).encode()
    raw = raw if cut is None else raw[:cut]
    path.write_bytes(raw)
    return raw


def expected_chats(rows) -> list[list[dict]]:
    return [[{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
             for t in r["conversations"]] for r in rows]


def read_all(source) -> list:
    return [source.chat(r) for r in range(source.num_rows)]


@pytest.mark.parametrize("block", [None, 7], ids=["default-block", "7-byte-blocks"])
def test_sharegpt_array_rows_read_back_as_chats(tmp_path, monkeypatch, block):
    if block:
        monkeypatch.setattr(data, "_READ_BLOCK", block)
    rows = sharegpt_rows()
    raw = write_array(tmp_path / "sharegpt.json", rows)
    source = open_source([str(tmp_path / "sharegpt.json")])
    assert source.num_rows == len(rows) and source.notes == []
    assert read_all(source) == expected_chats(rows)
    # each row is located where it starts in the file (json.dumps writes '  {' per row)
    starts = [raw.index(b'{\n    "id": "c%d"' % i) for i in range(len(rows))]
    assert list(source.files[0].locators) == starts
    lines = [raw[:s].count(b"\n") + 1 for s in starts]
    assert [source.where(r) for r in range(len(rows))] == [
        f"{tmp_path / 'sharegpt.json'}:line {n} (row {r})" for r, n in enumerate(lines)]


def test_sharegpt_json_lines_and_a_compact_array_read_the_same(tmp_path):
    rows = sharegpt_rows()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.json").write_text(json.dumps(rows, separators=(",", ":")))
    a, b = open_source([str(tmp_path / "a.jsonl")]), open_source([str(tmp_path / "b.json")])
    assert read_all(a) == read_all(b) == expected_chats(rows)


def test_every_peer_role_name_maps_to_a_chat_role():
    names = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
             "system": "system"}
    for name, role in names.items():  # after a user turn: an opening reply is dropped
        turns = [{"from": "human", "value": "q"}, {"from": name, "value": "x"}]
        chat = to_chat({"conversations": turns}, "r")
        assert chat == [{"role": "user", "content": "q"}, {"role": role, "content": "x"}], name


def test_messages_win_over_conversations_in_a_row_holding_both():
    row = {"messages": [{"role": "user", "content": "m"}],
           "conversations": [{"from": "human", "value": "c"}]}
    assert to_chat(row, "r") == [{"role": "user", "content": "m"}]


@pytest.mark.parametrize("turn, needle", [
    ({"from": "robot", "value": "x"}, "unknown speaker 'robot'"),
    ({"from": "human"}, "needs 'from' and 'value'"),
    ({"from": "gpt", "value": 3}, "value must be a string"),
])
def test_a_bad_turn_is_an_error_naming_the_row(tmp_path, turn, needle):
    rows = sharegpt_rows()
    rows[2]["conversations"].append(turn)
    raw = write_array(tmp_path / "bad.json", rows)
    line = raw[: raw.index(b'"id": "c2"')].count(b"\n")  # the row's "{" is one line above
    with pytest.raises(ExtractError) as e:
        open_source([str(tmp_path / "bad.json")])
    assert f"bad.json:line {line} (row 2): conversation turn 2" in str(e.value)
    assert needle in str(e.value)


@pytest.mark.parametrize("layout", ["jsonl", "array"])
def test_empty_conversations_are_left_out_counted_and_named(tmp_path, layout):
    # ShareGPT_V3 holds rows with no turn (its row 71 is the first): nothing to train on
    rows = sharegpt_rows()
    rows = [rows[0], {"id": "e1", "conversations": []}, *rows[1:3],
            {"id": "e2", "conversations": []}, rows[3]]
    path = tmp_path / f"e.{'jsonl' if layout == 'jsonl' else 'json'}"
    if layout == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        empty_lines = [2, 5]
    else:
        raw = write_array(path, rows)
        empty_lines = [raw[: raw.index(f'"id": "{i}"'.encode())].count(b"\n")
                       for i in ("e1", "e2")]
    source = open_source([str(path)])
    kept = [r for r in rows if r["conversations"]]
    assert read_all(source) == expected_chats(kept)
    assert len(source.notes) == 1
    assert "left out 2 ShareGPT rows with no turn to learn from" in source.notes[0]
    assert f"lines {empty_lines[0]}, {empty_lines[1]})" in source.notes[0]


def test_conversations_that_are_not_a_list_are_refused_naming_the_row(tmp_path):
    rows = sharegpt_rows() + [{"id": "e", "conversations": "hello"}]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ExtractError, match=r"e.jsonl:line 5 \(row 4\): 'conversations' must"):
        open_source([str(tmp_path / "e.jsonl")])


@pytest.mark.parametrize("where", ["inside a value", "inside a character", "after a row"])
def test_a_cut_off_array_is_refused_naming_the_byte_and_complete_rows(tmp_path, where):
    rows = sharegpt_rows()
    full = json.dumps(rows, indent=2, ensure_ascii=False).encode()
    third = full.index(b'{\n    "id": "c3"')
    cut = {"inside a value": full.index("ünd".encode()) - 3,
           "inside a character": full.index("ünd".encode()) + 1,  # inside the bytes of "ü"
           "after a row": full.rindex(b"}", 0, third) + 1}[where]  # row 2's closing brace
    write_array(tmp_path / "cut.json", rows, cut=cut)
    with pytest.raises(ExtractError) as e:
        open_source([str(tmp_path / "cut.json")])
    at = third if where != "after a row" else cut  # "after a row": nothing of row 3 left
    message = str(e.value)
    assert f"cut.json: the JSON array is cut off at byte {at} " in message
    assert "after 3 complete rows" in message and "--allow-truncated" in message

    source = open_source([str(tmp_path / "cut.json")], allow_truncated=True)
    assert source.num_rows == 3
    assert read_all(source) == expected_chats(rows[:3])
    assert len(source.notes) == 1 and "using those 3 rows" in source.notes[0]


def test_a_malformed_row_is_named_not_called_a_cut(tmp_path):
    raw = json.dumps(sharegpt_rows(), indent=2).encode()
    raw = raw.replace(b'"id": "c1",', b'"id": "c1" "oops": 1,')
    (tmp_path / "m.json").write_bytes(raw)
    line = raw[: raw.index(b'"id": "c1"')].count(b"\n")
    with pytest.raises(ExtractError, match=rf"m.json:line {line} \(row 1\): malformed JSON"):
        open_source([str(tmp_path / "m.json")], allow_truncated=True)


def test_data_after_the_array_and_a_missing_comma_are_refused(tmp_path):
    rows = sharegpt_rows()
    (tmp_path / "after.json").write_text(json.dumps(rows) + "\n[]")
    with pytest.raises(ExtractError, match="after.json:line 2: data after the JSON array"):
        open_source([str(tmp_path / "after.json")])
    (tmp_path / "comma.json").write_text("[" + json.dumps(rows[0]) + json.dumps(rows[1]) + "]")
    with pytest.raises(ExtractError, match=r"expected ',' or '\]' after row 0"):
        open_source([str(tmp_path / "comma.json")])


def test_a_row_longer_than_the_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_READ_BLOCK", 64)
    monkeypatch.setattr(data, "MAX_ROW_BYTES", 256)
    rows = sharegpt_rows([[("human", "hi"), ("gpt", "x" * 1000)]])
    write_array(tmp_path / "long.json", rows)
    with pytest.raises(ExtractError, match=r"long.json:line 2 \(row 0\): a row longer than"):
        open_source([str(tmp_path / "long.json")])


def test_rows_of_several_files_are_numbered_on(tmp_path):
    write_array(tmp_path / "a.json", sharegpt_rows())
    rows = sharegpt_rows()
    rows[1]["conversations"][0]["from"] = "robot"
    write_array(tmp_path / "b.json", rows)
    with pytest.raises(ExtractError, match=r"b.json:line \d+ \(row 5\)"):
        open_source([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


def test_extract_refuses_a_cut_array_and_keeps_its_rows_when_told(qwen3_dir, tmp_path):
    rows = sharegpt_rows()
    full = json.dumps(rows, indent=2, ensure_ascii=False).encode()
    write_array(tmp_path / "cut.json", rows, cut=full.index("ünd".encode()))
    args = ["--model", qwen3_dir, "--data", str(tmp_path / "cut.json"), "--out",
            str(tmp_path / "hs.zarr"), "--device", "cpu", "--layers", "0,1", "--no-progress"]
    refused = CliRunner().invoke(extract, args)
    assert refused.exit_code == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "cut.json: the JSON array is cut off at byte" in lines[0]
    assert not (tmp_path / "hs.zarr").exists()

    kept = CliRunner().invoke(extract, [*args, "--allow-truncated"])
    assert kept.exit_code == 0, kept.output
    assert "using those 3 rows (--allow-truncated)" in kept.stdout
    assert "extracted 3 samples" in kept.stdout
