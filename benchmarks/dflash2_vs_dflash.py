"""Held-out tau, parameters and step time of DFlash vs DFlash 2 at an equal step budget.

    python -m benchmarks.dflash2_vs_dflash --store TRAIN.zarr --held-out HELD_OUT.zarr
        --out DIR [--steps 60] [--warm-from DFLASH_CHECKPOINT] [--set KEY=VALUE ...]

Trains, one after another with `dflash train` (same store, seed, lr, anchors and step
budget; `--set` adds settings to every arm): DFlash, DFlash 2 with free codebooks, DFlash 2
with factorised ones (A = E W), and with --warm-from a DFlash 2 drafter warm-started from
that DFlash checkpoint (its tau at step 0 is that checkpoint's; it has had that checkpoint's
steps more than the others). Then evaluates every checkpoint in ONE `dflash eval --store
HELD_OUT` call (DFlash 2 drafters by their selector walk), so every drafter drafts the same
sequences. Prints one row per arm: replay tau with its 95 % interval, trainable parameters
(all, and those DFlash 2 adds), and the median step time of the steps after the first.
Runs never overlap; on a shared machine the step times are still noisy. Rerun with the same
--out to continue after an interruption. Not a test.
"""

import argparse
import json
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line, writable_dir
from benchmarks.runs import columns_by_path, evaluate_json, median_step_s, train_arms
from dflash_train.drafter import load_drafter
from dflash_train.drafter.config import DRAFTER_KINDS

DFLASH2 = ["--set", "model.kind=dflash2"]
ARMS = {
    "dflash": [],
    "dflash2-free": DFLASH2,
    "dflash2-factorised": [*DFLASH2, "--set", "model.selector_codebooks=factorised"],
}
EXTRA_PREFIXES = ("candidate_selector.",)
EXTRA_PARTS = (".attention_conv.", ".mlp_conv.")


def parameters(checkpoint: Path) -> tuple[int, int]:
    """(trainable parameters, those DFlash 2 adds) of a checkpoint, as it trains them (a
    factorised selector's factors, not the E W it exports)."""
    model = load_drafter(checkpoint, kinds=DRAFTER_KINDS)
    named = dict(model.named_parameters())
    extra = sum(p.numel() for n, p in named.items()
                if n.startswith(EXTRA_PREFIXES) or any(part in n for part in EXTRA_PARTS))
    return sum(p.numel() for p in named.values()), extra


@package_errors_as_one_line
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="store to train on")
    p.add_argument("--held-out", required=True, help="store to evaluate on")
    p.add_argument("--out", required=True, help="directory for the runs; an arm whose run "
                   "is already there is resumed (nothing is trained if it is complete)")
    p.add_argument("--steps", type=int, default=60, help="optimiser steps of every arm")
    p.add_argument("--warm-from", help="a DFlash checkpoint: add a warm-started DFlash 2 arm")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a `dflash train --set` for every arm (repeatable)")
    a = p.parse_args()
    out = writable_dir("--out", Path(a.out))
    common = ["--store", a.store, "--max-steps", str(a.steps), "--no-progress"]
    for s in a.sets:
        common += ["--set", s]
    arms = dict(ARMS)
    if a.warm_from:
        arms["dflash2-warm"] = [*DFLASH2, "--set", f"model.init_from={a.warm_from}"]
    checkpoints = train_arms(out, arms, common)
    evaluated = [*map(str, checkpoints.values())]
    if a.warm_from:
        evaluated.append(a.warm_from)
    columns = columns_by_path(evaluate_json(a.held_out, evaluated, out))
    rows = []
    print(f"{'arm':<20} {'tau (95% CI)':<24} {'params':>11} {'DFlash 2 adds':>14} "
          f"{'step s':>8}")
    for name, ckpt in checkpoints.items():
        off = columns[ckpt.resolve()]["offline"]
        lo, hi = off["tau_ci95"]
        total, extra = parameters(ckpt)
        step = median_step_s(out / name)
        rows.append({"arm": name, "tau": off["mean_tau"], "tau_ci95": [lo, hi],
                     "parameters": total, "dflash2_parameters": extra, "median_step_s": step,
                     "blocks": off["n_blocks"]})
        print(f"{name:<20} {off['mean_tau']:.3f} [{lo:.3f}, {hi:.3f}]{'':<5} {total:>11,} "
              f"{extra:>14,} {step:>8.3f}")
    if a.warm_from:
        off = columns[Path(a.warm_from).resolve()]["offline"]
        print(f"{'(warm-from itself)':<20} {off['mean_tau']:.3f}")
        rows.append({"arm": "warm-from", "tau": off["mean_tau"], "tau_ci95": off["tau_ci95"]})
    (out / "table.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
