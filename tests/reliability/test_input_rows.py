"""Input rows a careless user feeds extract: a file edited mid-run, text that is not text,
a system prompt that is not a string, JSON nested past the parser, the same file twice, a
chat that opens with the assistant. Each is refused with one line naming the file and row,
or (ShareGPT's opening replies) handled the way the format's own trainers handle it."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dflash_train.extract.pipeline as pipeline
from dflash_train.assets.tiny import save_qwen3
from dflash_train.extract.command import extract
from dflash_train.extract.data import open_source
from dflash_train.extract.errors import ExtractError
from tests.reliability.extract_support import is_complete

PAIRS = [{"prompt": f"question {i}", "response": f"answer {i} is {i * 7}"} for i in range(4)]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_qwen3(tmp_path_factory.mktemp("qwen3")))


@pytest.mark.parametrize("layout", ["jsonl", "json-array"])
def test_a_row_edited_in_place_after_indexing_is_refused(tmp_path, layout):
    path = tmp_path / ("rows.jsonl" if layout == "jsonl" else "rows.json")
    if layout == "jsonl":
        write_jsonl(path, PAIRS)
    else:
        path.write_text(json.dumps(PAIRS, indent=1))
    source = open_source([str(path)])
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"answer 2 is 14", b"answer 2 is 41"))  # same length
    assert source.chat(1)[1]["content"] == "answer 1 is 7"  # untouched rows still read
    with pytest.raises(ExtractError, match=r"rows\.json.*changed after extract read it.*"
                                           r"line \d+ no longer holds"):
        source.chat(2)
    # another length shifts every later row: their bytes differ too, no JSONDecodeError
    path.write_bytes(raw.replace(b"question 1", b"question one"))
    with pytest.raises(ExtractError, match="changed after extract read it"):
        source.chat(3)


def test_a_parquet_file_rewritten_after_indexing_is_refused(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(PAIRS), path)
    source = open_source([str(path)])
    pq.write_table(pa.Table.from_pylist(PAIRS[::-1]), path)
    with pytest.raises(ExtractError, match=r"rows\.parquet: the file changed"):
        source.chat(0)


def test_extract_refuses_an_input_edited_while_it_runs(model, tmp_path, monkeypatch):
    data, out = tmp_path / "rows.jsonl", tmp_path / "hs.zarr"
    write_jsonl(data, PAIRS)
    opened = pipeline.open_source

    def open_then_edit(*args, **kwargs):
        source = opened(*args, **kwargs)
        data.write_bytes(data.read_bytes().replace(b"question 0", b"QUESTION 0"))
        return source

    monkeypatch.setattr(pipeline, "open_source", open_then_edit)
    result = CliRunner().invoke(extract, ["--model", model, "--data", str(data), "--out",
                                          str(out), "--device", "cpu", "--layers", "0,1",
                                          "--no-progress"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "rows.jsonl: the file changed after extract read it" in lines[0]
    assert not is_complete(str(out))


@pytest.mark.parametrize("raw, where", [
    (b'{"prompt": "a \\ud800 b", "response": "ok"}', "'prompt' is not UTF-8 text"),
    (b'{"messages": [{"role": "user", "content": "hi"}, '
     b'{"role": "assistant", "content": "x \xed\xa0\x80"}]}', "message 1 content is not UTF-8"),
    (b'{"conversations": [{"from": "human", "value": "\\udfff"}, {"from": "gpt", '
     b'"value": "y"}]}', "conversation turn 0 value is not UTF-8"),
], ids=["escaped-surrogate", "surrogate-bytes", "sharegpt-surrogate"])
def test_text_that_is_not_utf8_is_named_not_a_tokenizer_traceback(tmp_path, raw, where):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(PAIRS[0]).encode() + b"\n" + raw + b"\n")
    with pytest.raises(ExtractError, match=rf"bad\.jsonl:line 2 \(row 1\): {where}"):
        open_source([str(path)])


@pytest.mark.parametrize("system", [{"a": 1}, ["be", "brief"], 3])
def test_a_system_prompt_that_is_not_a_string_is_refused(tmp_path, system):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [dict(PAIRS[0], system=system)])
    with pytest.raises(ExtractError, match=r"line 1 \(row 0\): 'system' must be a string"):
        open_source([str(path)])
    write_jsonl(path, [dict(PAIRS[0], system="be brief")])
    assert open_source([str(path)]).chat(0)[0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("layout", ["jsonl", "json-array"])
def test_json_nested_past_the_parser_is_refused_naming_the_row(tmp_path, layout):
    deep = "[" * 100_000 + "]" * 100_000
    row = '{"prompt": "p", "response": "r", "extra": ' + deep + "}"
    path = tmp_path / ("deep.jsonl" if layout == "jsonl" else "deep.json")
    path.write_text(row + "\n" if layout == "jsonl" else "[" + row + "]")
    with pytest.raises(ExtractError, match=r"deep\.json.*\(row 0\): JSON nested deeper"):
        open_source([str(path)])


def test_the_same_data_twice_is_refused_by_path_and_by_content(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, PAIRS)
    with pytest.raises(ExtractError, match=r"rows\.jsonl is, given before"):
        open_source([str(path), str(path)])
    shutil.copy(path, tmp_path / "copy.jsonl")
    with pytest.raises(ExtractError, match=r"copy\.jsonl holds the same bytes as .*rows\.jsonl"):
        open_source([str(path), str(tmp_path / "copy.jsonl")])


@pytest.mark.parametrize("messages", [
    [{"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "q"}],
], ids=["only-assistant", "system-then-assistant"])
def test_a_chat_opening_with_the_assistant_is_refused_in_plain_words(tmp_path, messages):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"messages": messages}])
    with pytest.raises(ExtractError, match=r"line 1 \(row 0\): the chat opens with an "
                                           r"assistant turn"):
        open_source([str(path)])


def test_sharegpt_opening_replies_are_dropped_and_counted(tmp_path):
    # ShareGPT_V3 splits conversations into rows; a row may open with the reply to a turn
    # of another row. Replies-only rows have nothing to learn from and are left out.
    rows = [{"conversations": [{"from": "gpt", "value": "tail"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": "a"}]},
            {"conversations": [{"from": "gpt", "value": "only a reply"}]},
            {"conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}]
    path = tmp_path / "sharegpt.jsonl"
    write_jsonl(path, rows)
    source = open_source([str(path)])
    assert [source.chat(r) for r in range(source.num_rows)] == [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]]
    assert any("dropped the opening assistant turns of 1 ShareGPT rows" in n
               for n in source.notes)
    assert any("left out 1 ShareGPT rows with no turn to learn from" in n and "lines 2)" in n
               for n in source.notes)


@pytest.mark.parametrize("regenerate", [False, True])
@pytest.mark.parametrize("huge", ["response", "prompt"])
def test_one_huge_row_costs_what_max_length_allows(tmp_path, monkeypatch, regenerate, huge):
    # A 0.7 MB turn with --max-length 64 used to be rendered and tokenized whole (a 60 MB line
    # took 13.5 GB). Now no text the tokenizer sees is much longer than 64 tokens can be, and
    # the sample is the one the whole row gives.
    from dflash_train.assets.tiny import build_tokenizer
    from dflash_train.extract import prepare
    from dflash_train.extract.config import ExtractConfig
    from dflash_train.extract.prepare import Counts, apply_length_policy, render_rows

    long_text = " ".join(["alpha beta", "gamma"] * 40_000)  # ~0.7 MB
    row = {"prompt": long_text if huge == "prompt" else "short question",
           "response": long_text if huge == "response" else "short answer"}
    path = tmp_path / "huge.jsonl"
    write_jsonl(path, [PAIRS[0], row])
    source = open_source([str(path)])
    tokenizer = build_tokenizer()
    cfg = ExtractConfig(model="m", data=[str(path)], out="o", max_length=64,
                        regenerate=regenerate)
    seen = []
    encode = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__",
                        lambda self, text, **kw: seen.append(len(text)) or encode(self, text, **kw))
    bounded = [apply_length_policy(i, cfg, Counts()) for i in render_rows(source, tokenizer,
                                                                           range(2), cfg)]
    assert max(seen) < 80 * max(map(len, tokenizer.get_vocab())) + 1000
    monkeypatch.setattr(prepare, "chat_within", lambda chat, _: (chat, False))
    whole = [apply_length_policy(i, cfg, Counts()) for i in render_rows(source, tokenizer,
                                                                         range(2), cfg)]
    if not (regenerate and huge == "response"):  # (a regenerated response is never read)
        assert max(seen) > len(long_text)  # the reference did render the whole row
    assert bounded == whole
    assert (bounded[1] is None) == (huge == "prompt")  # no assistant token within 64
