"""benchmarks/peer/runner.py: our side of the side-by-side run really trains with the pinned
settings and is measured; speculators' flags leave it one validation sample (no speculators
needed: its split rule, int(len * ratio), is applied here)."""

import json
import tomllib
from pathlib import Path

import pytest

from benchmarks.peer.compare import steps_filling
from benchmarks.peer.runner import Measured, PeerSettings, run_ours, speculators_flags
from tests.train.conftest import build_store


@pytest.fixture(scope="module")
def synthetic_store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("peer-runner") / "hs.zarr")
    build_store(url, rows=8, parts=1)
    return url


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_our_run_takes_the_pinned_settings_and_is_measured(synthetic_store, tmp_path):
    s = PeerSettings(steps=3, lr=1e-3, anchors_per_seq=4, batch_tokens=256, gamma=7.0,
                     precision="fp32", threads=1)
    measured = run_ours(synthetic_store, tmp_path, s)
    log = [json.loads(x) for x in (tmp_path / "ours-run/log.jsonl").read_text().splitlines()]
    assert measured.steps == len(log) == 3
    assert measured.train_tokens == sum(r["tokens"] for r in log) > 0
    assert measured.peak_rss_mib > 50 and measured.tokens_per_s > 0
    assert Path(measured.checkpoint, "drafter", "config.json").is_file()
    config = tomllib.loads((tmp_path / "ours-run/config.toml").read_text())
    assert config["optim"]["betas"] == [0.9, 0.999] and config["optim"]["lr"] == 1e-3
    assert config["loss"]["gamma"] == 7.0 and config["noise"]["kind"] == "none"
    assert config["run"]["anchors_per_seq"] == 4 and config["run"]["precision"] == "fp32"
    assert config["model"]["num_hidden_layers"] == 1


def test_speculators_trains_on_all_samples_but_one_and_gets_the_same_anchors_per_sample():
    s = PeerSettings(steps=50, anchors_per_seq=16, batch_tokens=2048, layers=3)
    for samples in (2, 7, 32, 1000, 123457):
        flags = speculators_flags("data", "save", "target", [2, 3], 5, samples, 200.0, s)
        ratio = float(_flag(flags, "--train-data-ratio"))
        assert 0 < ratio < 1 and int(samples * ratio) == samples - 1
    assert _flag(flags, "--max-anchors") == str(round(16 * 2048 / 200))
    assert flags[flags.index("--full-attention-indices") + 1:][:3] == ["0", "1", "2"]
    assert _flag(flags, "--optimizer") == "adamw" and _flag(flags, "--loss-fn") == "ce"


def test_our_run_takes_muon_dpace_and_a_draft_vocabulary(synthetic_store, tmp_path):
    s = PeerSettings(steps=2, batch_tokens=256, anchors_per_seq=4, precision="fp32",
                     optimizer="muon", position_weights="dpace", draft_vocab_size=16,
                     threads=1)
    run_ours(synthetic_store, tmp_path, s)
    config = tomllib.loads((tmp_path / "ours-run/config.toml").read_text())
    assert config["optim"]["optimizer"] == "muon"
    assert config["loss"]["position_weights"] == "dpace" and config["loss"]["gamma"] == 10.0
    assert config["model"]["draft_vocab_size"] == 16


def test_speculators_gets_the_same_optimizer_and_slot_weights():
    def flags(**kw) -> list[str]:
        return speculators_flags("data", "save", "target", [2], 5, 10, 100.0,
                                 PeerSettings(weight_decay=0.02, **kw))

    decay = flags(gamma=4.0)
    assert _flag(decay, "--per-position-loss-weight") == "fixed-exp-decay"
    assert float(_flag(decay, "--dflash-decay-gamma")) == 4.0
    assert "--muon-weight-decay" not in decay
    recipe = flags(optimizer="muon", position_weights="dpace")
    assert _flag(recipe, "--per-position-loss-weight") == "dpace"
    assert "--dflash-decay-gamma" not in recipe
    assert _flag(recipe, "--optimizer") == "muon"
    # its Muon group has its own weight decay (default 0.1): pinned to ours, which has one
    assert float(_flag(recipe, "--muon-weight-decay")) == 0.02
    assert _flag(recipe, "--muon-adjust-lr-fn") == "match_rms_adamw"


def test_a_gamma_that_would_not_act_is_refused():
    with pytest.raises(ValueError, match="position_weights"):
        PeerSettings(gamma=4.0, position_weights="dpace")


def test_equal_time_steps_fill_the_seconds_at_the_calibrated_rate():
    def calibrated(steps: int, seconds: float) -> Measured:
        return Measured("x", steps, 0, seconds, 0.0, 0.0, "")

    assert steps_filling(600.0, calibrated(10, 20.0)) == 300
    assert steps_filling(600.0, calibrated(10, 3.0)) == 2000
    assert steps_filling(1.0, calibrated(10, 100.0)) == 1  # never zero steps
