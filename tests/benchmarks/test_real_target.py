"""The real-target benchmark's presets build train configs the trainer accepts."""

import json
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

import benchmarks.real_target as real_target
from benchmarks.real_target import (
    PRESETS,
    evaluate_drafter,
    markdown,
    plot,
    prompt_sets,
    recipe,
    relative_to_out,
    train_config,
    validation_of,
)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_a_train_config_the_trainer_accepts(preset, tmp_path):
    cfg = PRESETS[preset]
    val = "val.zarr" if cfg.val_prompts else None
    tc = train_config(cfg, "store.zarr", tmp_path / "run", cfg.drafter_layers[0], val)
    assert tc.loss.position_weights == cfg.position_weights
    assert tc.model.draft_vocab_size == cfg.draft_vocab_size
    assert tc.optim.optimizer == cfg.optimizer
    # the long preset's checkpoints are validated by train itself, on every sample
    assert tc.validation.stores == ([val] if val else [])
    if val:
        assert tc.validation.limit is None and tc.validation.best_by == "tau"


def test_gamma_reaches_the_loss_only_under_decay(tmp_path):
    cfg = replace(PRESETS["full"], position_weights="decay", gamma=4.0)
    assert train_config(cfg, "s.zarr", tmp_path, 1).loss.gamma == 4.0
    assert "decay gamma 4.0" in recipe({"gamma": 4.0})  # a run from before the field


def test_recipe_names_what_a_run_trained_with():
    text = recipe({"gamma": 4.0, "optimizer": "muon", "position_weights": "dpace",
                   "draft_vocab_size": 4096})
    assert text == "muon, dpace, draft vocabulary 4096"


def test_validation_prompts_come_out_of_the_train_set():
    train, held = [f"t{i}" for i in range(10)], ["h0", "h1"]
    sets = prompt_sets(train, held, 3)
    assert sets == {"train": train[:7], "held_out": held, "validation": ["t7", "t8", "t9"]}
    assert prompt_sets(train, held, 0) == {"train": train, "held_out": held}
    with pytest.raises(SystemExit, match="10 validation prompts out of 10"):
        prompt_sets(train, held, 10)


def fake_evaluate(taus_by_store: dict, calls: list):
    """evaluate() over made-up taus: {store: {step: tau}}; records what it was asked."""
    def evaluate(store, checkpoints):
        calls.append((store, sorted(checkpoints)))
        return {s: {"tau": taus_by_store[store][s], "tau_ci95": None, "slot_accepted": [0.5],
                    "slot_accuracy": [0.5], "tree_tau": {"64": 2.0}} for s in checkpoints}, 1.0
    return evaluate


TRAINED = {"checkpoints": {0: "u", 10: "c10", 20: "c20", 30: "c30"}, "steps": 30,
           "validation": {}, "best_step": None}


def test_the_checkpoint_is_chosen_on_validation_never_on_held_out(monkeypatch):
    # held-out would prefer step 30; training's validation marked 20: validation must win,
    # and held-out eval sees only the untrained, the chosen and the last
    validated = {s: {"tau": t, "tau_ci95": None, "tree_tau": {}, "blocks": 9, "seconds": 2.5}
                 for s, t in {10: 1.2, 20: 1.5, 30: 1.4}.items()}
    trained = {**TRAINED, "validation": validated, "best_step": 20}
    taus = {"held": {0: 1.0, 10: 1.1, 20: 1.3, 30: 1.9}}
    calls = []
    monkeypatch.setattr(real_target, "evaluate", fake_evaluate(taus, calls))
    evals, seconds = evaluate_drafter(trained, "held")
    assert evals["chosen_step"] == 20 and evals["validation"] == validated
    assert calls == [("held", [0, 20, 30])]
    assert sorted(evals["eval"]) == [0, 20, 30] and seconds == 1.0 + 3 * 2.5


def test_without_validation_every_checkpoint_is_evaluated_held_out(monkeypatch):
    taus = {"held": {0: 1.0, 10: 1.1, 20: 1.3, 30: 1.2}}
    calls = []
    monkeypatch.setattr(real_target, "evaluate", fake_evaluate(taus, calls))
    evals, _ = evaluate_drafter(TRAINED, "held")
    assert evals["chosen_step"] is None and evals["validation"] == {}
    assert calls == [("held", [0, 10, 20, 30])]


def test_the_validation_curve_and_the_chosen_step_are_read_from_the_run(tmp_path):
    from dflash_train.run_layout import LOG
    from dflash_train.train.best import BestMark, write_best
    from dflash_train.train.record import StepRecord, StoreFigures, ValidationFigures

    def record(step, tau=None):
        r = StepRecord(step=step, epoch=0, loss=1.0, lr=1e-3, tokens=10)
        if tau is not None:
            f = StoreFigures(tau=tau, tree_tau={16: tau + 0.25}, blocks=40)
            r.validation = ValidationFigures(f, [tau - 0.1, tau + 0.1], {"v.zarr": f}, 3.0,
                                             best_step=2)
        return json.dumps(r.to_json())

    (tmp_path / LOG).write_text("\n".join([record(1), record(2, 1.5), record(3),
                                           record(4, 1.25)]) + "\n")
    assert validation_of(tmp_path) == ({2: {"tau": 1.5, "tau_ci95": [1.4, 1.6],
                                            "tree_tau": {"16": 1.75}, "blocks": 40,
                                            "seconds": 3.0},
                                        4: {"tau": 1.25, "tau_ci95": [1.15, 1.35],
                                            "tree_tau": {"16": 1.5}, "blocks": 40,
                                            "seconds": 3.0}}, None)
    write_best(tmp_path, BestMark(step=2, figure="tau", value=1.5))
    assert validation_of(tmp_path)[1] == 2


def test_the_report_marks_the_chosen_step_and_its_training_seconds(tmp_path):
    entry = {"tau": 1.5, "tau_ci95": [1.4, 1.6], "slot_accepted": [0.4, None],
             "tree_tau": {"64": 2.25}}
    results = {
        "preset": "long", "date": "2026-12-04",
        "config": {**vars(PRESETS["long"]), "drafter_layers": [1]},
        "drafters": {"1L": {"eval": {"0": {**entry, "tau": 1.0}, "400": entry},
                            "validation": {"0": {"tau": 1.0}, "400": {"tau": 1.55}},
                            "chosen_step": 400, "train_seconds": {"0": 0.0, "400": 612.4}}},
        "seconds": {"train_1L": 612.4}, "stores": {},
        "fidelity": {"same_taus": 8, "prompts": 8, "same_text": 8,
                     "same_tree_taus": {"16": 8, "64": 7}}}
    text = markdown(results)
    assert ("offline replay == --online on 8 of 8 held-out prompts, DDTree @16 on 8, "
            "DDTree @64 on 7 (same text on 8)") in text
    assert "3936 train / 64 validation / 128 held-out prompts" in text
    assert "| 1L | 400 (chosen) | 612 | 1.550 | 1.500 (1.400-1.600) | 2.250 |" in text
    assert "1L at step 400, held-out P(slot accepted" in text and "0.40, -" in text
    plot(results, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_fidelity_keeps_the_tree_walks_live_equals_offline_figures(monkeypatch):
    import dflash_train.evaluate.pipeline as pipeline

    seen = {}

    def run_eval(config, echo):
        seen.update(online=config.online, limit=config.limit, model=config.model)
        check = {"prompts": 8, "same_text": 7, "same_taus": {"ck": 8}, "taus_differ": {"ck": []},
                 "same_tree_taus": {"ck": {"16": 8, "32": 6}}}
        return types.SimpleNamespace(report={"online_check": check})

    monkeypatch.setattr(pipeline, "run_eval", run_eval)
    check = real_target.fidelity("held.zarr", Path("m"), "ck", 8)
    assert seen == {"online": True, "limit": 8, "model": "m"}
    assert check.pop("seconds") >= 0
    assert check == {"prompts": 8, "same_text": 7, "same_taus": 8, "taus_differ": [],
                     "same_tree_taus": {"16": 8, "32": 6}}


class Stopped(Exception):
    pass


def test_extract_seconds_add_up_over_sittings_and_restart_with_the_store(monkeypatch, tmp_path):
    clock = iter([0.0, 5.0, 10.0, 13.0, 20.0, 22.0])
    monkeypatch.setattr(real_target.time, "perf_counter", lambda: next(clock))
    store, ledger = tmp_path / "train.zarr", tmp_path / "extract_seconds.json"

    def stopped(model, data, out, cfg):
        store.mkdir(exist_ok=True)
        raise Stopped  # a sitting killed mid-store

    monkeypatch.setattr(real_target, "extract_in_ranks", stopped)
    with pytest.raises(Stopped):
        real_target.extract(tmp_path / "m", "d.jsonl", str(store), PRESETS["quick"], ledger)
    monkeypatch.setattr(real_target, "extract_in_ranks", lambda *args: None)
    assert real_target.extract(tmp_path / "m", "d.jsonl", str(store), PRESETS["quick"],
                               ledger) == 5.0 + 3.0
    store.rmdir()  # deleted to be redone: its old seconds no longer describe it
    assert real_target.extract(tmp_path / "m", "d.jsonl", str(store), PRESETS["quick"],
                               ledger) == 2.0


@pytest.mark.parametrize("rows, world", [(3936, 2), (492, 2), (128, 2), (16, 2), (8, 4),
                                         (3, 4), (1, 2), (100, 1)])
def test_every_rank_gets_parts_and_parts_stay_bounded(rows, world):
    per_part = real_target.rows_per_part(rows, world)
    parts = -(-rows // per_part)
    assert 1 <= per_part <= real_target.EXTRACT_ROWS_PER_PART
    assert parts >= min(rows, world)  # no rank idles while another holds two parts' worth
    if rows <= world * real_target.EXTRACT_ROWS_PER_PART:
        assert parts <= world  # a small store: one part a rank at most, not many tiny ones


def test_a_store_begun_before_keeps_its_part_size_whatever_the_cores(tmp_path):
    from dflash_train.store_schema import create_store
    from tests.store_factory import store_meta

    url = str(tmp_path / "held_out.zarr")
    assert real_target.recorded_rows_per_part(url) is None  # nothing there yet: the rule's
    create_store(url, store_meta(extra={"rows_per_part": 256}), shard_tokens=64)
    assert real_target.recorded_rows_per_part(url) == 256  # a resume plans the same parts
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "zarr.json").write_text("{}")  # not a store of ours: extract says so
    assert real_target.recorded_rows_per_part(str(tmp_path / "other")) is None


def _main(monkeypatch, *args: str) -> str:
    """real_target.main's exit line for `args`; nothing may have started running."""
    monkeypatch.setattr(sys, "argv", ["real_target.py", "--quick", *args])
    monkeypatch.setattr(real_target, "run", lambda *a: pytest.fail("ran despite bad paths"))
    with pytest.raises(SystemExit) as exit_:
        real_target.main()
    assert isinstance(exit_.value.code, str), exit_.value.code
    return exit_.value.code


@pytest.mark.parametrize("flag", ["--out", "--cache"])
@pytest.mark.parametrize("where", ["notes.txt", "notes.txt/sub"])
def test_out_or_cache_on_a_file_is_one_line_naming_it(tmp_path, monkeypatch, flag, where):
    (tmp_path / "notes.txt").write_text("mine\n")
    other = "--cache" if flag == "--out" else "--out"
    path = tmp_path / where
    said = _main(monkeypatch, flag, str(path), other, str(tmp_path / "fine"))
    assert said == (f"{flag} {path}: {tmp_path / 'notes.txt'} is a file, not a directory; "
                    f"choose another {flag}")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("flag", ["--out", "--cache"])
def test_out_or_cache_on_a_read_only_disk_is_one_line_naming_it(tmp_path, monkeypatch, flag):
    """Root writes through chmod: the read-only disk is stood in for by its EROFS."""
    import errno
    import os
    import tempfile

    path = tmp_path / "ro"

    def refuse(*args, dir=None, **kwargs):
        if Path(dir) == path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kwargs)

    real = tempfile.TemporaryFile
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    other = "--cache" if flag == "--out" else "--out"
    said = _main(monkeypatch, flag, str(path), other, str(tmp_path / "fine"))
    assert said == (f"{flag} {path}: cannot write there (Read-only file system); choose "
                    f"another {flag}")


def test_results_name_checkpoints_relative_to_the_out_directory(tmp_path):
    # results.json is committed to docs/: it must not carry the machine's own paths
    out = tmp_path / "work"
    checkpoint = out / "run_1L" / "checkpoints" / "step_00000400"
    assert relative_to_out(checkpoint, out) == "run_1L/checkpoints/step_00000400"
