"""Held-out tau and step time of {decay, D-PACE} x {AdamW, Muon} at an equal step budget.

    python -m benchmarks.weights_optimizers --store TRAIN.zarr --held-out HELD_OUT.zarr
        --out DIR [--steps 60] [--set KEY=VALUE ...]

Trains the four drafters one after another with `dflash train` (same store, seed, lr, anchors
and step budget; `--set` adds settings to all four, e.g. --set optim.lr=6e-3), then evaluates
all four checkpoints in ONE `dflash eval --store HELD_OUT` call, so every drafter drafts the
same blocks. Prints one row per arm: replay tau with its 95 % interval, DDTree tau at the
smallest budget, and the median step time of the steps after the first (log.jsonl step_s).
Runs never overlap; on a shared machine the step times are still noisy. Not a test.
"""

import argparse
from pathlib import Path

from benchmarks.driver import new_dir, package_errors_as_one_line
from benchmarks.runs import evaluate_json, median_step_s, offline_by_arm, train_arms

ARMS = {
    "decay-adamw": [],
    "dpace-adamw": ["--set", "loss.position_weights=dpace"],
    "decay-muon": ["--set", "optim.optimizer=muon"],
    "dpace-muon": ["--set", "loss.position_weights=dpace", "--set", "optim.optimizer=muon"],
}


@package_errors_as_one_line
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="store to train on")
    p.add_argument("--held-out", required=True, help="store to evaluate on")
    p.add_argument("--out", required=True, help="directory for the four runs (must not exist)")
    p.add_argument("--steps", type=int, default=60, help="optimiser steps of every arm")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a `dflash train --set` for all four arms (repeatable)")
    a = p.parse_args()
    out = new_dir("--out", Path(a.out))
    out.mkdir()
    common = ["--store", a.store, "--max-steps", str(a.steps), "--no-progress"]
    for s in a.sets:
        common += ["--set", s]
    checkpoints = train_arms(out, ARMS, common)
    report = evaluate_json(a.held_out, [*checkpoints.values()], out)
    offline = offline_by_arm(report, checkpoints)
    budget = str(min(report["tree_budgets"]))
    print(f"{'arm':<12} {'tau (95% CI)':<24} {'tree' + budget + ' tau':>10} {'step s':>8}")
    for name in checkpoints:
        off = offline[name]
        lo, hi = off["tau_ci95"]
        print(f"{name:<12} {off['mean_tau']:.3f} [{lo:.3f}, {hi:.3f}]{'':<5} "
              f"{off['tree'][budget]['mean_tau']:>10.3f} {median_step_s(out / name):>8.3f}")


if __name__ == "__main__":
    main()
