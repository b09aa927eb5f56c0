"""Soak `dflash extract` under SIGKILL: random kills, resume, compare with an uninterrupted run.

    python -m scripts.soak_extract --trials 10 [--seed 0] [--workdir DIR]

Each trial extracts a tiny random Qwen3.5 target over 14 chats (3 parts of 16-token shards)
into a fresh store and SIGKILLs the CLI 1-4 times, each kill drawn at random from:
- timed: a plain SIGKILL after a random wall time (anywhere: imports, model load, forward,
  writes);
- after-samples: writer.KILL_AFTER_ENV, right after the Nth sample append;
- at-write: just before the Nth zarr store write of the process;
- torn-commit: half of the Nth part commit record written to its temp file, then SIGKILL.
It then re-runs the same command until it exits 0 and checks: every source row stored exactly
once, `validate` clean, and every array bit-identical to the reference (an uninterrupted
in-process run). After each kill it also checks that no committed row was lost or repeated.
Prints one line per trial and a summary; exits 1 if any trial failed.
"""

import argparse
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from dflash_train.extract.writer import KILL_AFTER_ENV
from dflash_train.store_schema import validate
from tests.reliability.extract_faults import KILL_AT_WRITE, TORN_COMMIT
from tests.reliability.extract_support import (
    NUM_ROWS,
    build_inputs,
    child_env,
    cli_args,
    cli_command,
    committed_rows,
    differences,
    duplicates_and_losses,
    run_in_process,
    stored_samples,
)

REPO = Path(__file__).resolve().parents[1]

KINDS = ("timed", "after-samples", "at-write", "torn-commit")
FRESH_WRITES, FRESH_COMMITS = 445, 20
"""Store writes and part commit records of one uninterrupted run with these settings."""


def draw_kill(rng: random.Random, run_seconds: float, left: float) -> tuple[str, float | int]:
    """A kill drawn within what a run still has to do (`left`: share of rows not committed),
    so most kills land; a timed one may still come after the run finished."""
    kind = rng.choice(KINDS)
    if kind == "timed":
        return kind, rng.uniform(0.2, run_seconds)
    bound = {"after-samples": NUM_ROWS, "at-write": FRESH_WRITES,
             "torn-commit": FRESH_COMMITS}[kind]
    return kind, rng.randint(1, max(1, round(bound * left)))


def run_once(args: list[str], kill: tuple[str, float | int] | None) -> int:
    """One CLI run, with `kill` armed; returns its exit status (-9 when killed)."""
    env = {}
    if kill and kill[0] != "timed":
        variable = {"after-samples": KILL_AFTER_ENV, "at-write": KILL_AT_WRITE,
                    "torn-commit": TORN_COMMIT}[kill[0]]
        env[variable] = kill[1]
    proc = subprocess.Popen(cli_command(args), env=child_env(**env), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=kill[1] if kill and kill[0] == "timed" else 600)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGKILL
        _, err = proc.communicate()
    if proc.returncode not in (0, -9):
        print(err[-3000:], file=sys.stderr)
    return proc.returncode


def trial(index: int, rng: random.Random, inputs, reference, run_seconds: float,
          workdir: Path, stats: Counter) -> list[str]:
    """One trial; returns what went wrong (empty when it passed)."""
    out = str(workdir / f"trial{index:03d}.zarr")
    args = cli_args(*inputs, out)
    problems, log = [], []
    for _ in range(rng.randint(1, 4)):
        before = committed_rows(out)
        kill = draw_kill(rng, run_seconds, 1 - len(before) / NUM_ROWS)
        rc = run_once(args, kill)
        label = f"{kill[0]}={kill[1]:.2f}" if kill[0] == "timed" else f"{kill[0]}={kill[1]}"
        if rc == 0:
            stats[f"{kill[0]} (finished before the kill)"] += 1
            log.append(label + ":missed")
            break
        if rc != -9:
            problems.append(f"{label}: exit {rc}")
            break
        stats[kill[0]] += 1
        log.append(label)
        after = committed_rows(out)
        dup, _ = duplicates_and_losses(after, range(0))
        if dup or after != sorted(after) or not set(before) <= set(after):
            problems.append(f"after {label}: committed rows {before} -> {after}")
    if any(run_once(args, None) == 0 for _ in range(3)):  # stops at the first success
        problems += _final_checks(out, reference, stats)
    else:
        problems.append("the resume did not finish in 3 runs")
    print(f"trial {index}: kills [{', '.join(log)}] -> {'ok' if not problems else problems}",
          flush=True)
    return problems


def _final_checks(out: str, reference, stats: Counter) -> list[str]:
    problems = [f"validate: {f}" for f in validate(out)[:3]]
    got = stored_samples(out)
    dup, lost = duplicates_and_losses([s.source_row for s in got], range(NUM_ROWS))
    stats["rows lost"] += len(lost)
    stats["rows duplicated"] += len(dup)
    return problems + differences(got, reference)[:5]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="Trials to run (default 10).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the kill draws.")
    parser.add_argument("--workdir", default=None, help="Where stores go (default: a temp dir).")
    a = parser.parse_args()
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="dflash-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    inputs = build_inputs(workdir)
    run_in_process(*inputs, str(workdir / "reference.zarr"))
    reference = stored_samples(str(workdir / "reference.zarr"))
    start = time.perf_counter()
    if run_once(cli_args(*inputs, str(workdir / "clean.zarr")), None) != 0:
        print("an uninterrupted CLI run failed", file=sys.stderr)
        return 1
    run_seconds = time.perf_counter() - start
    clean = differences(stored_samples(str(workdir / "clean.zarr")), reference)
    print(f"uninterrupted CLI run: {run_seconds:.1f} s, equal to the in-process reference: "
          f"{not clean}")
    rng = random.Random(a.seed)
    stats: Counter = Counter()
    failed = [i for i in range(a.trials)
              if trial(i, rng, inputs, reference, run_seconds, workdir, stats)]
    print(f"\nsoak: {a.trials - len(failed)}/{a.trials} trials identical to the reference; "
          f"seed {a.seed}; workdir {workdir}")
    for key in sorted(stats):
        print(f"  {key}: {stats[key]}")
    return 1 if failed or clean else 0


if __name__ == "__main__":
    sys.exit(main())
