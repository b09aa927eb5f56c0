"""The real-target benchmark's presets build train configs the trainer accepts."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

# The benchmarks are scripts: they import their siblings by bare name (`from report import`).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from benchmarks.real_target import PRESETS, recipe, train_config  # noqa: E402


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_a_train_config_the_trainer_accepts(preset, tmp_path):
    cfg = PRESETS[preset]
    tc = train_config(cfg, "store.zarr", tmp_path / "run", cfg.drafter_layers[0])
    assert tc.loss.position_weights == cfg.position_weights
    assert tc.model.draft_vocab_size == cfg.draft_vocab_size
    assert tc.optim.optimizer == cfg.optimizer


def test_gamma_reaches_the_loss_only_under_decay(tmp_path):
    cfg = replace(PRESETS["full"], position_weights="decay", gamma=4.0)
    assert train_config(cfg, "s.zarr", tmp_path, 1).loss.gamma == 4.0
    assert "decay gamma 4.0" in recipe({"gamma": 4.0})  # a run from before the field


def test_recipe_names_what_a_run_trained_with():
    text = recipe({"gamma": 4.0, "optimizer": "muon", "position_weights": "dpace",
                   "draft_vocab_size": 4096})
    assert text == "muon, dpace, draft vocabulary 4096"
