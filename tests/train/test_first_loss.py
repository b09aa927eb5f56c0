"""A new drafter's first training loss starts near ln V (model.final_norm_init unit) on a
target with tied embeddings whose rows share one direction, as a real target's do; HF's init
(ones) starts it far above."""

import math

import pytest

from dflash_train.train.config import load_train_config
from dflash_train.train.log_summary import read_log
from dflash_train.train.loop import train
from tests.train.conftest import VOCAB, build_store, smollm2_like_rows


@pytest.fixture(scope="module")
def tied_store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("tied") / "hs.zarr")
    build_store(url, tied_embedding=smollm2_like_rows())
    return url


def first_step(store: str, out, **settings):
    """The step-1 record of a 1-step run with these `settings`: its loss is the new
    drafter's (the forward runs before the update)."""
    cfg = load_train_config(None, {"stores": [store], "run.out_dir": str(out),
                                   "model.num_hidden_layers": 1, **settings,
                                   "optim.max_steps": 1, "loader.batch_tokens": 512,
                                   "run.progress": False, "loader.prefetch_batches": 0,
                                   "run.precision": "fp32"})
    train(cfg, echo=lambda _: None)
    (record,) = read_log(out)
    return record


def test_a_new_drafters_first_loss_is_near_ln_v_and_hf_init_was_far_above(tied_store, tmp_path):
    unit = first_step(tied_store, tmp_path / "default")
    ones = first_step(tied_store, tmp_path / "ones", **{"model.final_norm_init": "ones"})
    ln_v = math.log(VOCAB)
    # HF's init puts the logits at sqrt(hidden) times the row geometry: ~4 nats above ln V
    # at this width (32), 50-70 on SmolLM2 (576)
    assert abs(unit.loss - ln_v) < 1.0, unit.loss
    assert ones.loss > ln_v + 3, ones.loss
