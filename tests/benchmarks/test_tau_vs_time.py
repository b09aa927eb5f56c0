"""benchmarks/tau_vs_time.py: a checkpoint's training seconds are the logged step times up to
it, a resumed run's repeated steps counted once (the last record wins), and bad files are
named, not tracebacks."""

import json

import pytest

from benchmarks.tau_vs_time import seconds_by_step, taus_by_step
from dflash_train.run_layout import LOG


def record(step: int, step_s: float) -> dict:
    """The fields every log record holds, and its step time."""
    return {"step": step, "epoch": 0, "loss": 1.0, "lr": 1e-3, "tokens": 8, "step_s": step_s}


def write_log(run_dir, records):
    (run_dir / LOG).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_resumed_run_counts_each_step_once_with_its_last_record(tmp_path):
    # steps 1-3, a crash, then a resume from step 2's checkpoint that ran 3 and 4 again
    write_log(tmp_path, [record(1, 1.0), record(2, 2.0), record(3, 9.0), record(3, 3.0),
                         record(4, 4.0)])
    assert seconds_by_step(tmp_path) == {1: 1.0, 2: 3.0, 3: 6.0, 4: 10.0}


def test_a_line_that_is_not_a_log_record_is_named(tmp_path):
    (tmp_path / LOG).write_text(json.dumps(record(1, 1.0)) + '\n{"loss": 2}\n')
    with pytest.raises(SystemExit, match=r"log.jsonl line 2: "):
        seconds_by_step(tmp_path)


def test_taus_are_read_by_the_step_in_each_checkpoint_path(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"checkpoints": [
        {"path": "run/checkpoints/step_00000400", "offline": {"mean_tau": 1.4,
                                                             "tau_ci95": [1.3, 1.5]}},
        {"path": "exported-drafter", "offline": {"mean_tau": 9.9, "tau_ci95": [9, 10]}},
        {"path": "run/checkpoints/step_00000800/", "offline": {"mean_tau": 1.6,
                                                              "tau_ci95": [1.5, 1.7]}}]}))
    assert taus_by_step(report) == {400: (1.4, [1.3, 1.5]), 800: (1.6, [1.5, 1.7])}


def test_a_report_without_checkpoints_is_refused(tmp_path):
    report = tmp_path / "report.json"
    report.write_text("{}")
    with pytest.raises(SystemExit, match="not a dflash eval report.json"):
        taus_by_step(report)
