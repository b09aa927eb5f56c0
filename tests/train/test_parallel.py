"""How the drafter is spread over ranks (train.parallel)."""

import torch
import torch.distributed as dist

from dflash_train.train.parallel import _no_buffer_sync_per_forward, wrap
from tests.drafter.conftest import random_batch, tiny_drafter


def test_a_ddp_forward_sends_no_buffer(tmp_path):
    # the drafter's buffers are frozen (train.parallel._no_buffer_sync_per_forward)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0,
                            world_size=1)
    try:
        model = tiny_drafter().train()
        assert dict(model.named_buffers()), "no buffer: the test would see nothing"
        ddp = wrap(model, "ddp", torch.device("cpu"))
        sent = []
        ddp._distributed_broadcast_coalesced = lambda tensors, *a, **k: sent.append(tensors)
        ddp(*random_batch(model, seed=0))
        assert sent == []
    finally:
        dist.destroy_process_group()


def test_a_torch_before_2_13_gets_the_argument_it_knows(monkeypatch):
    class DDPBefore213:  # forward_sync_buffers came with torch 2.13
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            pass

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", DDPBefore213)
    assert _no_buffer_sync_per_forward() == {"broadcast_buffers": False}
