"""Running `dflash` as a user would, for the benchmarks that train and evaluate arms side by
side (arms, weights_optimizers, dflash2_vs_dflash, fp8_store): train each arm, evaluate every
final checkpoint in one `dflash eval`, read the figures back by arm. Run directories are read
through the package's own layout and log reader, never by spelling their file names."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from dflash_train.run_layout import CHECKPOINTS
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.log_summary import read_log


def dflash(*args: str) -> str:
    """stdout of `python -m dflash_train ARGS`; exits with its output's end when it fails."""
    done = subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"dflash {args[0]} failed:\n{done.stderr[-3000:]}{done.stdout[-3000:]}")
    return done.stdout


def step_seconds(run: Path) -> list[float]:
    """The logged seconds of each optimiser step of a run directory, in step order."""
    return [r.step_s for r in read_log(run) if r.step_s is not None]


def median_step_s(run: Path) -> float:
    """Median seconds per optimiser step of a run directory, from its log."""
    steps = step_seconds(run)
    return statistics.median(steps[1:] or steps)  # the first step warms caches up


def train_seconds(run: Path) -> float:
    """Seconds a run spent in its optimiser steps: the sum of its logged step times."""
    return sum(step_seconds(run))


def final_checkpoint(run: Path) -> Path:
    """The newest complete checkpoint of a run directory; exits when it has none."""
    found = latest_checkpoint(run)
    if found is None:
        sys.exit(f"{run} holds no complete checkpoint")
    return found


def train_arms(out: Path, arms: dict[str, list[str]], common: list[str]) -> dict[str, Path]:
    """`dflash train` each arm (its extra arguments after `common`) into out/NAME, one after
    another; an arm already there is resumed (nothing is trained if it is complete). Returns
    each arm's final checkpoint."""
    checkpoints = {}
    for name, extra in arms.items():
        print(f"training {name}", file=sys.stderr, flush=True)
        again = ["--resume"] if (out / name / CHECKPOINTS).is_dir() else []
        dflash("train", "--out", str(out / name), *again, *common, *extra)
        checkpoints[name] = final_checkpoint(out / name)
    return checkpoints


def evaluate_json(held_out: str, checkpoints: list[str | Path], out: Path) -> dict:
    """One `dflash eval --json` of every checkpoint on the held-out store, so every drafter
    drafts the same sequences; the report is also kept as out/eval.json."""
    report = json.loads(dflash("eval", "--store", held_out, "--json", *map(str, checkpoints)))
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    return report


def columns_by_path(report: dict) -> dict[Path, dict]:
    """Each checkpoint's report entry, by its resolved path."""
    return {Path(c["path"]).resolve(): c for c in report["checkpoints"]}


def offline_by_arm(report: dict, checkpoints: dict[str, Path]) -> dict[str, dict]:
    """Each arm's offline (replay) figures in an eval report of its checkpoint."""
    columns = columns_by_path(report)
    return {name: columns[Path(ckpt).resolve()]["offline"] for name, ckpt in checkpoints.items()}
