"""`dflash log summary` answers from a crafted log whose answers are known."""

import json

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.train.errors import TrainError
from dflash_train.train.log_summary import read_log, summarize_log


def _records():
    recs = []
    for step in range(1, 21):
        recs.append({
            "step": step, "epoch": (step - 1) // 10, "loss": 10.0 - step * 0.25,
            "lr": min(step, 4) * 1e-4 if step <= 4 else 4e-4 * (20 - step) / 16,
            "tokens": 100 * (1 + step % 2), "samples": 2 + step % 2,
            "noise_std": 0.1 if step <= 10 else 0.05,
            "data_wait_s": 0.1, "step_s": 0.9, "tokens_per_s": 1000.0,
            **({"slot_acc": [step / 20] * 15, "train_tau": 1 + step / 10} if step % 5 == 0
               else {}),
        })
    return recs


def _write(run_dir, recs, tail=""):
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)


def test_summary_matches_the_crafted_log(tmp_path):
    _write(tmp_path / "run", _records(), tail='{"step": 21, "lo')  # torn last line
    s = summarize_log(read_log(tmp_path / "run"), parts=4)
    assert s["steps"] == 20 and s["epochs_seen"] == [0, 1]
    first = s["ranges"][0]
    assert first["steps"] == (1, 5)
    assert first["loss"] == pytest.approx(sum(10.0 - k * 0.25 for k in range(1, 6)) / 5)
    assert first["slot_acc"] == pytest.approx([0.25] * 15) and first["train_tau"] == 1.5
    assert s["lr"]["phase"] == "decay" and s["lr"]["peak_step"] == 4
    (boundary,) = s["epoch_boundaries"]
    assert boundary["step"] == 11
    assert boundary["loss_before"] == pytest.approx(sum(10 - k * 0.25 for k in range(6, 11)) / 5)
    assert s["noise"]["early"]["noise_std"] == 0.1 and s["noise"]["late"]["noise_std"] == 0.05
    assert s["batch_tokens"]["min"] == 100 and s["batch_tokens"]["max"] == 200
    assert s["data_wait_share"] == pytest.approx(0.1)
    assert s["tokens_per_s"]["cv"] == 0.0


def test_resumed_runs_keep_the_last_record_of_each_step(tmp_path):
    recs = _records()
    again = dict(recs[-1], loss=-1.0)
    _write(tmp_path / "run", recs + [again])
    assert read_log(tmp_path / "run")[-1].loss == -1.0


def test_command_prints_text_and_refuses_a_directory_without_a_log(tmp_path):
    _write(tmp_path / "run", _records())
    out = CliRunner().invoke(main, ["log", "summary", str(tmp_path / "run")])
    assert out.exit_code == 0 and "lr schedule: decay" in out.output
    assert "data wait: 10.0% of step time" in out.output
    (tmp_path / "empty").mkdir()
    bad = CliRunner().invoke(main, ["log", "summary", str(tmp_path / "empty")])
    assert bad.exit_code == 1 and "log.jsonl does not exist" in bad.output
    with pytest.raises(TrainError):
        read_log(tmp_path / "empty")
