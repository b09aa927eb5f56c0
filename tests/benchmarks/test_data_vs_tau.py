"""The data-vs-tau benchmark keeps exactly the first prompts' answers, reads the recipe a run
recorded, and prices extraction pro rata by tokens."""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.data_vs_tau import first_answers, fractions_arg, markdown, preset_of
from benchmarks.real_target import PRESETS
from dflash_train.store_schema import open_store
from tests.train.conftest import build_store


def test_a_fraction_keeps_the_answers_to_the_first_prompts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    build_store(str(run / "train.zarr"), rows=10).write_files("tokenizer", {"t.json": b"{}"})
    (run / "train.jsonl").write_text("{}\n" * 10)
    url = first_answers(run, 0.3, tmp_path)
    source = {s.source_row: s for p in open_store(str(run / "train.zarr")).parts()
              for s in p.iter_samples()}
    kept = [s for p in open_store(url).parts() for s in p.iter_samples()]
    assert sorted(s.source_row for s in kept) == [0, 1, 2]
    for s in kept:
        assert s.input_ids.tolist() == source[s.source_row].input_ids.tolist()
    made = (Path(url) / "zarr.json").stat().st_mtime_ns
    assert first_answers(run, 0.3, tmp_path) == url
    assert (Path(url) / "zarr.json").stat().st_mtime_ns == made  # made once
    assert first_answers(run, 1, tmp_path) == str(run / "train.zarr")
    with pytest.raises(SystemExit, match="keeps none"):
        first_answers(run, 0.01, tmp_path)


def test_the_recipe_is_the_one_the_run_recorded(tmp_path):
    recorded = {**asdict(PRESETS["long"]), "steps": 77, "a_field_since_removed": 0}
    (tmp_path / "results.json").write_text(json.dumps({"config": recorded}))
    cfg = preset_of(tmp_path)
    assert cfg.steps == 77 and cfg.drafter_layers == PRESETS["long"].drafter_layers


def test_extract_seconds_are_shared_by_tokens():
    tau = {"tau": 1.5, "tau_ci95": [1.4, 1.6]}
    points = [{"answers": a, "tokens": t, "train_seconds": 10.0, "chosen_step": 5,
               "held_out": tau, "last": tau} for a, t in [(5, 250), (10, 1000)]]
    rows = markdown(points, 400.0, 2000, PRESETS["long"]).splitlines()[-2:]
    assert rows[0].startswith("| 5 | 250 | 50 | 10 | 5 | 1.500 (1.400-1.600)")
    assert rows[1].startswith("| 10 | 1,000 | 200 |")


@pytest.mark.parametrize("text", ["0,1", "0.5,1.5", "a", ""])
def test_fractions_outside_0_1_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        fractions_arg(text)
