"""`extract --context-dtype float8_e4m3`: the same samples as a default extract, context in fp8
within E4M3's error of the full-precision states; the default stays as it was."""

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from conftest import cli_args, run_extract_cfg, store_samples

from dflash_train.extract.command import extract
from dflash_train.store_schema import open_store, validate


def test_fp8_extract_holds_the_default_extract_samples_within_e4m3_error(qwen3_dir, chats_jsonl,
                                                                          tmp_path):
    plain, fp8 = str(tmp_path / "plain.zarr"), str(tmp_path / "fp8.zarr")
    run_extract_cfg(qwen3_dir, chats_jsonl, plain)
    run_extract_cfg(qwen3_dir, chats_jsonl, fp8, context_dtype="float8_e4m3")
    assert validate(fp8) == []
    meta = open_store(fp8).meta
    assert meta.context_dtype == "float8_e4m3" and meta.schema_version == 2
    assert meta.hidden_dtype == "float32"  # what readers hand out
    assert open_store(plain).meta.context_dtype is None
    a, b = store_samples(plain), store_samples(fp8)
    assert [s.source_row for s in a] == [s.source_row for s in b]
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "loss_mask", "topk_ids", "topk_logits", "lse"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert y.context.dtype == torch.float32
        row_max = x.context.abs().amax(-1, keepdim=True)
        # half an E4M3 step of each value, plus the subnormal step of the row's scale
        bound = 2.0**-4 * x.context.abs() + 2.0**-10 * row_max / 448
        assert ((y.context - x.context).abs() <= bound * 1.0001).all(), x.source_row
        assert not torch.equal(y.context, x.context)  # it was quantized


def test_the_cli_option_is_named_in_help_and_defaults_to_the_hidden_dtype(qwen3_dir,
                                                                         chats_jsonl, tmp_path):
    help_text = CliRunner().invoke(extract, ["--help"]).output
    assert "--context-dtype [same|float8_e4m3]" in help_text and "float32 scale" in help_text
    out = str(tmp_path / "cli.zarr")
    done = CliRunner().invoke(extract, cli_args(qwen3_dir, chats_jsonl, out)
                              + ["--context-dtype", "float8_e4m3"])
    assert done.exit_code == 0, done.output
    assert open_store(out).meta.fp8
    default = str(tmp_path / "default.zarr")
    run_extract_cfg(qwen3_dir, chats_jsonl, default)
    doc = json.loads((Path(default) / "zarr.json").read_text())["attributes"]["dflash"]
    assert doc["schema_version"] == 1 and "context_dtype" not in doc
