"""How the drafter is spread over ranks (train.parallel)."""

import torch
import torch.distributed as dist

from dflash_train.train.parallel import wrap
from tests.drafter.conftest import random_batch, tiny_drafter


def test_a_ddp_forward_sends_no_buffer(tmp_path):
    # The drafter's buffers are the target's frozen embedding and head: re-sending them from
    # rank 0 before every forward cost ~8 % of a CPU step and would move GBs at 27B's shape.
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
