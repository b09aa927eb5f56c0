"""A `dflash train` SIGKILLed while it writes a checkpoint loses nothing: the previous
checkpoint stays complete and loadable, the torn save is never taken for the latest, and a
resume ends with weights bit-identical to an uninterrupted run's."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import load_drafter
from dflash_train.train.checkpoint import (
    COMPLETE,
    KILL_IN_SAVE_ENV,
    TRAINER_STATE,
    checkpoint_dir,
    latest_checkpoint,
)
from tests.reliability.corrupt_store import make_store

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--epochs", "2",
        "--no-progress", "--set", "run.checkpoint_every=3", "--set", "loader.prefetch_batches=0"]
KILL_STEP = 6  # the second checkpoint; the first (step 3) must survive


def _weights(run) -> dict[str, torch.Tensor]:
    return load_drafter(latest_checkpoint(run)).state_dict()


def test_kill_during_checkpoint_save_keeps_the_previous_and_resumes_exactly(tmp_path):
    store = make_store(str(tmp_path / "hs.zarr"))
    whole = CliRunner().invoke(main, ["train", "--store", store, "--out",
                                      str(tmp_path / "whole"), *ARGS])
    assert whole.exit_code == 0, whole.output
    assert latest_checkpoint(tmp_path / "whole").name > f"step_{KILL_STEP:08d}"  # goes beyond

    run = tmp_path / "killed"
    env = {**os.environ, KILL_IN_SAVE_ENV: str(KILL_STEP), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dflash_train", "train", "--store", store,
                           "--out", str(run), *ARGS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr

    # The torn save holds the new weights and trainer state but no marker, under a temporary
    # name; the previous checkpoint is the latest and loads whole.
    torn = list((run / "checkpoints").glob(f".tmp-step_{KILL_STEP:08d}-*"))
    assert len(torn) == 1 and (torn[0] / TRAINER_STATE).is_file()
    assert not (torn[0] / COMPLETE).exists()
    assert not checkpoint_dir(run, KILL_STEP).exists()
    previous = checkpoint_dir(run, 3)
    assert latest_checkpoint(run) == previous
    assert (previous / COMPLETE).is_file()
    assert load_drafter(previous).state_dict().keys() == _weights(tmp_path / "whole").keys()
    blob = torch.load(previous / TRAINER_STATE, map_location="cpu", weights_only=False)
    assert blob["state"]["step"] == 3

    resumed = CliRunner().invoke(main, ["train", "--store", store, "--out", str(run),
                                        "--resume", *ARGS])
    assert resumed.exit_code == 0, resumed.output
    assert f"resumed from {previous}" in resumed.output
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the torn save was cleared away
    assert latest_checkpoint(run).name == latest_checkpoint(tmp_path / "whole").name
    a, b = _weights(tmp_path / "whole"), _weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
