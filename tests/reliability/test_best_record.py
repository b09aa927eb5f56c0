"""The best-checkpoint record (RUN/best.json) never picks the drafter on its own: a damaged
record is one clear line, a stale or missing one is re-derived from the run's saved
validation (log.jsonl) by export, eval and a resume, and a SIGKILL between a validation's
checkpoint and its marking resumes to the best.json an uninterrupted run writes.

Validation figures are scripted by step (the replay is dflash eval's and tested there), so
the best moves: step 4 beats step 2, step 6 does not, step 8 beats them all."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.run_layout import BEST, COMPLETE, LOG, checkpoint_dir
from dflash_train.run_reader import BestMark, RunDirError, log_lines, run_checkpoint, saved_best
from dflash_train.train import loop
from dflash_train.train.config import load_train_config
from dflash_train.train.errors import TrainError
from dflash_train.train.log_summary import read_log
from dflash_train.train.record import StoreFigures, ValidationFigures
from dflash_train.train.validation import follow_best
from tests.reliability.kill_points import run_child
from tests.train.conftest import build_store

TAU_BY_STEP = {2: 1.5, 4: 2.0, 6: 1.8, 8: 2.5}
SETTINGS = {"model.num_hidden_layers": 1, "loader.batch_tokens": 256, "run.anchors_per_seq": 8,
            "run.progress": False, "loader.prefetch_batches": 0, "run.precision": "fp32",
            "optim.max_steps": 8, "run.checkpoint_every": 2, "run.keep_checkpoints": 0,
            "validation.tree_budgets": [16]}


def scripted_validate(run):
    """loop.validate_checkpoint with figures read off TAU_BY_STEP for the step validated."""
    tau = TAU_BY_STEP[run.state.step]
    pooled = StoreFigures(tau=tau, tree_tau={16: tau + 0.5}, blocks=10)
    figures = ValidationFigures(pooled=pooled, tau_ci95=None, stores={"v": pooled}, seconds=0.0)
    follow_best(run.state, figures, run.cfg.validation)
    return figures


def _config(store: str, val: str, out: Path, **extra):
    return load_train_config(None, {"stores": [store], "validation.stores": [val],
                                    "run.out_dir": str(out), **SETTINGS, **extra})


def train_scripted(store: str, val: str, out: str, resume: bool = False, **extra) -> None:
    """Train (in whatever process calls it) with the scripted validation."""
    loop.validate_checkpoint = scripted_validate
    loop.train(_config(store, val, Path(out), **extra), resume=resume)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("stores")
    build_store(str(root / "hs.zarr"))
    build_store(str(root / "val.zarr"), rows=8, parts=1, first_sample=24)
    return str(root / "hs.zarr"), str(root / "val.zarr")


@pytest.fixture(scope="module")
def finished(stores, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    original = loop.validate_checkpoint
    try:
        train_scripted(*stores, str(out))
    finally:
        loop.validate_checkpoint = original
    assert json.loads((out / BEST).read_text()) == {"step": 8, "figure": "tau", "value": 2.5}
    return out


def _export(run: Path, out: Path):
    return CliRunner().invoke(main, ["export", str(run), str(out), "--dtype", "keep"])


@pytest.mark.parametrize("value", ["2.5", None, True, "NaN"])
def test_a_marker_with_a_bad_value_is_one_line_naming_the_field(stores, tmp_path, value):
    # no validation in the log: the marker alone decides, so it must read whole
    run = tmp_path / "run"
    loop.train(load_train_config(None, {"stores": [stores[0]], "run.out_dir": str(run),
                                        **{k: v for k, v in SETTINGS.items()
                                           if not k.startswith("validation")},
                                        "optim.max_steps": 2}))
    (run / BEST).write_text(json.dumps({"step": 2, "figure": "tau", "value": value}))
    for args in (["export", str(run), str(tmp_path / "out")],
                 ["eval", "--store", stores[1], str(run), "--tree-budget", ""]):
        got = CliRunner().invoke(main, args)
        assert got.exit_code == 1, got.output
        assert "Traceback" not in got.output and "field 'value'" in got.output, got.output
        assert str(run / BEST) in got.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("marker", [
    {"step": 4, "figure": "tau", "value": 2.0},  # stale: the best moved on to 8
    {"step": 8, "figure": "tau", "value": "2.5"},  # damaged
    None,  # missing
])
def test_export_takes_the_saved_best_whatever_the_marker_says(finished, tmp_path, marker):
    best = finished / BEST
    saved = best.read_text()
    try:
        best.unlink()
        if marker is not None:
            best.write_text(json.dumps(marker))
        got = _export(finished, tmp_path / "out")
        assert got.exit_code == 0, got.output
        assert f"exported {checkpoint_dir(finished, 8)} ->" in got.output
        assert "its best checkpoint (tau 2.5000 on validation)" in got.output
        assert "the run has no validation" not in got.output
    finally:
        best.write_text(saved)


def test_a_finished_runs_resume_repairs_its_marker(stores, finished, tmp_path, monkeypatch):
    best = finished / BEST
    saved = best.read_text()
    monkeypatch.setattr(loop, "validate_checkpoint", scripted_validate)
    try:
        for marker in ({"step": 4, "figure": "tau", "value": 2.0}, None):
            best.unlink()
            if marker is not None:
                best.write_text(json.dumps(marker))
            result = loop.train(_config(*stores, finished), resume=True)
            assert result.already_complete
            assert best.read_text() == saved
    finally:
        best.write_text(saved)


def test_a_resume_stopped_by_patience_says_it_trained_nothing(stores, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "validate_checkpoint", scripted_validate)
    monkeypatch.setitem(TAU_BY_STEP, 6, 1.0)
    run = tmp_path / "run"
    # validations at 2 (1.5), 4 (2.0), 6 (1.0): patience 1 stops at 6
    first = loop.train(_config(*stores, run, **{"run.patience": 1}))
    assert first.stopped and first.steps == 6
    args = ["train", "--store", stores[0], "--val-store", stores[1], "--out", str(run),
            "--resume", "--set", "run.patience=1"]
    args += [f"--set={k}={','.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in SETTINGS.items() if k != "run.progress"]
    got = CliRunner().invoke(main, args + ["--no-progress"])
    assert got.exit_code == 0, got.output
    assert "nothing trained" in got.output and "final loss nan" not in got.output
    assert "has not beaten step 4's 2.0000" in got.output
    assert f"take its best checkpoint (tau 2.0000 on validation): {checkpoint_dir(run, 4)}" \
        in got.output


def test_a_kill_between_a_checkpoint_and_its_marking_resumes_to_the_same_best(stores,
                                                                             finished,
                                                                             tmp_path):
    run = tmp_path / "run"
    trial = run_child(train_scripted, (*stores, str(run)), root=run.parent)
    assert trial.exitcode == 0, trial.error
    marks = [i for i, e in enumerate(trial.events, 1) if f"/.{BEST}." in e
             and e.startswith("open")]
    assert len(marks) == 4  # one marking per checkpoint: 2, 4, 6, 8
    # before the marking of 4 (the best moves to it) and of 8 (the run's last checkpoint)
    for at in (marks[1], marks[3]):
        killed = tmp_path / f"killed_{at}"
        trial = run_child(train_scripted, (*stores, str(killed)), root=tmp_path, kill_at=at)
        assert trial.exitcode == -9, trial.error
        # what a user holding the killed run gets: the saved validation's best, already
        chosen, _ = run_checkpoint(killed)
        assert chosen.name == checkpoint_dir(killed, 4 if at == marks[1] else 8).name
        trial = run_child(train_scripted, (*stores, str(killed), True), root=tmp_path)
        assert trial.exitcode == 0, trial.error
        assert (killed / BEST).read_text() == (finished / BEST).read_text()


def _logged_run(root: Path, *lines: bytes) -> Path:
    """A run with complete checkpoints at steps 2 and 4, validated there (step 4 best), whose
    log holds the records of steps 1-4 and then `lines`."""
    run = root / "run"
    for step in (2, 4):
        checkpoint_dir(run, step).mkdir(parents=True)
        (checkpoint_dir(run, step) / COMPLETE).touch()
    records = [{"step": step, "epoch": 0, "loss": 4.0, "lr": 1e-4, "tokens": 100}
               for step in range(1, 5)]
    records[1]["validation"] = {"tau": 1.5, "blocks": 10, "best_step": 2}
    records[3]["validation"] = {"tau": 2.0, "blocks": 10, "best_step": 4}
    (run / LOG).write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records)
                            + b"".join(lines))
    return run


def test_both_log_readers_pass_over_a_torn_last_line_alone(tmp_path):
    # run_reader (the saved validation) and train.log_summary read log.jsonl by one rule
    whole = _logged_run(tmp_path / "whole")
    torn = _logged_run(tmp_path / "torn", b'{"step": 5, "validation": {"tau": 9.0, "lo\xe2\x80')
    told = []
    read = list(log_lines(torn / LOG, lambda number, why: told.append(number)))
    assert read == list(log_lines(whole / LOG))
    assert told == [5]
    assert saved_best(torn) == saved_best(whole) == BestMark(4, "tau", 2.0)
    assert read_log(torn) == read_log(whole)
    assert [r.step for r in read_log(torn)] == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", [b"step 3 was here\n", b"\x80\xff\x00 bytes\n",
                                 b"[" * 100_000 + b"]" * 100_000 + b"\n"],
                         ids=["not JSON", "not UTF-8", "nested too deeply"])
def test_both_log_readers_refuse_a_bad_line_before_the_last_naming_it(tmp_path, bad):
    run = _logged_run(tmp_path, bad, b'{"step": 6, "epoch": 0, "loss": 4.0, "lr": 0.0001, '
                                     b'"tokens": 100}\n')
    where = re.escape(f"{run / LOG} line 5 is not")
    with pytest.raises(RunDirError, match=where + ".*; name a checkpoint instead"):
        saved_best(run)
    with pytest.raises(TrainError, match=where):
        read_log(run)
