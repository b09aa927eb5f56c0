"""The data-vs-tau benchmark keeps exactly the first prompts' answers (extracting only those
where no full run exists), reads the recipe a run recorded, and prices extraction pro rata
by tokens."""

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from benchmarks import real_target
from benchmarks.data_vs_tau import first_answers, fractions_arg, markdown, preset_of
from benchmarks.real_target import PRESETS
from dflash_train.store_schema import open_store
from tests.train.conftest import build_store


def test_a_fraction_keeps_the_answers_to_the_first_prompts(tmp_path):
    src = str(tmp_path / "train.zarr")
    build_store(src, rows=10).write_files("tokenizer", {"t.json": b"{}"})
    url = first_answers(src, 10, 3, tmp_path)
    source = {s.source_row: s for p in open_store(src).parts() for s in p.iter_samples()}
    kept = [s for p in open_store(url).parts() for s in p.iter_samples()]
    assert sorted(s.source_row for s in kept) == [0, 1, 2]
    for s in kept:
        assert s.input_ids.tolist() == source[s.source_row].input_ids.tolist()
    made = (Path(url) / "zarr.json").stat().st_mtime_ns
    assert first_answers(src, 10, 3, tmp_path) == url
    assert (Path(url) / "zarr.json").stat().st_mtime_ns == made  # made once
    assert first_answers(src, 10, 10, tmp_path) == src  # all it holds: itself, no copy


def _extracted(monkeypatch, tmp_path, share: float) -> tuple[dict, dict]:
    """extract_stores on 20 drawn train prompts (4 of them validation) and 2 held out, the
    extraction itself replaced: ({store name: url}, {url: the prompts it was given})."""
    given = {}

    def extract(model, data, out, cfg, ledger):
        given[out] = [json.loads(line)["messages"][0]["content"]
                      for line in Path(data).read_text().splitlines()]
        return 1.0

    monkeypatch.setattr(real_target, "first_turn_prompts",
                        lambda sharegpt, cfg: ([f"t{i}" for i in range(20)], ["h0", "h1"]))
    monkeypatch.setattr(real_target, "extract", extract)
    cfg = replace(PRESETS["long"], val_prompts=4)
    tmp_path.mkdir()
    stores, _ = real_target.extract_stores(cfg, tmp_path, tmp_path / "m", tmp_path / "s", share)
    return stores, given


def test_a_run_never_extracted_in_full_extracts_only_the_first_answers(monkeypatch, tmp_path):
    whole, given_whole = _extracted(monkeypatch, tmp_path / "whole", 1.0)
    part, given_part = _extracted(monkeypatch, tmp_path / "part", 0.25)
    assert whole == {name: str(tmp_path / "whole" / f"{name}.zarr")
                     for name in ("train", "held_out", "validation")}
    assert given_whole[whole["train"]] == [f"t{i}" for i in range(16)]
    assert part["train"] == str(tmp_path / "part" / "train_first_4.zarr")
    assert given_part[part["train"]] == ["t0", "t1", "t2", "t3"]
    # the same validation and held-out prompts as the full run, and every train prompt listed
    for name in ("validation", "held_out"):
        assert given_part[part[name]] == given_whole[whole[name]]
    assert given_part[part["validation"]] == ["t16", "t17", "t18", "t19"]
    listed = (tmp_path / "part" / "train.jsonl").read_text().splitlines()
    assert [json.loads(row)["messages"][0]["content"] for row in listed] == \
        [f"t{i}" for i in range(16)]
    with pytest.raises(SystemExit, match="keeps none"):
        _extracted(monkeypatch, tmp_path / "none", 0.01)


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


def _stages_faked(monkeypatch) -> dict:
    """extract builds a synthetic store of the rows it is given (104 drawn train prompts: 40
    train, 64 validation), training is skipped: {training folder: (train store, its rows)}."""
    from benchmarks import data_vs_tau

    def extract(model, data, out, cfg, ledger):
        if not Path(out).exists():  # as extract continues a finished store: nothing to do
            build_store(out, rows=len(Path(data).read_text().splitlines()), parts=1) \
                .write_files("tokenizer", {"t.json": b"{}"})
        return 8.0

    trained = {}

    def point(cfg, stores, train, where):
        rows = sorted(s.source_row for p in open_store(train).parts() for s in p.iter_samples())
        trained[where.name] = (train, rows)
        tau = {"tau": 1.5, "tau_ci95": [1.4, 1.6]}
        return {"answers": len(rows), "tokens": open_store(train).num_tokens,
                "train_seconds": 1.0, "chosen_step": 5, "held_out": tau, "last": tau}

    monkeypatch.setattr(real_target, "first_turn_prompts",
                        lambda sharegpt, cfg: ([f"t{i}" for i in range(104)], ["h0", "h1"]))
    monkeypatch.setattr(real_target, "extract", extract)
    monkeypatch.setattr(data_vs_tau, "prepare", lambda cache: (cache / "m", cache / "s"))
    monkeypatch.setattr(data_vs_tau, "point", point)
    return trained


def _main(monkeypatch, run: Path, fractions: str) -> None:
    from benchmarks import data_vs_tau

    monkeypatch.setattr("sys.argv", ["data_vs_tau", str(run), "--fractions", fractions,
                                     "--cache", str(run.parent / "cache")])
    data_vs_tau.main()


def test_without_a_finished_run_the_largest_fraction_trains_on_the_extracted_answers(
        monkeypatch, tmp_path):
    """40 train prompts, fractions 1/8 and 1/4: only the first 10 answers are extracted; the
    1/4 point trains on that store itself, the 1/8 point on a copy of its first 5 rows."""
    trained, run = _stages_faked(monkeypatch), tmp_path / "run"
    _main(monkeypatch, run, "0.125,0.25")
    assert trained["f0.25"] == (str(run / "train_first_10.zarr"), list(range(10)))
    assert trained["f0.125"][1] == list(range(5))
    assert not (run / "train.zarr").exists()
    table = (run / "data_vs_tau_train_first_10" / "results.md").read_text().splitlines()[-2:]
    assert [row.split(" | ")[0] for row in table] == ["| 5", "| 10"]
    with pytest.raises(SystemExit, match="--fractions 0.0001 of 3936 train prompts keeps none"):
        _main(monkeypatch, tmp_path / "other", "0.0001,0.25")
    assert not (tmp_path / "other" / "held_out.zarr").exists()  # refused before extracting


def test_a_finished_run_gives_its_stores_its_extract_seconds_and_its_own_drafter(
        monkeypatch, tmp_path):
    trained, run = _stages_faked(monkeypatch), tmp_path / "run"
    run.mkdir()
    build_store(str(run / "train.zarr"), rows=10).write_files("tokenizer", {"t.json": b"{}"})
    (run / "train.jsonl").write_text("{}\n" * 10)
    (run / "held_out.zarr").mkdir()
    (run / "results.json").write_text(json.dumps({"config": asdict(PRESETS["long"]),
                                                  "seconds": {"extract_train": 400.0}}))
    with pytest.raises(SystemExit, match="without a validation store"):
        _main(monkeypatch, run, "0.5,1")
    (run / "validation.zarr").mkdir()
    _main(monkeypatch, run, "0.5,1")
    assert trained["run"] == (str(run / "train.zarr"), list(range(10)))  # f = 1: the run's own
    assert trained["f0.5"] == (str(run / "data_vs_tau" / "train_first_5.zarr"), list(range(5)))
    half, whole = (open_store(trained[k][0]).num_tokens for k in ("f0.5", "run"))
    table = (run / "data_vs_tau" / "results.md").read_text().splitlines()[-2:]
    assert [row.split(" | ")[2] for row in table] == [f"{400 * half / whole:,.0f}", "400"]
    with pytest.raises(SystemExit, match="--fractions 0.01 of 10 train prompts keeps none"):
        _main(monkeypatch, run, "0.01,1")
