"""Bad input stops extract with one clear line, a non-zero exit and nothing half-written."""

import json
import os

import pytest
from click.testing import CliRunner
from conftest import VOCAB_SIZE, make_chats, run_extract_cfg, store_samples, write_jsonl

from dflash_train.extract.command import extract
from dflash_train.store_schema import validate


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


@pytest.mark.parametrize("layers, needle", [
    ("2,1", "list the ids in ascending order (1,2)"),  # serving reads them ascending
    ("0,,1", "expected comma-separated integers"),
    ("", "expected comma-separated integers"),
])
def test_unsorted_or_empty_layer_lists_are_refused(qwen3_dir, chats_jsonl, tmp_path, layers,
                                                   needle):
    out = str(tmp_path / "hs.zarr")
    result = CliRunner().invoke(extract, ["--model", qwen3_dir, "--data", chats_jsonl, "--out",
                                          out, "--device", "cpu", "--layers", layers])
    _assert_clean_failure(result, out, needle)


def test_top_k_beyond_the_vocabulary_is_refused_before_any_write(qwen3_dir, chats_jsonl,
                                                                 tmp_path):
    out = str(tmp_path / "hs.zarr")
    result = _run(qwen3_dir, chats_jsonl, out, "--top-k", str(VOCAB_SIZE + 1))
    _assert_clean_failure(result, out, f"--top-k {VOCAB_SIZE + 1} exceeds the target "
                                       f"vocabulary ({VOCAB_SIZE} tokens)")


def test_a_directory_as_data_is_named(qwen3_dir, tmp_path):
    out = str(tmp_path / "hs.zarr")
    _assert_clean_failure(_run(qwen3_dir, str(tmp_path), out), out, "is a directory")


def test_a_device_torch_cannot_use_is_refused(qwen3_dir, chats_jsonl, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = str(tmp_path / "hs.zarr")
    result = CliRunner().invoke(extract, ["--model", qwen3_dir, "--data", chats_jsonl, "--out",
                                          out, "--device", "cuda", "--layers", "0,1"])
    _assert_clean_failure(result, out, "sees no CUDA device", "--device cpu")


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
