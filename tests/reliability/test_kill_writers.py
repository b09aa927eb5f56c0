"""SIGKILL at seeded random moments while dflash writes a unit in pieces: checkpoints (inside
`train`, with pruning). Between kills a reader finds whole units only (never a torn file or a
checkpoint half deleted), and the rerun ends equal to an uninterrupted run's. `slow` soak
variants kill more often."""

import random
from pathlib import Path

import pytest
import torch

from dflash_train.drafter import load_drafter
from dflash_train.train.checkpoint import complete_checkpoints, read_checkpoint
from tests.reliability import kill_children
from tests.reliability.kill_points import kill_points, run_child
from tests.train.conftest import build_store

SEED = 48
TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--epochs", "2",
         "--no-progress", "--set", "run.checkpoint_every=3", "--set", "loader.prefetch_batches=0"]
"""10 steps, a checkpoint every 3 and at the end."""
KEEP = ["--set", "run.keep_checkpoints=2"]
"""The killed runs prune (the reference keeps all, to compare every step)."""
KILLS = [pytest.param(2, id="2-kills"), pytest.param(8, id="8-kills", marks=pytest.mark.slow)]


def _dflash(args: list[str], root: Path, kill_at: int | None = None):
    return run_child(kill_children.dflash, (args,), root, kill_at=kill_at)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_drafter(path).state_dict()


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return build_store(str(tmp_path_factory.mktemp("kill_writers") / "hs.zarr")).url


@pytest.fixture(scope="module")
def reference_run(store, tmp_path_factory) -> tuple[dict[str, dict], list[str], Path]:
    """Every checkpoint of an uninterrupted run by name (their weights), its file operations
    and its last checkpoint."""
    root = tmp_path_factory.mktemp("reference_run")
    done = _dflash(["train", "--store", store, "--out", str(root / "run"), *TRAIN,
                    "--set", "run.keep_checkpoints=0"], root)
    assert done.exitcode == 0, done.error
    found = complete_checkpoints(root / "run")
    assert [p.name for p in found][-1] == "step_00000010" and len(found) == 4
    return {p.name: _weights(p) for p in found}, done.events, found[-1]


@pytest.mark.parametrize("kills", KILLS)
def test_train_killed_anywhere_keeps_whole_checkpoints_and_resumes_to_the_same_ones(
        store, reference_run, tmp_path, kills):
    want, events, _ = reference_run
    run = tmp_path / "run"
    for at in kill_points(events, random.Random(SEED + kills), kills):
        resume = ["--resume"] if complete_checkpoints(run) else []
        trial = _dflash(["train", "--store", store, "--out", str(run), *TRAIN, *KEEP, *resume],
                        tmp_path, kill_at=at)
        assert trial.exitcode in (-9, 0), (at, trial.error)
        for path in complete_checkpoints(run):  # whole, and the uninterrupted run's
            assert _same_weights(read_checkpoint(path).drafter.state_dict(), want[path.name])
        if trial.exitcode == 0:  # the kill fell past what this resume still had to do
            break
    else:
        resume = ["--resume"] if complete_checkpoints(run) else []
        done = _dflash(["train", "--store", store, "--out", str(run), *TRAIN, *KEEP, *resume],
                       tmp_path)
        assert done.exitcode == 0, done.error
    kept = complete_checkpoints(run)
    assert [p.name for p in kept] == sorted(want)[-2:]
    for path in kept:
        assert _same_weights(_weights(path), want[path.name]), path.name
