"""Issue 61's store cases: a layout attribute no dflash writes, statistics over a store whose
every part is damaged, a convert into a directory not made yet, and the validation stores of
a run (damaged under --skip-corrupt, or holding one row twice). Each is a clear line naming
what is wrong, or is accepted as every other reader accepts it."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import zarr
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.store_schema import create_store, open_store, validate
from dflash_train.store_schema.layout import part_path
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store
from tests.train.conftest import build_store

TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
         "--max-steps", "1", "--set", "loader.prefetch_batches=0"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    return make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))


def _copy(pristine: str, tmp_path) -> str:
    return str(shutil.copytree(pristine, tmp_path / "hs.zarr"))


@pytest.mark.parametrize("value", [0, -64, True, "64", 2**60, 12])
def test_a_shard_size_no_store_is_made_with_is_one_line_for_every_reader(pristine, tmp_path,
                                                                          value):
    url = _copy(pristine, tmp_path)
    zarr.open_group(url, mode="r+").attrs["dflash_layout"] = {"shard_tokens": value}
    words = "the store's 'dflash_layout' attributes were changed or torn"
    checked = CliRunner().invoke(main, ["store", "validate", url])
    assert checked.exit_code == 1 and isinstance(checked.exception, SystemExit), checked.output
    assert words in checked.output and "shard_tokens" in checked.output
    for command in (["store", "stats", url], ["store", "info", url],
                    ["train", "--store", url, "--out", str(tmp_path / "run"), *TRAIN]):
        said = one_line_error(CliRunner().invoke(main, command))
        assert said.startswith(f"Error: {url}: ") and "shard_tokens" in said, said
        assert repr(value) in said and words in said, said
    assert not (tmp_path / "run").exists()


def _delete_every_context_chunk(url: str) -> None:
    for part in (0, 1):
        for chunk in (Path(url) / part_path(part) / "context" / "c").rglob("*"):
            if chunk.is_file():
                chunk.unlink()


def test_statistics_skipping_every_part_as_damaged_name_the_damage(pristine, tmp_path):
    url = _copy(pristine, tmp_path)
    _delete_every_context_chunk(url)
    said = one_line_error(CliRunner().invoke(main, ["store", "stats", "--skip-corrupt", url]))
    assert "every part holding tokens is damaged and was left out (--skip-corrupt)" in said
    assert "part 0: [missing] context chunk" in said and "part 1: [missing] context" in said
    assert "no committed tokens" not in said


def test_a_convert_into_a_directory_not_made_yet_makes_it(pristine, tmp_path):
    src = _copy(pristine, tmp_path)
    open_store(src, mode="r+").write_files("tokenizer", {"tokenizer.json": b"{}"})  # as extract
    dst = tmp_path / "new" / "deeper" / "copy.zarr"
    done = CliRunner().invoke(main, ["store", "convert", src, str(dst), "--no-progress"])
    assert done.exit_code == 0, done.output
    assert validate(str(dst)) == [] and open_store(str(dst)).complete
    assert sorted(p.name for p in dst.parent.iterdir()) == ["copy.zarr"]  # no lock left


def _store_with_a_row_twice(url: str) -> str:
    """A validation store (other prompts than make_store's) whose last row repeats its first,
    as a source holding one prompt twice gives it."""
    built = build_store(str(Path(url).with_name("once.zarr")), rows=8, parts=1, first_sample=24)
    samples = list(built.parts()[0].iter_samples())
    rows = len(samples) + 1
    meta = replace(built.meta, source=replace(built.meta.source, num_rows=rows), num_parts=1)
    store = create_store(url, meta, shard_tokens=built.shard_tokens)
    store.write_target_rows(**built.target_rows())
    store.write_files("target", built.read_files("target"))
    writer = store.part_writer(0, 0, rows)
    for sample in [*samples, replace(samples[0], source_row=rows - 1)]:
        writer.append(sample)
    writer.finish()
    return url


def test_a_validation_store_holding_a_row_twice_is_accepted_as_train_accepts_it(pristine,
                                                                                tmp_path):
    val = _store_with_a_row_twice(str(tmp_path / "val.zarr"))
    for stores in (["--store", val], ["--store", pristine, "--val-store", val]):
        run = CliRunner().invoke(main, ["train", *stores, "--out", str(tmp_path / "run"),
                                        *TRAIN])
        assert run.exit_code == 0, run.output
        shutil.rmtree(tmp_path / "run")


def test_the_same_validation_store_by_two_paths_is_still_refused(pristine, tmp_path):
    val = _store_with_a_row_twice(str(tmp_path / "val.zarr"))
    (tmp_path / "link.zarr").symlink_to(val)
    said = one_line_error(CliRunner().invoke(main, [
        "train", "--store", pristine, "--val-store", val, "--val-store",
        str(tmp_path / "link.zarr"), "--out", str(tmp_path / "run"), *TRAIN]))
    assert f"--val-store {tmp_path / 'link.zarr'} part 0 sample 0 (source row 0) holds the " \
           f"same token ids as --val-store {val} part 0 sample 0 (source row 0)" in said
    assert not (tmp_path / "run").exists()
