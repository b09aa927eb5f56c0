"""`dflash eval RUN` and `dflash export RUN`: a training run directory stands for the
checkpoint its best.json names (the best on validation), else for its newest one; a step
named (RUN/checkpoints/step_N) is taken as named."""

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import load_drafter
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.run_layout import BEST, checkpoint_dir
from dflash_train.train.config import load_train_config
from dflash_train.train.loop import train
from tests.train.conftest import build_store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("store") / "hs.zarr")
    build_store(url)
    return url


@pytest.fixture(scope="module")
def run(store, tmp_path_factory):
    """A run with checkpoints at steps 2, 4 and 5, none marked best."""
    out = tmp_path_factory.mktemp("run") / "run"
    train(load_train_config(None, {"stores": [store], "run.out_dir": str(out),
                                   "model.num_hidden_layers": 1, "loader.batch_tokens": 256,
                                   "optim.max_steps": 5, "run.checkpoint_every": 2,
                                   "run.keep_checkpoints": 0, "run.progress": False,
                                   "loader.prefetch_batches": 0, "run.precision": "fp32"}))
    return out


def _evaluated(store: str, given: str) -> dict:
    cfg = EvalConfig(store=store, checkpoints=[given], limit=2, progress=False,
                     settings=EvalSettings(tree_budgets=()))
    (column,) = run_eval(cfg, echo=lambda _: None).report["checkpoints"]
    return column


def test_a_run_directory_without_a_marker_is_its_newest_checkpoint(store, run, tmp_path):
    column = _evaluated(store, str(run))
    assert column["name"] == "run/step_00000005"
    assert column["path"] == str(checkpoint_dir(run, 5))
    out = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "out")])
    assert out.exit_code == 0, out.output
    assert f"exporting its newest checkpoint (the run has no validation: no {BEST})" \
        in out.output
    assert f"exported {checkpoint_dir(run, 5)} ->" in out.output


def test_a_marked_best_checkpoint_is_taken_unless_a_step_is_named(store, run, tmp_path):
    (run / BEST).write_text(json.dumps({"step": 4, "figure": "tree_tau@16", "value": 2.5}))
    try:
        assert _evaluated(store, str(run))["path"] == str(checkpoint_dir(run, 4))
        assert _evaluated(store, str(checkpoint_dir(run, 2)))["path"] == \
            str(checkpoint_dir(run, 2))
        out = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "out"),
                                        "--dtype", "keep"])
        assert out.exit_code == 0, out.output
        assert "its best checkpoint (tree_tau@16 2.5000 on validation)" in out.output
        got = load_drafter(tmp_path / "out").state_dict()
        for name, want in load_drafter(checkpoint_dir(run, 4)).state_dict().items():
            assert torch.equal(got[name], want), name
    finally:
        (run / BEST).unlink()


@pytest.mark.parametrize(("marker", "problem"), [
    ({"step": 3, "figure": "tau", "value": 2.0}, "names step 3, but"),
    ({"step": "four"}, "is unreadable"),
])
def test_a_marker_naming_no_checkpoint_is_refused_in_one_line(store, run, marker, problem):
    (run / BEST).write_text(json.dumps(marker))
    try:
        with pytest.raises(EvalError, match=problem) as e:
            _evaluated(store, str(run))
        assert "\n" not in str(e.value) and "name a checkpoint" in str(e.value)
    finally:
        (run / BEST).unlink()
