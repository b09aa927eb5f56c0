"""`dflash train` settings that cannot act, and a resume onto a store that moved.

A DFlash 2 convolution wider than the block, or a setting that acts only under another (a
Muon knob under AdamW, D-PACE's alpha under decay weights, noise settings with no noise), is
refused when the config loads, naming both, before a run directory exists. A resume takes a
store copied or moved with identical content as the same store, and refuses another."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zarr
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import DrafterError
from dflash_train.train.checkpoint import KILL_IN_SAVE_ENV, latest_checkpoint
from dflash_train.train.config import load_train_config
from dflash_train.train.errors import TrainError
from tests.evaluate.conftest import drafter_config
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
         "--set", "loader.prefetch_batches=0", "--set", "run.checkpoint_every=2"]


def _train(store: str, out, *args: str):
    return CliRunner().invoke(main, ["train", "--store", store, "--out", str(out), *TRAIN,
                                     *args])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))


@pytest.mark.parametrize("taps", [17, 18, 64])
def test_a_dflash2_convolution_wider_than_the_block_is_refused_before_the_run_dir(store,
                                                                                 tmp_path,
                                                                                 taps):
    out = tmp_path / "run"
    said = one_line_error(_train(store, out, "--set", "model.kind=dflash2", "--set",
                                  f"model.conv_kernel_size={taps}", "--max-steps", "1"))
    assert "model.conv_kernel_size must be at most 16 (the block size" in said
    assert f"got {taps}" in said and not out.exists()


def test_the_widest_convolution_the_block_holds_is_accepted():
    cfg = load_train_config(None, {"model.kind": "dflash2", "model.conv_kernel_size": 16})
    assert cfg.model.conv_kernel_size == 16
    assert drafter_config(kind="dflash2", conv_kernel_size=8).conv_kernel_size == 8  # block 8
    with pytest.raises(DrafterError, match="conv_kernel_size 9 exceeds 8, the block size"):
        drafter_config(kind="dflash2", conv_kernel_size=9)


INERT = [
    ({"optim.muon_momentum": "0.9"}, "optim.muon_momentum must be 0.95 unless "
                                     "optim.optimizer is muon", {"optim.optimizer": "muon"}),
    ({"optim.muon_lr": "0.01"}, "optim.muon_lr must be left unset unless optim.optimizer is "
                                "muon", {"optim.optimizer": "muon"}),
    ({"optim.muon_nesterov": "false"}, "optim.muon_nesterov must be True unless",
     {"optim.optimizer": "muon"}),
    ({"loss.dpace_alpha": "0.3"}, "loss.dpace_alpha must be 0.5 unless "
                                  "loss.position_weights is dpace",
     {"loss.position_weights": "dpace"}),
    ({"loss.selector_weight": "2"}, "loss.selector_weight must be 1.0 unless model.kind is "
                                    "dflash2", {"model.kind": "dflash2"}),
    ({"noise.kind": "none", "noise.std": "0.1"}, "--noise-std (noise.std) must be 0.05 "
     "unless noise.kind is uniform or gaussian", {"noise.kind": "gaussian"}),
    ({"noise.schedule_steps": "5"}, "noise.schedule_steps must be 0 unless noise.std_end is "
                                    "set", {"noise.std_end": "0.01"}),
]


@pytest.mark.parametrize("sets, why, enabling", INERT, ids=[next(iter(s)) for s, _, _ in INERT])
def test_a_setting_that_cannot_act_under_the_others_is_refused_naming_both(sets, why,
                                                                           enabling):
    with pytest.raises(TrainError) as e:
        load_train_config(None, {"stores": ["hs.zarr"], **sets})
    assert why in str(e.value) and "(it has no effect otherwise)" in str(e.value)
    load_train_config(None, {"stores": ["hs.zarr"], **sets, **enabling})  # where it acts: fine


def test_an_inert_setting_is_refused_before_the_run_dir_exists(store, tmp_path):
    out = tmp_path / "run"
    said = one_line_error(_train(store, out, "--set", "optim.muon_ns_steps=7"))
    assert "optim.muon_ns_steps must be 5 unless optim.optimizer is muon" in said
    assert not out.exists()


def test_a_resume_takes_a_moved_store_with_the_same_content_and_refuses_another(tmp_path):
    first = make_store(str(tmp_path / "first.zarr"))
    run = tmp_path / "run"
    # killed while saving step 4: the run stops at its step-2 checkpoint, unfinished
    killed = subprocess.run([sys.executable, "-m", "dflash_train", "train", "--store", first,
                             "--out", str(run), *TRAIN, "--max-steps", "4"], cwd=REPO,
                            env={**os.environ, KILL_IN_SAVE_ENV: "4", "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert latest_checkpoint(run).name == "step_00000002"

    moved = str(tmp_path / "elsewhere" / "moved.zarr")
    shutil.copytree(first, moved)
    other = str(tmp_path / "other.zarr")  # the same shape of parts, another dataset
    shutil.copytree(first, other)
    shutil.rmtree(first)
    root = zarr.open_group(other, mode="r+")
    meta = dict(root.attrs["dflash"])
    meta["source"] = {**meta["source"], "sha256": ["d" * 64]}
    root.attrs["dflash"] = meta

    refused = _train(other, run, "--max-steps", "4", "--resume")
    assert refused.exit_code == 1, refused.output
    assert f"was trained on another store than {other}" in refused.output
    assert "source.sha256" in refused.output

    resumed = _train(moved, run, "--max-steps", "4", "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output and "trained 4 steps" in resumed.output
