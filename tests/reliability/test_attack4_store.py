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
from dflash_train.drafter import load_drafter
from dflash_train.run_layout import checkpoint_dir
from dflash_train.store_schema import create_store, open_store, validate
from dflash_train.store_schema.layout import part_path
from dflash_train.train.config import ValidationConfig
from dflash_train.train.data import StoreLoader
from dflash_train.train.errors import TrainError
from dflash_train.train.loader_config import LoaderConfig
from dflash_train.train.validation import open_validation
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


@pytest.fixture(scope="module")
def drafter(pristine, tmp_path_factory):
    """A drafter trained one step on `pristine`, its target head attached: what validation
    replays at a checkpoint."""
    run = tmp_path_factory.mktemp("drafter") / "run"
    trained = CliRunner().invoke(main, ["train", "--store", pristine, "--out", str(run), *TRAIN])
    assert trained.exit_code == 0, trained.output
    model = load_drafter(checkpoint_dir(run, 1))
    rows = open_store(pristine).target_rows()
    model.attach_target_head(rows["embed_tokens"], rows["lm_head"])
    return model


def _delete_first_context_shard(url: str) -> str:
    """Found before reading (a chunk object missing): the samples it held are named."""
    (Path(url) / part_path(0) / "context" / "c" / "0" / "0" / "0").unlink()
    return "part 0 sample 0: [missing] context chunk"


def _truncate_token_ids(url: str) -> str:
    """Found only while reading (the chunk fails to decode): no sample is named up front."""
    chunk = Path(url) / part_path(0) / "input_ids" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    return ""


def _validation(train: str, val: str, model, skip_corrupt: bool, said: list[str]):
    loader = StoreLoader([train], LoaderConfig(prefetch_batches=0, skip_corrupt=skip_corrupt))
    cfg = ValidationConfig(stores=[val], limit=None, tree_budgets=())
    return open_validation(cfg, loader.stores, loader.parts, model.config, 0, 1, said.append,
                           skip_corrupt=skip_corrupt)


@pytest.mark.parametrize("damage", [_delete_first_context_shard, _truncate_token_ids])
def test_a_damaged_validation_store_is_skipped_when_the_run_skips_damage(pristine, tmp_path,
                                                                         drafter, damage):
    """Other prompts than make_store's, in two parts; part 0 damaged."""
    sound = build_store(str(tmp_path / "sound.zarr"), rows=8, parts=2, first_sample=24).url
    val = str(shutil.copytree(sound, tmp_path / "val.zarr"))
    named = damage(val)
    said: list[str] = []
    validation = _validation(pristine, val, drafter, True, said)
    if named:
        assert f"--val-store {val}: skipping damaged data (--skip-corrupt): {val}: {named}" \
            in said[-1]
    replayed = validation.evaluate(drafter).pooled.blocks
    whole = _validation(pristine, sound, drafter, True, []).evaluate(drafter).pooled.blocks
    assert 0 < replayed < whole  # part 1, and what part 0 holds past the damage, replayed
    with pytest.raises(TrainError, match="pass --skip-corrupt"):  # true: it was not passed
        _validation(pristine, val, drafter, False, []).evaluate(drafter)


def test_train_with_skip_corrupt_skips_a_damaged_validation_store(pristine, tmp_path):
    val = build_store(str(tmp_path / "val.zarr"), rows=8, parts=2, first_sample=24).url
    _delete_first_context_shard(val)
    run = CliRunner().invoke(main, ["train", "--store", pristine, "--val-store", val,
                                    "--skip-corrupt", "--out", str(tmp_path / "run"), *TRAIN])
    assert run.exit_code == 0, run.output
    assert f"--val-store {val}: skipping damaged data (--skip-corrupt)" in run.output
