"""`dflash store info` and `dflash store validate` as a user runs them."""

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.store_schema import create_store, open_store
from dflash_train.store_schema.layout import part_path
from tests.store_schema.conftest import HIDDEN, VOCAB, make_meta, random_sample


def _store(tmp_path, gen, finish_parts=(0,)):
    url = str(tmp_path / "hs.zarr")
    store = create_store(url, make_meta(num_parts=3), shard_tokens=64)
    for p in (0, 1):
        w = store.part_writer(p, p * 10, p * 10 + 10)
        for row in range(p * 10, p * 10 + 4):
            w.append(random_sample(50, row, gen))
        if p in finish_parts:
            w.finish()
    return url


def test_info_reports_counts_sizes_and_unfinished_parts(tmp_path, gen):
    url = _store(tmp_path, gen)
    result = CliRunner().invoke(main, ["store", "info", url, "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    # Part 0 finished (4 samples); unfinished part 1 wrote 3 whole shards (192 tokens), so
    # only its 3 samples lying wholly inside them (150 tokens) are committed.
    assert info["samples"] == 4 + 3 and info["tokens"] == 200 + 150
    assert info["parts_complete"] == 1 and info["parts_incomplete"] == [1]
    assert info["parts_missing"] == [2]
    assert info["bytes_per_token"] > 0 and info["compression_ratio"] > 0
    text = CliRunner().invoke(main, ["store", "info", url]).output
    assert "INCOMPLETE" in text and "1/3 complete" in text and "not started [2]" in text


def test_validate_exits_nonzero_naming_part_and_sample(tmp_path, gen):
    url = _store(tmp_path, gen)
    ok = CliRunner().invoke(main, ["store", "validate", url])
    assert ok.exit_code == 0 and "ok" in ok.output
    incomplete = CliRunner().invoke(main, ["store", "validate", url, "--require-complete"])
    assert incomplete.exit_code == 1 and "incomplete" in incomplete.output
    shard = tmp_path / "hs.zarr" / part_path(0) / "context" / "c" / "1" / "0" / "0"
    shard.unlink()  # tokens [64, 128): samples 1 and 2 of part 0
    bad = CliRunner().invoke(main, ["store", "validate", url])
    assert bad.exit_code == 1
    assert "part 0 sample 1: [missing]" in bad.output and "part 0 sample 2: [missing]" in bad.output


def test_info_on_a_missing_store_is_one_clear_line(tmp_path):
    result = CliRunner().invoke(main, ["store", "info", str(tmp_path / "nope.zarr")])
    assert result.exit_code == 1
    assert "no such store" in result.output and "Traceback" not in result.output


def _bytes_under(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_info_names_a_torn_part_as_damaged_and_sizes_only_readable_parts(tmp_path, gen):
    url = _store(tmp_path, gen, finish_parts=(0, 1))
    (tmp_path / "hs.zarr" / part_path(1) / "zarr.json").write_text('{"zarr_format": 3, "no')
    result = CliRunner().invoke(main, ["store", "info", url, "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["parts_damaged"] == [1] and info["parts_missing"] == [2]
    assert info["tokens"] == 200  # part 0 only: part 1 cannot be counted
    part0 = _bytes_under(tmp_path / "hs.zarr" / part_path(0))
    assert info["bytes_per_token"] == pytest.approx(part0 / 200)
    text = CliRunner().invoke(main, ["store", "info", url]).output
    assert "DAMAGED [1]" in text and f"dflash store validate {url}" in text
    assert "not started [2]" in text


def test_info_shows_sizes_as_n_a_before_any_token_is_written(tmp_path, gen):
    url = str(tmp_path / "hs.zarr")
    store = create_store(url, make_meta(num_parts=2), shard_tokens=64)
    store.part_writer(0, 0, 10).append(random_sample(20, 0, gen))  # buffered, not written
    info = json.loads(CliRunner().invoke(main, ["store", "info", url, "--json"]).output)
    assert info["tokens"] == 0 and info["parts_incomplete"] == [0]
    assert info["bytes_per_token"] is None and info["compression_ratio"] is None
    text = CliRunner().invoke(main, ["store", "info", url]).output
    assert "bytes/token    n/a" in text and "compression    n/a" in text and "0.00x" not in text


def test_validate_require_complete_ends_saying_which_parts_keep_it_incomplete(tmp_path, gen):
    url = _store(tmp_path, gen)  # part 0 complete, part 1 unfinished, part 2 not started
    result = CliRunner().invoke(main, ["store", "validate", url, "--require-complete"])
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert "0 problem" not in result.output
    assert "not complete" in last and "unfinished [1]" in last and "not started [2]" in last


def test_info_calls_a_store_with_a_torn_token_array_or_target_row_damaged(tmp_path, gen):
    url = _store(tmp_path, gen, finish_parts=(0, 1))
    root = tmp_path / "hs.zarr"
    (root / part_path(0) / "loss_mask" / "zarr.json").write_text('{"zarr_format": 3, "no')
    info = json.loads(CliRunner().invoke(main, ["store", "info", url, "--json"]).output)
    assert info["parts_damaged"] == [0] and info["frozen_damaged"] == []

    store = open_store(url, mode="r+")
    store.write_target_rows(torch.randn(VOCAB, HIDDEN, generator=gen),
                            torch.randn(VOCAB, HIDDEN, generator=gen), torch.ones(HIDDEN))
    (root / "target" / "lm_head" / "zarr.json").write_text("{")
    text = CliRunner().invoke(main, ["store", "info", url]).output
    assert "DAMAGED" in text.splitlines()[0]
    assert any(line.startswith("DAMAGED") and "target/lm_head" in line
               for line in text.splitlines())


def test_unfinished_parts_are_the_started_and_the_not_started_ones(tmp_path, gen):
    url = _store(tmp_path, gen)  # part 0 complete, part 1 unfinished, part 2 not started
    assert open_store(url).unfinished_parts() == [1, 2]
    assert open_store(_store(tmp_path / "all", gen, finish_parts=(0, 1))).unfinished_parts() == [2]
