"""benchmarks/gamma_ddtree.py: each arm trains with its preset's recipe, only its position
weighting, gamma, steps and seed changed; the table averages seeds per arm."""

from dataclasses import replace

import pytest

import benchmarks.gamma_ddtree as bench
from benchmarks.real_target import PRESETS


@pytest.mark.parametrize("preset", ["long", "full"])
def test_an_arm_trains_with_its_presets_recipe_and_its_own_weighting(preset, monkeypatch,
                                                                      tmp_path):
    seen = []
    monkeypatch.setattr(bench, "train_drafter",
                        lambda cfg, store, out, layers: seen.append((cfg, store, out, layers)))
    bench.train_arm(tmp_path, tmp_path / "out", "decay gamma 7", 1, 123, preset)
    cfg, store, out, layers = seen[0]
    assert cfg == replace(PRESETS[preset], steps=123, eval_every=123,
                          position_weights="decay", gamma=7.0, seed=1)
    assert (store, out, layers) == (str(tmp_path / "train.zarr"),
                                    tmp_path / "out" / "decay_gamma_7_seed1", 1)


def test_the_table_averages_each_arms_seeds():
    walks = ["chain", "tree@16", "tree@32", "tree@64"]

    def run(arm, seed, base):
        return {"arm": arm, "seed": seed,
                "walks": {w: (base + i, (base + i - 0.1, base + i + 0.1), 10)
                          for i, w in enumerate(walks)}}

    results = {"steps": 5, "held_out": "h", "date": "d",
               "runs": [run("D-PACE", 0, 1.0), run("D-PACE", 1, 2.0)]}
    table = bench.markdown(results)
    assert "| D-PACE | 1.500 | 2.500 | 3.500 | 4.500 | 3.000 |" in table
    assert "decay gamma 4 |" not in table.split("mean over seeds")[1]
