"""What `dflash train --val-store` costs against the training it interrupts, at the shape of
benchmarks/real_target.py's long preset (1 layer, Muon, D-PACE, a 4,096-word draft
vocabulary, bf16 where native, 4,096-token batches, a checkpoint every 400 steps).

    nice -n 10 python -m benchmarks.validation_cost --store TRAIN.zarr [--val-store VAL.zarr]

1. builds the preset's run on --store (train.run.build_run, in a temporary directory) and
   times `--steps` of its own train_step, the first two apart (allocation, first touches);
2. replays that run's drafter as the loop does (train.validation.Validation.evaluate on the
   model being trained) on --val-limit samples of --val-store, with the chain alone and with
   the chain and each DDTree budget. The drafter is barely trained (tau ~1): each walk takes
   the most rounds a sample allows, the dearest case. Without --val-store, samples of
   --store stand in (one store's prompts and answers: the same shape; the time is the point).
Each part is timed in wall-clock seconds and in this process's CPU seconds: on a machine
shared with other work the CPU seconds at --threads 1 are what one free core would take,
which wall-clock seconds there are not. A benchmark: it measures, CI does not run it.
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line
from benchmarks.real_target import PRESETS, train_config


@dataclass
class Timed:
    wall: float
    cpu: float

    def __str__(self) -> str:
        return f"{self.wall:.2f} s wall, {self.cpu:.2f} s CPU"


def timed(fn):
    """(fn(), Timed) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, Timed(time.perf_counter() - wall, time.process_time() - cpu)


def preset_run(store: str, out: Path):
    """The long preset's run of its first drafter depth, built as `dflash train` builds it."""
    from dflash_train.train.run import build_run

    cfg = PRESETS["long"]
    tc = train_config(cfg, store, out, cfg.drafter_layers[0])
    tc = replace(tc, run=replace(tc.run, progress=False))
    return build_run(tc, resume=False, echo=lambda _: None)


def step_time(run, steps: int) -> Timed:
    """Median wall and CPU seconds of train_step over `steps` steps, the first two apart."""
    from dflash_train.train.batch import empty_batch
    from dflash_train.train.loop import train_step

    batches, times = run.loader.epoch(0), []
    for _ in range(steps):
        batch = next(batches) or empty_batch(run.store)
        times.append(timed(lambda b=batch: train_step(run, b))[1])
    kept = times[2:]
    return Timed(statistics.median(t.wall for t in kept), statistics.median(t.cpu for t in kept))


def validation_time(run, url: str, limit: int, budgets: tuple[int, ...]) -> tuple[Timed, float]:
    """One validation of the run's drafter on `limit` samples of `url`, and its chain tau."""
    from dflash_train.evaluate.config import EvalSettings
    from dflash_train.evaluate.damage import check_store
    from dflash_train.evaluate.samples import pick_samples, sample_keys
    from dflash_train.store_schema import open_store
    from dflash_train.train.validation import Validation, ValidationStore

    store = open_store(url)
    damage = check_store(store, skip=False)
    keys = pick_samples(store, limit, 0, damage) or sample_keys(store, damage)
    validation = Validation([ValidationStore(url, store, damage, keys)],
                            EvalSettings(tree_budgets=budgets, recall_at=(1,)), None, 1)
    figures, took = timed(lambda: validation.evaluate(run.model))
    return took, figures.pooled.tau


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="A SmolLM2 train store (complete parts).")
    parser.add_argument("--val-store", help="Validation store (default: --store's samples).")
    parser.add_argument("--val-limit", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="Training steps timed.")
    parser.add_argument("--budgets", default="16,64",
                        help="DDTree budgets: each timed alone, then all together.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    every = PRESETS["long"].eval_every
    with tempfile.TemporaryDirectory() as tmp:
        run = preset_run(args.store, Path(tmp) / "run")
        step = step_time(run, args.steps)
        print(f"{args.threads} thread(s); training: a step {step} (medians of "
              f"{args.steps - 2}); a checkpoint interval of {every} steps: "
              f"{step.wall * every:.0f} s wall, {step.cpu * every:.0f} s CPU")
        val = args.val_store or args.store

        def share(t: Timed) -> str:
            return (f"{t.wall / (step.wall * every):.1%} of the interval wall, "
                    f"{t.cpu / (step.cpu * every):.1%} CPU")

        chain, tau = validation_time(run, val, args.val_limit, ())
        print(f"validation on {args.val_limit} samples, chain: {chain} ({share(chain)}; "
              f"tau {tau:.3f})")
        budgets = tuple(int(b) for b in args.budgets.split(",") if b)
        for budget in budgets if len(budgets) > 1 else ():
            both, _ = validation_time(run, val, args.val_limit, (budget,))
            print(f"validation, chain + DDTree {budget}: {both} ({share(both)})")
        every_walk, _ = validation_time(run, val, args.val_limit, budgets)
        print(f"validation, chain + DDTree {','.join(map(str, budgets))}: {every_walk} "
              f"({share(every_walk)})")


if __name__ == "__main__":
    main()
