"""Running `dflash` as a user would, for the benchmarks that train and evaluate arms side by
side (weights_optimizers, dflash2_vs_dflash, fp8_store)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path


def dflash(*args: str) -> str:
    """stdout of `python -m dflash_train ARGS`; exits with its output's end when it fails."""
    done = subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"dflash {args[0]} failed:\n{done.stderr[-3000:]}{done.stdout[-3000:]}")
    return done.stdout


def median_step_s(run: Path) -> float:
    """Median seconds per optimiser step of a run directory, from its log.jsonl."""
    steps = [json.loads(line)["step_s"] for line in (run / "log.jsonl").open()]
    return statistics.median(steps[1:] or steps)  # the first step warms caches up


def train_seconds(run: Path) -> float:
    """Seconds a run spent in its optimiser steps: the sum of its logged step times."""
    return sum(json.loads(line)["step_s"] for line in (run / "log.jsonl").open())


def train_arms(out: Path, arms: dict[str, list[str]], common: list[str]) -> dict[str, Path]:
    """`dflash train` each arm (its extra arguments after `common`) into out/NAME, one after
    another; an arm already there is resumed (nothing is trained if it is complete). Returns
    each arm's final checkpoint."""
    checkpoints = {}
    for name, extra in arms.items():
        print(f"training {name}", file=sys.stderr, flush=True)
        again = ["--resume"] if (out / name / "checkpoints").is_dir() else []
        dflash("train", "--out", str(out / name), *again, *common, *extra)
        (checkpoints[name],) = sorted((out / name / "checkpoints").glob("step_*"))[-1:]
    return checkpoints
