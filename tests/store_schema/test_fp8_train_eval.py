"""Train and eval read an fp8 store through the store's own reader: a drafter trained on it
follows the run on the full-precision store, and eval scores a checkpoint alike on both."""

import json

import pytest
from click.testing import CliRunner

from dflash_train.evaluate.command import eval_command
from dflash_train.store_schema import open_store
from dflash_train.store_schema.layout import FP8_CONTEXT
from dflash_train.store_schema.stats import store_stats
from dflash_train.store_schema.subset import copy_store
from dflash_train.train.config import load_train_config
from dflash_train.train.loop import train
from tests.train.conftest import build_store


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(float32 store, its fp8 copy) for train and for held-out."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, rows, parts in (("train", 24, 2), ("held", 8, 1)):
        full = str(root / f"{name}.zarr")
        store = build_store(full, rows=rows, parts=parts)
        store.write_files("tokenizer", {"tokenizer.json": b"{}"})
        fp8 = str(root / f"{name}_fp8.zarr")
        copy_store(full, fp8, context_dtype=FP8_CONTEXT)
        out[name] = (full, fp8)
    return out


def _train(store: str, out) -> tuple[str, list[float]]:
    cfg = load_train_config(None, {"stores": [store], "run.out_dir": str(out),
                                   "model.num_hidden_layers": 1, "loader.batch_tokens": 256,
                                   "run.anchors_per_seq": 8, "optim.lr": 3e-3,
                                   "optim.max_steps": 12, "run.progress": False,
                                   "run.log_every": 1,
                                   "loader.prefetch_batches": 0})
    result = train(cfg)
    return str(result.checkpoint), [json.loads(line)["loss"]
                                    for line in (out / "log.jsonl").open()]


def _offline(store: str, checkpoint: str) -> dict:
    done = CliRunner().invoke(eval_command, ["--store", store, "--json", "--no-progress",
                                             "--device", "cpu", checkpoint])
    assert done.exit_code == 0, done.output
    return json.loads(done.output)["checkpoints"][0]["offline"]


def test_a_drafter_trained_on_fp8_follows_the_full_precision_run(stores, tmp_path):
    full_ckpt, full_loss = _train(stores["train"][0], tmp_path / "full")
    fp8_ckpt, fp8_loss = _train(stores["train"][1], tmp_path / "fp8")
    assert len(full_loss) == len(fp8_loss) == 12
    assert full_loss[-1] < 0.9 * full_loss[0]  # it learns at all
    # same batches, anchors and noise; only the context differs, by E4M3 rounding
    for a, b in zip(full_loss, fp8_loss, strict=True):
        assert abs(a - b) <= 0.005 * a, (full_loss, fp8_loss)  # measured <= 0.0002
    assert full_loss != fp8_loss  # the fp8 run did read the quantized context
    held, held_fp8 = stores["held"]
    for ckpt in (full_ckpt, fp8_ckpt):
        full, fp8 = _offline(held, ckpt), _offline(held_fp8, ckpt)
        assert fp8["n_blocks"] == full["n_blocks"] > 0
        assert fp8["mean_tau"] == pytest.approx(full["mean_tau"], abs=0.02)
        recall = full["topk_recall"]["8"]
        assert any(r > 0 for r in recall if r is not None)  # the comparison measures something
        assert fp8["topk_recall"]["8"] == pytest.approx(recall, abs=0.02)


def test_store_stats_of_an_fp8_store_are_those_of_its_full_precision_copy(stores):
    full, fp8 = (store_stats(open_store(url), cache=False) for url in stores["train"])
    assert fp8.tokens == full.tokens
    for a, b in zip(full.layers, fp8.layers, strict=True):
        assert b.rms == pytest.approx(a.rms, rel=0.01) and b.rms != a.rms
        assert b.absmax == pytest.approx(a.absmax, rel=1e-6)  # each row's absmax is exact
        assert b.outlier_channels[:2] == a.outlier_channels[:2]
