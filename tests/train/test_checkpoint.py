"""Training checkpoints on disk: the modes they are written with."""

import os
import stat

import pytest
import torch

from dflash_train.drafter import DFlashDrafter
from dflash_train.store_schema import open_store
from dflash_train.train.checkpoint import (
    CheckpointContents,
    TrainState,
    read_checkpoint,
    save_checkpoint,
)
from dflash_train.train.config import TrainConfig, to_toml
from dflash_train.train.drafter_shape import drafter_config


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755),
                                                       (0o077, 0o600, 0o700)])
def test_a_checkpoint_gets_the_modes_the_umask_gives(synthetic_store, tmp_path, mask,
                                                      file_mode, dir_mode):
    # A checkpoint is exported or evaluated by whoever can read the run directory: every
    # directory and file in it has the modes the umask gives new ones, drafter/ included
    # (written through a private temp dir, its weights by safetensors at 0600).
    cfg = TrainConfig(stores=[synthetic_store])
    cfg.model.num_hidden_layers = 1
    model = DFlashDrafter(drafter_config(cfg, open_store(synthetic_store)))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    old = os.umask(mask)
    try:
        contents = CheckpointContents(model, model.state_dict(), optimizer.state_dict(),
                                      scheduler, TrainState(step=2),
                                      open_store(synthetic_store).meta, to_toml(cfg))
        path = save_checkpoint(tmp_path / "run", contents)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(path)): stat.S_IMODE(p.stat().st_mode)
             for p in [path, *path.rglob("*")]}
    want = {name: dir_mode if (path / name).is_dir() else file_mode for name in modes}
    assert "drafter/model.safetensors" in modes and "trainer.pt" in modes
    assert modes == want
    assert read_checkpoint(path).trainer["state"]["step"] == 2
