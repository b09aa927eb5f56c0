"""A run stopped at a checkpoint and resumed logs and ends exactly as the uninterrupted run:
every step's record (its wall-clock fields aside) and every final weight, bit for bit.

test_loop.test_killed_run_resumes_to_the_same_weights proves the weights for a process
killed mid-run; this proves the log lines too, for both drafter kinds."""

import json
import shutil

import pytest
import torch

from dflash_train.drafter import load_drafter
from dflash_train.drafter.config import DRAFTER_KINDS
from dflash_train.train.checkpoint import checkpoint_dir, complete_checkpoints, latest_checkpoint
from dflash_train.train.config import load_train_config
from dflash_train.train.loop import train

WALL_CLOCK = ("data_wait_s", "step_s", "tokens_per_s")
KINDS = {"dflash": {}, "dflash2": {"model.kind": "dflash2", "model.selector_rank": 8,
                                   "model.selector_top_k": 4}}


def _train(store, out, resume=False, **extra):
    settings = {"stores": [store], "run.out_dir": str(out), "model.num_hidden_layers": 1,
                "loader.batch_tokens": 256, "run.anchors_per_seq": 8, "optim.epochs": 2,
                "run.progress": False, "run.log_every": 1, "run.checkpoint_every": 3,
                "run.keep_checkpoints": 0, "loader.prefetch_batches": 0, **extra}
    return train(load_train_config(None, settings), resume=resume, echo=lambda _: None)


def _records(run_dir) -> dict[int, dict]:
    """The last record of each step (a resume appends the steps it trains again)."""
    lines = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k not in WALL_CLOCK} for r in lines}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_run_resumed_from_a_checkpoint_logs_and_ends_as_the_uninterrupted_one(
        synthetic_store, tmp_path, kind):
    whole = _train(synthetic_store, tmp_path / "whole", **KINDS[kind])
    stopped = tmp_path / "stopped"
    shutil.copytree(tmp_path / "whole", stopped)
    for later in complete_checkpoints(stopped):
        if later != checkpoint_dir(stopped, 3):
            shutil.rmtree(later)
    resumed = _train(synthetic_store, stopped, resume=True, **KINDS[kind])
    assert resumed.steps == whole.steps > 3
    assert _records(stopped) == _records(tmp_path / "whole")
    assert len((stopped / "log.jsonl").read_text().splitlines()) == 2 * whole.steps - 3
    a = load_drafter(latest_checkpoint(tmp_path / "whole"), kinds=DRAFTER_KINDS).state_dict()
    b = load_drafter(latest_checkpoint(stopped), kinds=DRAFTER_KINDS).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
