import os

import pytest
import torch

from dflash_train.extract.errors import ExtractError
from dflash_train.ranks import MAX_RANKS, in_ranks, stage_ranks, threads_per_rank, usable_cores


def _where_am_i(rank: int, world: int, tag: str, echo):
    echo(f"{tag} from rank {rank}")
    env = (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"))
    return {"rank": rank, "world": world, "env": env, "threads": torch.get_num_threads(),
            "pid": os.getpid()}


def _fails_on_rank_1(rank: int, world: int, echo):
    if rank == 1:
        raise ExtractError("part 3: bad row")
    return rank


def test_a_stage_runs_in_one_single_threaded_process_per_rank_and_rank_0_speaks():
    said = []
    got = in_ranks(_where_am_i, "hello", echo=said.append, world=2)
    assert said == ["hello from rank 0"]
    assert got["rank"] == 0 and got["world"] == 2 and got["env"] == ("0", "2")
    assert got["threads"] == 1 and got["pid"] != os.getpid()
    with pytest.raises(ExtractError, match="part 3: bad row"):
        in_ranks(_fails_on_rank_1, echo=said.append, world=2)
    # one rank: this process itself, its threads untouched
    alone = in_ranks(_where_am_i, "solo", echo=said.append, world=1)
    assert alone["pid"] == os.getpid() and said[-1] == "solo from rank 0"
    assert 1 <= stage_ranks() == min(MAX_RANKS, usable_cores())
    assert in_ranks(_where_am_i, "wide", echo=said.append, world=2, threads=3)["threads"] == 3


def test_ranks_share_the_cores_without_oversubscribing_them():
    cores = usable_cores()
    for world in range(1, MAX_RANKS + 1):
        threads = threads_per_rank(world)
        assert threads >= 1
        assert world * threads <= max(cores, world)  # never more threads than cores, past 1 each
        assert world * (threads + 1) > cores  # and no core left over for another thread each
