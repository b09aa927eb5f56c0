"""Held-out tau against real training seconds, from a run's log and `dflash eval --out` reports.

    python -m benchmarks.tau_vs_time RUN_DIR val64=eval_val/report.json \
        held128=eval_held/report.json --out tau_vs_time.png

A checkpoint's training seconds are the logged step times of every step up to it (the last
record of a step wins, so a resumed run that repeated steps counts them once). Prints one
markdown table row per checkpoint and draws one line per report. A benchmark: it measures.
"""

import argparse
import json
import re
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line, writable_file
from dflash_train.run_layout import LOG, STEP_PREFIX
from dflash_train.train.errors import TrainError
from dflash_train.train.log_summary import read_log

STEP_NAME = re.compile(rf"{STEP_PREFIX}(\d+)$")


def seconds_by_step(run_dir: Path) -> dict[int, float]:
    """Cumulative logged step seconds at every step of a run, read by the log reader of
    `dflash log summary` (one record per step, the last one written)."""
    try:
        records = read_log(run_dir)
    except TrainError as err:
        raise SystemExit(str(err)) from None
    total, cumulative = 0.0, {}
    for record in records:
        if record.step_s is None:
            raise SystemExit(f"{run_dir}: step {record.step} has no step_s (an older log?)")
        total += record.step_s
        cumulative[record.step] = total
    return cumulative


def taus_by_step(report: Path) -> dict[int, tuple[float, list[float]]]:
    """{step: (mean tau, 95 % interval)} for every checkpoint of an eval report.json."""
    try:
        columns = json.loads(report.read_text())["checkpoints"]
        out = {}
        for column in columns:
            match = STEP_NAME.search(str(column["path"]).rstrip("/"))
            if match:
                offline = column["offline"]
                out[int(match.group(1))] = (offline["mean_tau"], offline["tau_ci95"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"{report}: not a dflash eval report.json ({err})") from None
    if not out:
        raise SystemExit(f"{report}: no checkpoint named step_N in it")
    return out


def plot(curves: dict[str, dict[int, tuple[float, list[float]]]], seconds: dict[int, float],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, taus in curves.items():
        steps = sorted(taus)
        x = [seconds[s] / 60 for s in steps]
        ax.plot(x, [taus[s][0] for s in steps], marker="o", label=name)
        ax.fill_between(x, [taus[s][1][0] for s in steps], [taus[s][1][1] for s in steps],
                        alpha=0.2)
    ax.set_xlabel("training minutes (logged step time)")
    ax.set_ylabel("tau (committed tokens per round)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="The training run directory.")
    parser.add_argument("reports", nargs="+", metavar="NAME=REPORT",
                        help="A curve's name and an eval report.json of the run's checkpoints.")
    parser.add_argument("--out", type=Path, required=True, help="The PNG to write.")
    args = parser.parse_args()
    writable_file("--out", args.out)
    seconds = seconds_by_step(args.run)
    curves = {}
    for spec in args.reports:
        name, sep, report = spec.partition("=")
        if not sep or not name or not report:
            parser.error(f"{spec!r}: expected NAME=REPORT")
        curves[name] = taus_by_step(Path(report))
    for name, taus in curves.items():
        missing = sorted(set(taus) - set(seconds))
        if missing:
            raise SystemExit(f"{name}: steps {missing} are not in {args.run / LOG}")
    print("| step | training seconds | " + " | ".join(f"{n} tau (95 % CI)" for n in curves)
          + " |")
    print("| --- | --- |" + " --- |" * len(curves))
    for step in sorted(set().union(*curves.values())):
        cells = [f"{c[step][0]:.3f} ({c[step][1][0]:.3f}-{c[step][1][1]:.3f})" if step in c
                 else "-" for c in curves.values()]
        print(f"| {step:,} | {seconds[step]:,.0f} | " + " | ".join(cells) + " |")
    plot(curves, seconds, args.out)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
