"""A run directory holds one run: a new run refuses it, a resume continues exactly that run."""

import dataclasses
import errno
import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import load_drafter
from dflash_train.run_layout import CHECKSUMS_NAME
from dflash_train.train.checkpoint import (
    PROVENANCE,
    TRAINER_STATE,
    checkpoint_dir,
    complete_checkpoints,
    read_checkpoint,
)
from dflash_train.train.config import TrainConfig, load_train_config
from dflash_train.train.errors import TrainError
from dflash_train.train.loop import train
from dflash_train.train.parallel import gather_objects
from dflash_train.train.run import check_same_choice
from dflash_train.train.rundir import RUN_MANAGEMENT_FIELDS, config_changes, find_resume_point
from dflash_train.train.step import make_blocks

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


def test_a_run_killed_before_its_first_checkpoint_is_moved_aside_and_a_new_one_starts(
        synthetic_store, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / ".tmp-step_00000002-99").mkdir(parents=True)  # a torn save
    (out / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (out / "config.toml").write_text("# the killed run's\n")
    resumed = CliRunner().invoke(main, _args(synthetic_store, out, "--resume"))
    assert resumed.exit_code == 1 and "run without --resume to start a new run" in resumed.output
    result = CliRunner().invoke(main, _args(synthetic_store, out))
    assert result.exit_code == 0, result.output
    aside = out / "aborted-1"
    assert f"moved its checkpoints, log.jsonl, config.toml to {aside}" in result.output
    assert (aside / "log.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    assert (aside / "config.toml").read_text() == "# the killed run's\n"
    assert (aside / "checkpoints" / ".tmp-step_00000002-99").is_dir()
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").open()]
    assert steps == list(range(1, STEPS + 1))  # the new run's log alone
    assert len(complete_checkpoints(out)) == STEPS // 2


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
    saved = load_train_config(str(checkpoint_dir(run_copy, STEPS) / "config.toml"), {})
    assert f"--lr (optim.lr): {saved.optim.lr!r} -> 0.01" in result.output
    assert f"--layers (model.num_hidden_layers): {saved.model.num_hidden_layers} -> 2" \
        in result.output
    assert f"optim.warmup_ratio: {saved.optim.warmup_ratio!r} -> 0.5" in result.output
    assert "max_steps" not in result.output  # unchanged fields are not listed
    assert _snapshot(run_copy) == before


def test_resume_refuses_another_optimizer_or_position_weighting(synthetic_store, run_copy):
    before = _snapshot(run_copy)
    result = CliRunner().invoke(main, _args(synthetic_store, run_copy, "--resume", "--set",
                                            "optim.optimizer=muon", "--set",
                                            "loss.position_weights=dpace"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "optim.optimizer: 'adamw' -> 'muon'" in result.output
    assert "loss.position_weights: 'decay' -> 'dpace'" in result.output
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
    assert config_changes(TrainConfig(), load_train_config(None, changed)) == []
    new = load_train_config(None, {**changed, "optim.epochs": "2", "loader.store_weights": "1"})
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


def test_an_explicit_model_setting_is_checked_against_the_checkpoints_own_drafter(
        synthetic_store, run_copy):
    # a checkpoint from before checksums whose config.toml was edited to a shape its drafter
    # does not have: the drafter's own config.json is what a resume would train
    shutil.rmtree(checkpoint_dir(run_copy, STEPS))
    (middle,) = complete_checkpoints(run_copy)
    (middle / CHECKSUMS_NAME).unlink()
    toml = middle / "config.toml"
    toml.write_text(toml.read_text().replace("num_hidden_layers = 1", "num_hidden_layers = 2"))
    result = CliRunner().invoke(main, _args(synthetic_store, run_copy, "--resume", "--layers",
                                            "2"))
    assert result.exit_code == 1
    assert "--layers (model.num_hidden_layers): 1 -> 2" in result.output
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
        train(load_train_config(None, {"stores": [synthetic_store], "run.out_dir": str(run_copy),
                                       "model.num_hidden_layers": 1, "loader.batch_tokens": 256,
                                       "run.anchors_per_seq": 8, "optim.max_steps": STEPS,
                                       "run.checkpoint_every": 2, "run.keep_checkpoints": 10,
                                       "loader.prefetch_batches": 0, "run.progress": False}),
              resume=True)


OLD_MODEL_SECTION = "[model]\nnum_hidden_layers = 1\nsliding_layers = 0\nsliding_window = 2048\n"
"""[model] as the version before `None: the released drafter's` defaults wrote it: explicit
sliding fields, heads left to the target (today's defaults could resolve them otherwise)."""


def _as_previous_version(checkpoint: Path) -> None:
    """Rewrite a checkpoint as the previous version left it: no checksum records, and a
    config.toml whose [model] section has the old form."""
    (checkpoint / CHECKSUMS_NAME).unlink(missing_ok=True)
    (checkpoint / "drafter" / CHECKSUMS_NAME).unlink(missing_ok=True)
    toml = checkpoint / "config.toml"
    text = toml.read_text()
    start = text.index("[model]")
    end = text.index("\n[", start + 1) + 1
    toml.write_text(text[:start] + OLD_MODEL_SECTION + text[end:])


def test_a_run_saved_by_the_previous_version_resumes_its_own_drafter(synthetic_store, tmp_path):
    # The run's drafter has heads today's defaults would not build (2 of 16, not the
    # target's 4 of 8), and its saved config records only the old [model] fields.
    shape = ["--set", "model.num_attention_heads=2", "--set", "model.head_dim=16"]
    whole = tmp_path / "whole"
    assert CliRunner().invoke(main, _args(synthetic_store, whole, *shape)).exit_code == 0
    expected = load_drafter(checkpoint_dir(whole, STEPS)).state_dict()
    run = Path(shutil.copytree(whole, tmp_path / "run"))
    shutil.rmtree(checkpoint_dir(run, STEPS))
    _as_previous_version(checkpoint_dir(run, STEPS - 2))
    result = CliRunner().invoke(main, _args(synthetic_store, run, "--resume"))
    assert result.exit_code == 0, result.output
    resumed = load_drafter(checkpoint_dir(run, STEPS))
    assert (resumed.config.num_attention_heads, resumed.config.head_dim) == (2, 16)
    for k in expected:
        assert torch.equal(resumed.state_dict()[k], expected[k]), k


def test_the_same_store_by_another_path_or_cwd_and_another_device_resume(synthetic_store,
                                                                        tmp_path, monkeypatch):
    store = Path(synthetic_store)
    monkeypatch.chdir(store.parent)
    run = tmp_path / "run"
    assert CliRunner().invoke(main, _args("./" + store.name, run)).exit_code == 0
    saved = load_train_config(str(run / "config.toml"), {})
    assert saved.stores == [str(store)]  # recorded absolute
    shutil.rmtree(checkpoint_dir(run, STEPS))  # as if stopped after step 2
    monkeypatch.chdir(tmp_path)  # where ./hs.zarr is another (missing) store
    result = CliRunner().invoke(main, _args(str(store), run, "--resume", "--device", "cpu"))
    assert result.exit_code == 0, result.output
    assert f"trained {STEPS} steps" in result.output
    # an old run's relative path is read from the cwd of the resume, like its --store
    old = dataclasses.replace(saved, stores=[store.name])
    monkeypatch.chdir(store.parent)
    assert config_changes(old, saved) == []
    other = dataclasses.replace(saved, stores=[str(tmp_path / "other.zarr")])
    # nor is another path: the resume knows a store by its provenance (check_provenance)
    assert config_changes(old, other) == []


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2
    data[i:i + 8] = bytes(b ^ 0x5A for b in data[i:i + 8])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "damage"), [
    (TRAINER_STATE, _flip), (PROVENANCE, _cut), ("config.toml", _cut)])
def test_resume_steps_back_over_any_damaged_checkpoint_file(synthetic_store, finished_run,
                                                           tmp_path, name, damage):
    expected = load_drafter(checkpoint_dir(finished_run, STEPS)).state_dict()
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    damaged = checkpoint_dir(run, STEPS) / name
    damage(damaged)
    result = CliRunner().invoke(main, _args(synthetic_store, run, "--resume"))
    assert result.exit_code == 0, result.output
    assert f"{damaged} is damaged" in result.output
    assert f"previous complete checkpoint step_{STEPS - 2:08d}" in result.output
    got = load_drafter(checkpoint_dir(run, STEPS)).state_dict()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


@pytest.mark.parametrize("error", [MemoryError(), OSError(errno.EIO, "Input/output error"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory")])
def test_trouble_of_this_process_is_not_taken_for_a_damaged_checkpoint(run_copy, monkeypatch,
                                                                       error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "load", fail)
    with pytest.raises(type(error)):
        find_resume_point(run_copy)
    monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(EOFError()))
    with pytest.raises(TrainError, match="trainer.pt is damaged"):
        read_checkpoint(checkpoint_dir(run_copy, STEPS))


def test_ranks_that_chose_different_checkpoints_are_refused(tmp_path):
    assert gather_objects("step_00000004", 1) == ["step_00000004"]  # one process: no collective
    check_same_choice(["step_00000004"] * 3, tmp_path)
    with pytest.raises(TrainError, match="rank 0: step_00000004, rank 1: step_00000002"):
        check_same_choice(["step_00000004", "step_00000002"], tmp_path)


def test_a_resumed_run_lets_go_of_the_checkpoint_it_read(synthetic_store, run_copy,
                                                         monkeypatch):
    import dflash_train.train.loop as loop
    import dflash_train.train.run as run

    shutil.rmtree(checkpoint_dir(run_copy, STEPS))  # two steps left to train
    refs = []

    def find(run_dir):
        point = find_resume_point(run_dir)
        refs.extend([weakref.ref(point), weakref.ref(point.trainer["torch_rng"])])
        return point

    alive_while_training = []

    def blocks(*args, **kwargs):
        gc.collect()
        alive_while_training.append([r() is not None for r in refs])
        return make_blocks(*args, **kwargs)

    monkeypatch.setattr(run, "find_resume_point", find)
    monkeypatch.setattr(loop, "make_blocks", blocks)
    result = CliRunner().invoke(main, _args(synthetic_store, run_copy, "--resume"))
    assert result.exit_code == 0, result.output
    assert len(refs) == 2 and len(alive_while_training) == 2
    assert alive_while_training == [[False, False]] * 2


def test_a_run_from_an_init_drafter_resumes_with_its_own_command_line(synthetic_store,
                                                                      finished_run, tmp_path):
    init = str(checkpoint_dir(finished_run, STEPS))  # a 1-layer drafter
    out = tmp_path / "from_init"
    args = ["train", "--store", synthetic_store, "--out", str(out), "--batch-tokens", "256",
            "--anchors-per-seq", "8", "--max-steps", str(STEPS), "--no-progress",
            "--set", "run.checkpoint_every=2", "--set", "loader.prefetch_batches=0",
            "--set", f"model.init_from={init}"]
    assert CliRunner().invoke(main, args).exit_code == 0
    shutil.rmtree(checkpoint_dir(out, STEPS))
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert load_drafter(checkpoint_dir(out, STEPS)).config.num_hidden_layers == 1


def test_settings_that_contradict_the_init_drafter_are_refused(synthetic_store, finished_run,
                                                               tmp_path):
    init = str(checkpoint_dir(finished_run, STEPS))
    out = tmp_path / "contradicts"
    result = CliRunner().invoke(main, ["train", "--store", synthetic_store, "--out", str(out),
                                       "--layers", "3", "--no-progress", "--set",
                                       f"model.init_from={init}"])
    assert result.exit_code == 1
    assert "--layers (model.num_hidden_layers) 3 (the drafter has 1)" in result.output
    assert not (out / "config.toml").exists()


def test_a_resume_over_parts_that_changed_is_refused(tmp_path):
    from tests.train.conftest import build_store

    store = str(tmp_path / "hs.zarr")
    build_store(store, rows=24, parts=3, unfinished=1)  # the last part unfinished
    out = tmp_path / "run"
    assert CliRunner().invoke(main, _args(store, out)).exit_code == 0
    shutil.rmtree(checkpoint_dir(out, STEPS))
    from dflash_train.store_schema import open_store

    open_store(store, mode="r+").part_writer(2, 16, 24).finish()  # extraction ended meanwhile
    result = CliRunner().invoke(main, _args(store, out, "--resume"))
    assert result.exit_code == 1
    assert "usable parts changed" in result.output and "new: store 0 part 2" in result.output


def test_a_run_whose_last_step_was_a_periodic_checkpoint_is_complete(synthetic_store, tmp_path):
    out = tmp_path / "run"
    # epochs of 11 and 10 batches: the schedule's 2 x 11 steps overshoot the 21 taken
    args = ["train", "--store", synthetic_store, "--out", str(out), "--layers", "1",
            "--batch-tokens", "128", "--anchors-per-seq", "8", "--epochs", "2", "--no-progress",
            "--set", "loader.prefetch_batches=0"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    last = complete_checkpoints(out)[-1]
    steps = int(last.name.removeprefix("step_"))
    assert steps == 21
    # the same run, checkpointing every `steps` steps: its last save is the periodic one
    shutil.rmtree(out)
    assert CliRunner().invoke(main, [*args, "--set", f"run.checkpoint_every={steps}"]
                              ).exit_code == 0
    before = _snapshot(out)
    again = CliRunner().invoke(main, [*args, "--set", f"run.checkpoint_every={steps}",
                                      "--resume"])
    assert again.exit_code == 0, again.output
    assert "already complete" in again.output
    assert _snapshot(out) == before


def test_a_second_train_on_a_directory_in_use_is_refused(synthetic_store, tmp_path):
    from dflash_train.train.rundir import run_lock

    out = tmp_path / "run"
    with run_lock(out, rank=0):  # a run in progress in this directory
        busy = CliRunner().invoke(main, _args(synthetic_store, out))
        assert busy.exit_code == 1
        assert f"{out} is in use by a running `dflash train` (pid " in busy.output
        assert not (out / "config.toml").exists()
    free = CliRunner().invoke(main, _args(synthetic_store, out))  # the lock died with it
    assert free.exit_code == 0, free.output
