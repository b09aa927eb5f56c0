"""Outside attack, issue 61: run files edited or damaged by hand.

Case 7: `dflash log summary` on a record whose `validation` object (or a step field the
summary never printed) holds a value of another type stops with one line naming the file,
the line and the field, never a traceback: every field a log record is read back with is
checked, not only the ones a summary happened to check first.

Case 10: a `--resume` whose newest checkpoint is damaged (its config.toml edited) and whose
settings differ from the older checkpoint it falls back to says that the newest is damaged,
naming its file and why, and which checkpoint the settings were compared with.
"""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.run_layout import CONFIG, checkpoint_dir
from dflash_train.train.record import StoreFigures, ValidationFigures
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store

STEP = {"step": 1, "epoch": 0, "loss": 4.0, "lr": 1e-4, "grad_norm": 1.0, "tokens": 100,
        "samples": 2, "skipped": 0, "blocks": 8, "noise_std": 0.05, "data_wait_s": 0.1,
        "step_s": 0.9, "tokens_per_s": 100.0, "slot_acc": [0.9, 0.8], "train_tau": 2.5,
        "selector_recall": 0.7}
FIGURES = {"tau": 3.0, "tree_tau": {"16": 3.5}, "blocks": 10}
VALIDATION = {**FIGURES, "tau_ci95": [2.9, 3.1], "best_step": 2, "seconds": 1.5,
              "stores": {"/data/val.zarr": FIGURES}}


def _store(**changes) -> dict:
    return {"/data/val.zarr": {**FIGURES, **changes}}


WRONG_VALIDATION = {
    # name: (the changed fields of the validation object, the field the refusal names)
    "tau a string": ({"tau": "high"}, "'tau'"),
    "tree_tau a list": ({"tree_tau": [3.5]}, "'tree_tau'"),
    "tree_tau holding a string": ({"tree_tau": {"16": "x"}}, "'16'"),
    "tree_tau keyed by a word": ({"tree_tau": {"sixteen": 3.5}}, "'sixteen'"),
    "tree_tau keyed by a superscript digit": ({"tree_tau": {"\u00b2": 3.5}}, "'\u00b2'"),
    "tree_tau keyed by 5000 digits": ({"tree_tau": {"9" * 5000: 3.5}}, "'tree_tau'"),
    "blocks an object": ({"blocks": {"n": 10}}, "'blocks'"),
    "blocks a float": ({"blocks": 10.5}, "'blocks'"),
    "tau_ci95 a string": ({"tau_ci95": "2.9..3.1"}, "'tau_ci95'"),
    "tau_ci95 of one number": ({"tau_ci95": [2.9]}, "'tau_ci95'"),
    "tau_ci95 of strings": ({"tau_ci95": ["2.9", "3.1"]}, "'tau_ci95'"),
    "best_step a string": ({"best_step": "2"}, "'best_step'"),
    "best_step a bool": ({"best_step": True}, "'best_step'"),
    "seconds a string": ({"seconds": "1.5"}, "'seconds'"),
    "seconds an object": ({"seconds": {"s": 1.5}}, "'seconds'"),
    "stores a list": ({"stores": ["/data/val.zarr"]}, "'stores'"),
    "a store a string": ({"stores": {"/data/val.zarr": "good"}}, "'/data/val.zarr'"),
    "a store's tau a string": ({"stores": _store(tau="high")}, "'tau'"),
    "a store's tree_tau a string": ({"stores": _store(tree_tau="3.5")}, "'tree_tau'"),
    "a store's blocks a string": ({"stores": _store(blocks="10")}, "'blocks'"),
}

WRONG_STEP = {
    "skipped a string": ({"skipped": "none"}, "'skipped'"),
    "blocks an object": ({"blocks": {"n": 8}}, "'blocks'"),
    "selector_recall a string": ({"selector_recall": "high"}, "'selector_recall'"),
    "train_tau a list": ({"train_tau": [2.5]}, "'train_tau'"),
    "grad_norm a string": ({"grad_norm": "1.0"}, "'grad_norm'"),
    "validation a list": ({"validation": [VALIDATION]}, "'validation'"),
}


def _line(step: int, **changes) -> bytes:
    return (json.dumps({**STEP, "step": step, **changes}) + "\n").encode()


def _summary(run: Path, second: bytes):
    (run / "log.jsonl").write_bytes(_line(1) + second + _line(3))
    return CliRunner().invoke(main, ["log", "summary", str(run)])


def test_every_validation_field_has_a_wrong_type_case():
    written = ValidationFigures(StoreFigures(3.0, {16: 3.5}, 10), [2.9, 3.1],
                                {"s": StoreFigures(3.0, {16: 3.5}, 10)}, 1.5, 2).to_json()
    assert set(VALIDATION) == set(written)
    assert {name for changes, _ in WRONG_VALIDATION.values() for name in changes} == set(written)


def test_a_whole_validation_record_is_summarized(tmp_path):
    result = _summary(tmp_path, _line(2, validation=VALIDATION))
    assert result.exit_code == 0, result.output
    assert "validation on /data/val.zarr (pooled):" in result.output


@pytest.mark.parametrize("case", list(WRONG_VALIDATION))
def test_a_validation_field_of_another_type_is_one_line_naming_it(tmp_path, case):
    changes, field = WRONG_VALIDATION[case]
    said = one_line_error(_summary(tmp_path, _line(2, validation={**VALIDATION, **changes})))
    assert said.startswith(f"Error: {tmp_path / 'log.jsonl'} line 2"), said
    assert "'validation'" in said and field in said, said


@pytest.mark.parametrize("case", list(WRONG_STEP))
def test_a_step_field_of_another_type_is_one_line_naming_it(tmp_path, case):
    changes, field = WRONG_STEP[case]
    said = one_line_error(_summary(tmp_path, _line(2, **changes)))
    assert said.startswith(f"Error: {tmp_path / 'log.jsonl'} line 2") and field in said, said


TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
         "--set", "loader.prefetch_batches=0", "--set", "run.checkpoint_every=2", "--set",
         "run.keep_checkpoints=10"]


def _train(store: str, out: Path, *args: str):
    return CliRunner().invoke(main, ["train", "--store", store, "--out", str(out), *TRAIN,
                                     *args])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[str, Path]:
    store = make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))
    run = tmp_path_factory.mktemp("finished") / "run"
    result = _train(store, run, "--max-steps", "4")
    assert result.exit_code == 0, result.output
    return store, run


def test_a_resume_over_an_edited_newest_checkpoint_says_it_is_damaged(finished, tmp_path):
    store, finished_run = finished
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    newest, older = checkpoint_dir(run, 4), checkpoint_dir(run, 2)
    config = newest / CONFIG
    config.write_text(config.read_text().replace("lr = ", "lr = 0.5 #", 1))
    said = one_line_error(_train(store, run, "--resume", "--max-steps", "6", "--lr", "0.5"))
    assert f"{config} is damaged" in said and "checksum" in said, said
    assert str(older / CONFIG) in said, said
