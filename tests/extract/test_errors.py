"""Bad input stops extract with one clear line, a non-zero exit and nothing half-written."""

import json
import os

import pytest
from click.testing import CliRunner
from conftest import make_chats, run_extract_cfg, store_samples, write_jsonl

from dflash.extract.command import extract
from dflash.store_schema import validate


def _run(model, data, out, *extra):
    args = ["--model", model, "--data", data, "--out", out, "--device", "cpu",
            "--layers", "0,1", "--no-progress", *extra]
    return CliRunner().invoke(extract, args)


def _assert_clean_failure(result, out, *needles):
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)  # a message, not a traceback
    for needle in needles:
        assert needle in result.output, result.output
    assert not os.path.exists(out)


def test_malformed_jsonl_line_is_named(qwen3_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    rows = [json.dumps(r) for r in make_chats(4)]
    rows[2] = '{"messages": [oops'
    data.write_text("\n".join(rows) + "\n")
    out = str(tmp_path / "hs.zarr")
    _assert_clean_failure(_run(qwen3_dir, str(data), out), out, "bad.jsonl:line 3",
                          "malformed JSON")


def test_empty_file_is_refused(qwen3_dir, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    out = str(tmp_path / "hs.zarr")
    _assert_clean_failure(_run(qwen3_dir, str(data), out), out, "empty.jsonl", "no rows")


def test_unknown_role_is_named_with_its_line(qwen3_dir, tmp_path):
    rows = make_chats(3)
    rows[1] = {"messages": [{"role": "user", "content": "hi"},
                            {"role": "robot", "content": "beep"}]}
    data = write_jsonl(tmp_path / "roles.jsonl", rows)
    out = str(tmp_path / "hs.zarr")
    _assert_clean_failure(_run(qwen3_dir, data, out), out, "roles.jsonl:line 2", "'robot'")


def test_missing_model_path_is_refused(chats_jsonl, tmp_path):
    out = str(tmp_path / "hs.zarr")
    missing = str(tmp_path / "no-such-model")
    _assert_clean_failure(_run(missing, chats_jsonl, out), out, missing, "no such directory")


def test_layer_id_beyond_the_target_is_refused(qwen3_dir, chats_jsonl, tmp_path):
    out = str(tmp_path / "hs.zarr")
    result = CliRunner().invoke(extract, ["--model", qwen3_dir, "--data", chats_jsonl, "--out",
                                          out, "--device", "cpu", "--layers", "0,4"])
    _assert_clean_failure(result, out, "[4] out of range", "4 layers")


def test_the_last_layer_is_refused_as_ambiguous(qwen3_dir, chats_jsonl, tmp_path):
    out = str(tmp_path / "hs.zarr")
    result = CliRunner().invoke(extract, ["--model", qwen3_dir, "--data", chats_jsonl, "--out",
                                          out, "--device", "cpu", "--layers", "0,3"])
    _assert_clean_failure(result, out, "id 3 is the target's last layer", "0..2")


def test_out_dir_holding_a_different_store_is_refused_and_left_intact(qwen3_dir, chats_jsonl,
                                                                      tmp_path):
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, chats_jsonl, out, layers="0,1")
    before = store_samples(out)
    result = _run(qwen3_dir, chats_jsonl, out, "--layers", "0,2")
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)
    assert "context_layer_ids" in result.output and "[0, 1]" in result.output
    assert validate(out) == []
    after = store_samples(out)
    assert [s.source_row for s in after] == [s.source_row for s in before]


def test_out_dir_holding_something_else_is_refused(qwen3_dir, chats_jsonl, tmp_path):
    out = tmp_path / "hs.zarr"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = _run(qwen3_dir, chats_jsonl, str(out))
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)
    assert "not" in result.output and str(out) in result.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("row", [{"text": "no chat here"}, {"prompt": "hi", "response": 3}])
def test_row_with_neither_chat_nor_pair_is_named(qwen3_dir, tmp_path, row):
    data = write_jsonl(tmp_path / "odd.jsonl", make_chats(2) + [row])
    out = str(tmp_path / "hs.zarr")
    _assert_clean_failure(_run(qwen3_dir, data, out), out, "odd.jsonl:line 3")
