"""--dry-run reports sizes and the parts plan without loading the model or writing."""

import os

import pytest
import torch
from click.testing import CliRunner
from conftest import make_chats, write_jsonl

from dflash_train.extract.command import extract
from dflash_train.extract.data import open_source
from dflash_train.extract.layers import default_target_layer_ids, resolve_layer_ids


def test_dry_run_prints_sizes_and_plan_and_writes_nothing(qwen3_dir, tmp_path, monkeypatch):
    import transformers

    def no_weights(*_a, **_k):
        raise AssertionError("dry-run loaded the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(7))
    out = str(tmp_path / "hs.zarr")
    result = CliRunner().invoke(extract, [
        "--model", qwen3_dir, "--data", data, "--out", out, "--device", "cpu", "--dtype",
        "bfloat16", "--layers", "0,2", "--top-k", "4", "--rows-per-part", "3", "--dry-run"])
    assert result.exit_code == 0, result.output
    # 2 layers x 64 hidden x 2 bytes + ids 4 + mask 1 + top-4 x (4 + 4) + lse 4
    assert "bytes/token: 297" in result.output
    assert "parts: 3 of 3 rows" in result.output
    assert "part 2: rows 6..6" in result.output
    assert not os.path.exists(out)


def test_default_layers_follow_the_dflash_formula():
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert resolve_layer_ids(None, 64) == [1, 16, 31, 46, 61]
    assert resolve_layer_ids(" 3, 5", 8) == [3, 5]


def test_rows_of_several_files_are_numbered_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", make_chats(3, seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", make_chats(2, seed=2))
    source = open_source([a, b])
    assert source.num_rows == 5
    assert source.where(3).endswith("b.jsonl:line 1 (row 3)")
    assert source.chat(4)[-1]["role"] == "assistant"


def test_default_layers_of_a_tiny_target_are_ascending_and_usable():
    # L = 3: the formula gives 1, 1, 0, 0, 0; the last layer (2) is never among them
    assert resolve_layer_ids(None, 3) == [0, 1]


@pytest.mark.parametrize("cuda, device, expected", [
    (True, "auto", torch.bfloat16), (False, "auto", torch.float32),
    (True, "cuda:1", torch.bfloat16), (True, "cpu", torch.float32),
])
def test_auto_dtype_follows_where_the_target_will_run(monkeypatch, cuda, device, expected):
    from dflash_train.dtypes import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_dtype("auto", device) == expected
    assert resolve_dtype("float16", device) == torch.float16
