"""A run that diverges or collapses stops with one line naming the step, and nothing
non-finite is ever written: the latest checkpoint stays the last finite one, and every
writer of weights (checkpoint save, drafter save, export) refuses NaN/Inf through one check.
Settings that cannot train a drafter (--lr, --noise-std out of range, NaN) are refused
before anything runs."""

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dflash_train.cli import main
from dflash_train.drafter import DFlashDrafter, DrafterError, load_drafter, save_drafter
from dflash_train.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME, config_to_dict
from dflash_train.store_schema import open_store
from dflash_train.train import loop
from dflash_train.train.checkpoint import (
    CheckpointContents,
    TrainState,
    checkpoint_dir,
    complete_checkpoints,
    save_checkpoint,
)
from dflash_train.train.config import TrainConfig, to_toml
from dflash_train.train.drafter_shape import drafter_config
from tests.train.conftest import VOCAB, build_store

ARGS = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
        "--set", "loader.prefetch_batches=0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("divergence") / "hs.zarr")
    build_store(url)
    return url


def _train(store: str, out: Path, *extra: str):
    return CliRunner().invoke(main, ["train", "--store", store, "--out", str(out), *ARGS,
                                     *extra])


def _all_finite(path: Path) -> bool:
    weights = load_drafter(path).state_dict()  # load itself refuses non-finite weights
    blob = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    moments = [t for s in blob["optimizer"]["state"].values() for t in s.values()]
    return all(torch.isfinite(t).all() for t in [*weights.values(), *moments])


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("Error:")]
    return line


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(
        store, tmp_path, monkeypatch, bad):
    real, calls = loop.block_loss, []

    def diverging(*args, **kwargs):  # the 3rd step's loss (and so its gradient) goes bad
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * bad if len(calls) == 3 else loss

    monkeypatch.setattr(loop, "block_loss", diverging)
    run = tmp_path / "run"
    result = _train(store, run, "--max-steps", "5", "--set", "run.checkpoint_every=2")
    line = _one_line_error(result)
    assert "step 3:" in line and "non-finite" in line, line
    assert str(checkpoint_dir(run, 2)) in line  # the checkpoint it leaves as the latest
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert all(_all_finite(p) for p in complete_checkpoints(run))


@pytest.mark.parametrize("flags, named", [
    (["--noise-std", "1e39"], "--noise-std (noise.std)"),
    (["--noise-std", "nan"], "--noise-std (noise.std)"),
    (["--noise-std", "11"], "--noise-std (noise.std)"),
    (["--noise-std", "0.1", "--set", "noise.std_end=inf", "--set", "noise.schedule_steps=5"],
     "noise.std_end"),
    (["--noise-std", "1e39", "--set", "noise.absolute=true"], "--noise-std (noise.std)"),
    (["--lr", "1e6"], "--lr (optim.lr)"),
    (["--lr", "1"], "--lr (optim.lr)"),
])
def test_settings_that_cannot_train_are_refused_before_anything_runs(store, tmp_path, flags,
                                                                     named):
    run = tmp_path / "run"
    line = _one_line_error(_train(store, run, "--max-steps", "2", *flags))
    assert named in line and "must be" in line, line
    assert not run.exists()


def _dead_drafter(store: str, path: Path) -> str:
    """A drafter whose weights are +-3000, as `--lr 1e3` left them before the bound: its
    activations overflow the RMS norms, which then output 0, so its logits are uniform
    (loss ln V) and no weight receives any gradient."""
    model = _tiny_model(store)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).sign() * 3000)
    return str(save_drafter(model, path))


def test_a_collapsed_run_stops_naming_its_steps_and_the_uniform_loss(store, tmp_path):
    dead = _dead_drafter(store, tmp_path / "dead")
    run = tmp_path / "run"
    result = _train(store, run, "--max-steps", "12", "--set", f"model.init_from={dead}")
    line = _one_line_error(result)
    assert "gradient norm is exactly 0" in line and "collapsed" in line, line
    assert f"ln V = {math.log(VOCAB):.4f}" in line and "--lr" in line
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert len(records) < 12  # stopped before the end
    assert all(r["grad_norm"] == 0 for r in records)
    assert records[-1]["loss"] == pytest.approx(math.log(VOCAB), abs=1e-3)


def _nan_state(model: DFlashDrafter) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["fc.weight"][0, 0] = float("nan")
    return state


def _tiny_model(store: str) -> DFlashDrafter:
    cfg = TrainConfig(stores=[store])
    cfg.model.num_hidden_layers = 1
    return DFlashDrafter(drafter_config(cfg, open_store(store)))


def test_every_writer_refuses_non_finite_weights_and_writes_nothing(store, tmp_path):
    model = _tiny_model(store)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run = tmp_path / "run"
    meta = open_store(store).meta
    with pytest.raises(DrafterError, match=r"fc\.weight.*NaN or Inf"):
        save_checkpoint(run, CheckpointContents(
            model, _nan_state(model), optimizer.state_dict(), scheduler, TrainState(step=3),
            meta, to_toml(TrainConfig(stores=[store]))))
    moments = {"state": {0: {"exp_avg": torch.tensor([1.0, float("inf")])}},
               "param_groups": optimizer.state_dict()["param_groups"]}
    with pytest.raises(DrafterError, match=r"optimizer.*exp_avg.*NaN or Inf"):
        save_checkpoint(run, CheckpointContents(
            model, model.state_dict(), moments, scheduler, TrainState(step=3), meta,
            to_toml(TrainConfig(stores=[store]))))
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    with pytest.raises(DrafterError, match=r"fc\.weight.*NaN or Inf"):
        save_drafter(model, tmp_path / "drafter", state_dict=_nan_state(model))
    assert not (tmp_path / "drafter").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_non_finite_drafter_from_elsewhere_is_refused_by_export_and_eval(store, tmp_path):
    # Weights written by something else (or by a version before this check): export, eval
    # and a resume's load refuse them, naming the tensor, instead of serving NaN.
    model = _tiny_model(store)
    bad = tmp_path / "nan-drafter"
    bad.mkdir()
    (bad / CONFIG_NAME).write_text(json.dumps(config_to_dict(model.config, torch.float32)))
    save_file(_nan_state(model), str(bad / WEIGHTS_NAME))
    out = CliRunner().invoke(main, ["export", str(bad), str(tmp_path / "serve")])
    line = _one_line_error(out)
    assert "fc.weight" in line and "NaN or Inf" in line and str(bad) in line, line
    assert not (tmp_path / "serve").exists()
    ev = CliRunner().invoke(main, ["eval", "--store", store, "--limit", "2", str(bad)])
    assert ev.exit_code != 0 and "fc.weight" in ev.output and "NaN or Inf" in ev.output
