"""benchmarks/final_norm_init.py on a tiny store: both inits trained on the same store from
the same weights, their first losses and every drafter's held-out tau reported."""

import math
from dataclasses import replace

import pytest

import benchmarks.final_norm_init as bench
from benchmarks.real_target import PRESETS
from tests.train.conftest import VOCAB, build_store, smollm2_like_rows

TINY = replace(PRESETS["quick"], steps=4, eval_every=2, draft_vocab_size=None,
               batch_tokens=256, anchors_per_seq=8)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("final_norm_init")
    store = str(tmp / "hs.zarr")
    build_store(store, rows=8, tied_embedding=smollm2_like_rows())
    return bench.compare(TINY, {"train": store, "held_out": store}, tmp / "out")


def test_both_inits_train_on_the_same_store_and_report_the_same_steps(results):
    inits = results["inits"]
    assert list(inits) == ["ones", "unit"]
    for r in inits.values():
        assert list(r["loss"]) == ["1", "4"]  # 10 and 50 lie past a 4-step run
        assert list(r["held_out"]) == ["0", "2", "4"]
        for t in r["held_out"].values():
            low, high = t["tau_ci95"]
            assert 1.0 <= low <= t["tau"] <= high
    assert results["ln_v"] == pytest.approx(math.log(VOCAB))


def test_the_new_init_starts_near_ln_v_where_hf_init_starts_above_it(results):
    ones, unit = (results["inits"][i]["loss"]["1"] for i in ("ones", "unit"))
    assert abs(unit - results["ln_v"]) < 1.0
    assert ones > unit + 1.0


def test_the_two_untrained_drafters_draft_the_same(results):
    # one weight set, the final norm scaled: every argmax, so every acceptance, agrees
    ones, unit = (results["inits"][i]["held_out"]["0"] for i in ("ones", "unit"))
    assert ones == unit


def test_the_table_shows_every_figure_of_both_inits(results):
    table = bench.markdown(results)
    for init, r in results["inits"].items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {init} |"))
        assert f"{r['loss']['1']:.2f}" in row
        assert f"{r['held_out']['4']['tau']:.3f}" in row
    assert "loss @1 | loss @4 | held-out tau @0 (95 % CI)" in table
