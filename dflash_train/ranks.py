"""A stage in one process per usable core (at most MAX_RANKS), as torchrun would start it.

Owns spawning the ranks `dflash extract` and `dflash train` take under torchrun (extract:
disjoint parts; train: DDP over gloo, which trains what one process trains), relaying rank 0's
lines, and raising the first error a rank raised. On a few CPU cores, one single-threaded rank
per core beats one process on all of them: ops of a small model, or the thin matmuls of a
batch decoding one token a row, are too small for torch's intra-op threads to share well
(SmolLM2-135M's regeneration: 1.29x on two cores, docs/benchmarks.md).
"""

import os
from dataclasses import replace

from dflash_train.ports import free_port

MAX_RANKS = 4
"""Most processes a stage runs in (more would split each training batch too thinly)."""


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def stage_ranks() -> int:
    """Processes a stage runs in: one per usable core, at most MAX_RANKS."""
    return max(1, min(MAX_RANKS, usable_cores()))


def threads_per_rank(world: int) -> int:
    """The usable cores' share of each of `world` ranks (at least one thread)."""
    return max(1, usable_cores() // world)


def _rank_main(rank: int, world: int, port: int, queue, stage, args: tuple,
               threads: int) -> None:
    """One rank of a stage (a spawned process): the environment torchrun would give it."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    echo = (lambda line: queue.put(("echo", str(line)))) if rank == 0 else (lambda *_: None)
    try:
        result = stage(rank, world, *args, echo=echo)
    except Exception as e:
        try:
            queue.put(("error", e))
        except Exception:  # an exception that does not pickle: the traceback still shows it
            pass
        raise  # a non-zero exit: the other ranks are stopped instead of waiting on this one
    if rank == 0:
        queue.put(("result", result))


def in_ranks(stage, *args, echo=print, world: int | None = None, threads: int = 1):
    """stage(rank, world, *args, echo=...) in `world` spawned ranks of `threads` torch
    threads each; rank 0's result.

    Rank 0's echo lines reach `echo` as they come; the first error a rank raised is raised
    here as itself. One rank runs in this process, on torch's default threads."""
    world = stage_ranks() if world is None else world
    if world == 1:
        return stage(0, 1, *args, echo=echo)
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_rank_main, args=(world, free_port(), queue, stage, args, threads),
                               nprocs=world, join=False, start_method="spawn")
    got: dict = {}

    def drain() -> None:
        while not queue.empty():
            kind, value = queue.get()
            if kind == "echo":
                echo(value)
            else:
                got.setdefault(kind, value)

    try:
        while not procs.join(timeout=0.2):
            drain()
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        drain()
        if "error" in got:
            raise got["error"] from None
        raise
    drain()
    return got.get("result")


def extract_rank(rank: int, world: int, jobs: list, echo) -> None:
    """This rank's parts of every store in `jobs` (ExtractConfigs); bars on rank 0 only."""
    from dflash_train.extract.pipeline import run_extract

    for job in jobs:
        run_extract(replace(job, progress=job.progress and rank == 0), rank=rank,
                    world_size=world, echo=echo)


def train_rank(rank: int, world: int, cfg, resume: bool = False, echo=print):
    """This rank's share of the training run `cfg` (a TrainConfig): DDP over gloo when
    world > 1; every rank returns the run's result."""
    from dflash_train.train.loop import train

    return train(cfg, resume=resume, echo=echo)
