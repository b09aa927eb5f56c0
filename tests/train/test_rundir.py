"""A run directory holds one run: a new run refuses it, a resume continues exactly that run."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash.cli import main
from dflash.drafter import load_drafter
from dflash.train.checkpoint import TRAINER_STATE, checkpoint_dir, complete_checkpoints
from dflash.train.config import TrainConfig, load_config
from dflash.train.errors import TrainError
from dflash.train.loop import train
from dflash.train.rundir import RUN_MANAGEMENT_FIELDS, config_changes

STEPS = 4


def _args(store: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--store", store, "--out", str(out), "--layers", "1", "--batch-tokens",
            "256", "--anchors-per-seq", "8", "--max-steps", str(STEPS), "--no-progress",
            "--set", "run.checkpoint_every=2", "--set", "run.keep_checkpoints=10",
            "--set", "loader.prefetch_batches=0", *extra]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(synthetic_store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    result = CliRunner().invoke(main, _args(synthetic_store, out))
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def test_a_new_run_refuses_a_directory_holding_a_run_and_touches_nothing(synthetic_store,
                                                                        run_copy):
    before = _snapshot(run_copy)
    again = CliRunner().invoke(main, _args(synthetic_store, run_copy))
    assert again.exit_code == 1
    last = f"checkpoints/step_{STEPS:08d}"
    assert f"{run_copy} already holds a run ({last}); pass --resume" in again.output
    assert "Traceback" not in again.output
    assert _snapshot(run_copy) == before


def test_a_run_killed_before_its_first_checkpoint_is_not_mixed_into(synthetic_store, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    result = CliRunner().invoke(main, _args(synthetic_store, out))
    assert result.exit_code == 1 and "log.jsonl" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl"]


def test_out_that_is_a_file_is_refused_cleanly(synthetic_store, tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    for extra in ([], ["--resume"]):
        result = CliRunner().invoke(main, _args(synthetic_store, path, *extra))
        assert result.exit_code == 1, result.output
        assert f"--out {path} is a file" in result.output and "Traceback" not in result.output
    assert path.read_text() == "x"


def test_resume_refuses_changed_settings_naming_each_old_and_new(synthetic_store, run_copy):
    before = _snapshot(run_copy)
    result = CliRunner().invoke(main, _args(synthetic_store, run_copy, "--resume", "--lr",
                                            "1e-2", "--layers", "2", "--set",
                                            "optim.warmup_ratio=0.5"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    saved = load_config(str(checkpoint_dir(run_copy, STEPS) / "config.toml"), {})
    assert f"--lr (optim.lr): {saved.optim.lr!r} -> 0.01" in result.output
    assert f"--layers (model.num_hidden_layers): {saved.model.num_hidden_layers} -> 2" \
        in result.output
    assert f"optim.warmup_ratio: {saved.optim.warmup_ratio!r} -> 0.5" in result.output
    assert "max_steps" not in result.output  # unchanged fields are not listed
    assert _snapshot(run_copy) == before


def test_run_management_fields_are_real_fields_and_alone_may_change():
    flat = {}

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                flat[f"{prefix}{f.name}"] = value

    walk(TrainConfig(), "")
    assert RUN_MANAGEMENT_FIELDS <= flat.keys()
    changed = {"run.progress": "false", "run.log_every": "7", "run.checkpoint_every": "9",
               "run.keep_checkpoints": "0", "run.out_dir": "elsewhere", "loader.workers": "2",
               "loader.prefetch_batches": "5"}
    assert changed.keys() <= RUN_MANAGEMENT_FIELDS
    assert config_changes(TrainConfig(), load_config(None, changed)) == []
    new = load_config(None, {**changed, "optim.epochs": "2", "loader.store_weights": "1"})
    assert config_changes(TrainConfig(), new) == [
        "--weights (loader.store_weights): None -> 1.0",
        f"--epochs (optim.epochs): {TrainConfig().optim.epochs} -> 2"]


def test_resume_accepts_run_management_changes(synthetic_store, run_copy):
    result = CliRunner().invoke(main, _args(synthetic_store, run_copy, "--resume", "--set",
                                            "run.log_every=3", "--set", "run.keep_checkpoints=1",
                                            "--progress"))
    assert result.exit_code == 0, result.output


def test_resuming_a_finished_run_says_so_and_writes_nothing(synthetic_store, run_copy):
    before = _snapshot(run_copy)
    result = CliRunner().invoke(main, _args(synthetic_store, run_copy, "--resume"))
    assert result.exit_code == 0, result.output
    assert f"already complete (step {STEPS} of {STEPS})" in result.output
    assert "nan" not in result.output
    assert _snapshot(run_copy) == before


def test_a_checkpoint_that_does_not_fit_the_drafter_is_a_train_error(synthetic_store, run_copy):
    # an unfinished run whose config.toml was edited to a shape its weights do not have
    shutil.rmtree(checkpoint_dir(run_copy, STEPS))
    (middle,) = complete_checkpoints(run_copy)
    toml = middle / "config.toml"
    toml.write_text(toml.read_text().replace("num_hidden_layers = 1", "num_hidden_layers = 2"))
    result = CliRunner().invoke(main, _args(synthetic_store, run_copy, "--resume", "--layers",
                                            "2"))
    assert result.exit_code == 1
    assert f"{middle}: its drafter weights do not fit" in result.output
    assert "Traceback" not in result.output


def test_resume_steps_back_over_a_truncated_trainer_state(synthetic_store, tmp_path):
    whole = tmp_path / "whole"
    assert CliRunner().invoke(main, _args(synthetic_store, whole)).exit_code == 0
    expected = load_drafter(checkpoint_dir(whole, STEPS)).state_dict()
    # the run stopped at its last checkpoint, whose trainer.pt then lost its tail
    run = Path(shutil.copytree(whole, tmp_path / "run"))
    damaged = checkpoint_dir(run, STEPS) / TRAINER_STATE
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    result = CliRunner().invoke(main, _args(synthetic_store, run, "--resume"))
    assert result.exit_code == 0, result.output
    assert f"{damaged} is damaged" in result.output
    assert f"resuming from the previous complete checkpoint step_{STEPS - 2:08d}" in result.output
    assert (run / "checkpoints" / f"damaged-step_{STEPS:08d}" / TRAINER_STATE).is_file()
    got = load_drafter(checkpoint_dir(run, STEPS)).state_dict()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_resume_with_every_checkpoint_damaged_names_the_newest(synthetic_store, run_copy):
    for ckpt in complete_checkpoints(run_copy):
        (ckpt / TRAINER_STATE).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(TrainError, match=rf"step_{STEPS:08d}/{TRAINER_STATE} is damaged"):
        train(load_config(None, {"stores": [synthetic_store], "run.out_dir": str(run_copy),
                                 "model.num_hidden_layers": 1, "loader.batch_tokens": 256,
                                 "run.anchors_per_seq": 8, "optim.max_steps": STEPS,
                                 "run.checkpoint_every": 2, "run.keep_checkpoints": 10,
                                 "loader.prefetch_batches": 0, "run.progress": False}),
              resume=True)
