"""`train_step` on a run assembled in memory (train.run.assemble_run): no run directory, a
tiny drafter built here, and the same steps `dflash train` takes."""

import json
from dataclasses import replace

import pytest
import torch

from dflash_train.drafter import DFlashDrafter, load_drafter
from dflash_train.run_layout import LOG
from dflash_train.store_schema import open_store
from dflash_train.train.config import load_train_config
from dflash_train.train.data import StoreLoader
from dflash_train.train.drafter_shape import drafter_config
from dflash_train.train.loop import train, train_step
from dflash_train.train.run import Placement, assemble_run, rank_sinks

SETTINGS = {"model.num_hidden_layers": 1, "loader.batch_tokens": 256, "run.anchors_per_seq": 8,
            "optim.lr": 3e-3, "optim.max_steps": 2, "run.progress": False, "run.log_every": 1,
            "loader.prefetch_batches": 0, "run.precision": "fp32", "noise.absolute": True}
"""Two steps of the train tests' shape; absolute noise needs no per-layer statistics."""


def _in_memory_run(store_url: str, cfg):
    """What build_run assembles, built by hand: the seed, a new drafter of the store's shape
    borrowing its head, the store's loader."""
    torch.manual_seed(cfg.run.seed)
    store = open_store(store_url)
    model = DFlashDrafter(drafter_config(cfg, store))
    rows = store.target_rows()
    model.attach_target_head(rows["embed_tokens"], rows["lm_head"])
    loader = StoreLoader([store_url], cfg.loader)
    return assemble_run(cfg, model, placement=Placement(torch.device("cpu")),
                        total_steps=cfg.optim.max_steps, loader=loader)


def test_two_steps_of_an_in_memory_run_are_the_first_two_of_dflash_train(synthetic_store,
                                                                          tmp_path):
    cfg = load_train_config(None, {"stores": [synthetic_store],
                                   "run.out_dir": str(tmp_path / "run"), **SETTINGS})
    trained = load_drafter(train(cfg).checkpoint)
    logged = [json.loads(line) for line in (tmp_path / "run" / LOG).read_text().splitlines()]

    never = tmp_path / "never"
    run = _in_memory_run(synthetic_store, replace(cfg, run=replace(cfg.run, out_dir=str(never))))
    batches = run.loader.epoch(0)
    records = [train_step(run, next(batches)) for _ in range(2)]

    assert [r.step for r in records] == [1, 2] and run.state.step == 2
    for got, want in zip(records, logged, strict=True):
        for key in ("loss", "grad_norm", "lr", "tokens", "blocks", "noise_std"):
            assert getattr(got, key) == want[key], key
        assert got.accuracy.slot_acc == want["slot_acc"]
        assert got.accuracy.train_tau == want["train_tau"]
    state = run.model.state_dict()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert not never.exists()  # nothing was claimed or written


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_logs_and_shows_progress_and_the_other_ranks_write_nothing(synthetic_store,
                                                                          tmp_path, rank):
    cfg = load_train_config(None, {"stores": [synthetic_store], **SETTINGS, "run.progress": True})
    run = _in_memory_run(synthetic_store, cfg)
    record = train_step(run, next(run.loader.epoch(0)))
    placed = replace(run, placement=replace(run.placement, rank=rank), run_dir=tmp_path)
    sinks = rank_sinks(placed, echo=print)
    assert sinks.bar.disable == (rank != 0)
    sinks.bar.close()
    sinks.log.write(record)
    sinks.log.close()
    if rank == 0:
        lines = (tmp_path / LOG).read_text().splitlines()
        assert [json.loads(line) for line in lines] == [record.to_json()]
    else:
        assert list(tmp_path.iterdir()) == []
