"""A training checkpoint copied only in part (no COMPLETE marker, a file missing or short) is
refused by `dflash eval`, `dflash export` and `model.init_from`, naming the directory and
what is missing, instead of being used as if whole; its drafter/ alone is still checked
against the store it was trained on. Drafter directories of others (z-lab / HF: no marker,
no checksums.json) still load."""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.run_layout import CHECKSUMS_NAME, DRAFTER_SUBDIR, WEIGHTS_NAME
from dflash_train.train.checkpoint import (
    COMPLETE,
    PROVENANCE,
    TRAINER_STATE,
    latest_checkpoint,
)
from tests.train.conftest import build_store


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[str, str]:
    """The store a run trains on, and one of another target with the same shapes."""
    root = tmp_path_factory.mktemp("copies")
    return (str(build_store(str(root / "own.zarr")).url),
            str(build_store(str(root / "other.zarr"), name="other-target", seed=1).url))


@pytest.fixture(scope="module")
def checkpoint(stores, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run") / "run"
    result = CliRunner().invoke(main, [
        "train", "--store", stores[0], "--out", str(run), "--layers", "1", "--batch-tokens",
        "256", "--anchors-per-seq", "8", "--max-steps", "1", "--no-progress",
        "--set", "loader.prefetch_batches=0"])
    assert result.exit_code == 0, result.output
    return latest_checkpoint(run)


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _only_drafter(ckpt: Path) -> None:
    for p in ckpt.iterdir():
        if p.name != DRAFTER_SUBDIR:
            p.unlink()


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    # name: (how the copy falls short, what the refusal must name)
    "no marker": (lambda c: (c / COMPLETE).unlink(), COMPLETE),
    "provenance missing": (lambda c: (c / PROVENANCE).unlink(), PROVENANCE),
    "trainer state short": (lambda c: _cut(c / TRAINER_STATE), TRAINER_STATE),
    "drafter record missing": (lambda c: (c / DRAFTER_SUBDIR / CHECKSUMS_NAME).unlink(),
                               f"{DRAFTER_SUBDIR}/{CHECKSUMS_NAME}"),
    "only drafter/ copied": (_only_drafter, COMPLETE),
}


def _copy(checkpoint: Path, tmp_path: Path, damage) -> Path:
    ckpt = Path(shutil.copytree(checkpoint, tmp_path / "copy" / checkpoint.name))
    damage(ckpt)
    return ckpt


def _eval(store: str, path) -> object:
    return CliRunner().invoke(main, ["eval", "--store", store, "--limit", "2", str(path)])


@pytest.mark.parametrize("case", list(CASES))
def test_a_half_copied_checkpoint_is_refused_by_eval_and_export_naming_what_is_missing(
        stores, checkpoint, tmp_path, case):
    damage, missing = CASES[case]
    ckpt = _copy(checkpoint, tmp_path, damage)
    for result in (_eval(stores[0], ckpt),
                   CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "out")])):
        assert result.exit_code == 1, result.output
        (line,) = [x for x in result.output.splitlines() if x.startswith("Error:")]
        assert str(ckpt) in line and missing in line, line
    assert not (tmp_path / "out").exists()


def test_a_half_copied_checkpoint_is_refused_as_init_weights(stores, checkpoint, tmp_path):
    ckpt = _copy(checkpoint, tmp_path, CASES["no marker"][0])
    result = CliRunner().invoke(main, [
        "train", "--store", stores[0], "--out", str(tmp_path / "run"), "--max-steps", "1",
        "--no-progress", "--set", f"model.init_from={ckpt}"])
    assert result.exit_code == 1, result.output
    assert str(ckpt) in result.output and COMPLETE in result.output


def test_another_targets_checkpoint_is_refused_whole_or_without_provenance_or_by_its_drafter(
        stores, checkpoint, tmp_path):
    own, other = stores
    whole = _eval(other, checkpoint)
    assert whole.exit_code == 1 and "'tiny' != 'other-target'" in whole.output, whole.output
    # Its drafter/ given directly is still checked against the provenance beside it.
    by_drafter = _eval(other, checkpoint / DRAFTER_SUBDIR)
    assert by_drafter.exit_code == 1, by_drafter.output
    assert "'tiny' != 'other-target'" in by_drafter.output
    # Without its provenance nothing could tell it from a drafter of this target.
    bare = _copy(checkpoint, tmp_path, lambda c: (c / PROVENANCE).unlink())
    result = _eval(other, bare)
    assert result.exit_code == 1 and PROVENANCE in result.output, result.output


def test_drafter_directories_without_a_marker_or_record_still_load(stores, checkpoint,
                                                                   tmp_path):
    # A z-lab / HF download: config.json + model.safetensors and nothing of ours.
    zlab = tmp_path / "zlab"
    shutil.copytree(checkpoint / DRAFTER_SUBDIR, zlab)
    (zlab / CHECKSUMS_NAME).unlink()
    assert _eval(stores[0], zlab).exit_code == 0
    out = CliRunner().invoke(main, ["export", str(zlab), str(tmp_path / "served")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "served" / WEIGHTS_NAME).is_file()
