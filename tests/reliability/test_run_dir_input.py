"""`dflash train --out` given what is not a run directory: a checkpoint directory (or the
drafter inside one, or an exported drafter) is refused as --out, new run or resume, before
anything in it changes."""

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import save_drafter
from dflash_train.run_layout import checkpoint_dir
from tests.drafter.conftest import tiny_drafter
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store

TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
         "--max-steps", "4", "--set", "loader.prefetch_batches=0", "--set",
         "run.checkpoint_every=2", "--set", "run.keep_checkpoints=10"]


def _train(store: str, out: Path, *args: str):
    return CliRunner().invoke(main, ["train", "--store", store, "--out", str(out), *TRAIN,
                                     *args])


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))


@pytest.fixture(scope="module")
def finished(store, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    result = _train(store, run)
    assert result.exit_code == 0, result.output
    return run


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
@pytest.mark.parametrize("where", ["checkpoint", "its drafter"])
def test_out_at_a_checkpoint_is_refused_and_nothing_in_the_run_changes(store, finished,
                                                                      tmp_path, where, resume):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    before = _snapshot(run)
    checkpoint = checkpoint_dir(run, 4)
    out = checkpoint if where == "checkpoint" else checkpoint / "drafter"
    said = one_line_error(_train(store, out, *(["--resume"] if resume else [])))
    inside = "" if where == "checkpoint" else "inside "
    assert f"--out {out} is {inside}the training checkpoint {checkpoint}, not a run" in said
    assert f"pass --out {run} --resume" in said
    assert _snapshot(run) == before


def test_out_at_an_exported_drafter_is_refused(store, tmp_path):
    export = save_drafter(tiny_drafter(0), tmp_path / "drafter")
    before = _snapshot(export)
    said = one_line_error(_train(store, export))
    assert f"--out {export} holds a model (config.json), not a run" in said
    assert _snapshot(export) == before
