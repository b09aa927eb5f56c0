"""Held-out tau and step time of training recipes side by side, at an equal step budget or
an equal training time.

    python -m benchmarks.arms --store TRAIN.zarr --held-out HELD_OUT.zarr --out DIR
        --arm fp32=run.precision=fp32 --arm bf16=run.precision=bf16 [--steps 100]
        [--seconds 600] [--set KEY=VALUE ...]

Each `--arm NAME=KEY=VALUE[,KEY=VALUE...]` is one `dflash train` run (`--set` adds settings
to every arm). The arms train one after another, never overlapping, so a quiet machine
gives each the same cores; then every final checkpoint is evaluated in ONE `dflash eval
--store HELD_OUT` call, so every drafter drafts the same sequences. Prints one row per arm:
replay tau with its 95 % interval, slot-1 acceptance, the steps and training seconds (the sum
of its logged step times) and the median step time of the steps after the first, with the
step-time ratio to the first arm.

`--seconds S` gives every arm the same training time instead of the same steps: each arm
first trains a short probe run (`--probe-steps`, into DIR/NAME.probe), and its step budget
is S over the probe's median step time, so its warmup and cosine schedule span the whole
budget as they would at a fixed step count. The budgets are kept in DIR/budgets.json, so a
rerun with the same --out continues after an interruption (finished arms are not trained
again) with the same steps. A probe taken while something else shares the cores misjudges
the step (by up to 1.6x in docs/real_target.md): the train seconds column says what each arm
really got; delete an arm's directory and its budgets.json entry to budget it again. Not a
test.
"""

import argparse
import json
import sys
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line, writable_dir
from benchmarks.runs import (
    evaluate_json,
    median_step_s,
    offline_by_arm,
    train_arms,
    train_seconds,
)


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'NAME=K=V,K=V' -> (NAME, ['--set', 'K=V', ...]); 'NAME=' is the defaults."""
    name, sep, settings = text.partition("=")
    if not name or not sep:
        raise SystemExit(f"--arm {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
    out = []
    for s in filter(None, settings.split(",")):
        if "=" not in s:
            raise SystemExit(f"--arm {text!r}: {s!r} is not KEY=VALUE")
        out += ["--set", s]
    return name, out


@package_errors_as_one_line
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, action="append", help="store to train on")
    p.add_argument("--held-out", required=True, help="store to evaluate on")
    p.add_argument("--out", required=True, help="directory for the runs")
    p.add_argument("--arm", dest="arms", action="append", required=True,
                   help="NAME=KEY=VALUE[,KEY=VALUE...] (repeatable)")
    p.add_argument("--steps", type=int, default=100, help="optimiser steps of every arm")
    p.add_argument("--seconds", type=float, default=None,
                   help="training seconds of every arm instead of --steps (see above)")
    p.add_argument("--probe-steps", type=int, default=8,
                   help="with --seconds: steps of the probe run that times an arm's step")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a `dflash train --set` for every arm (repeatable)")
    a = p.parse_args()
    arms = dict(parse_arm(t) for t in a.arms)
    out = writable_dir("--out", Path(a.out))
    common = [x for s in a.store for x in ("--store", s)]
    common += ["--no-progress", "--device", "cpu"]
    for s in a.sets:
        common += ["--set", s]
    steps = {name: a.steps for name in arms}
    if a.seconds is not None:
        steps = budget_steps(out, arms, common, a.seconds, a.probe_steps)
    checkpoints = train_arms(out, {name: [*extra, "--max-steps", str(steps[name])]
                                   for name, extra in arms.items()}, common)
    offline = offline_by_arm(evaluate_json(a.held_out, [*checkpoints.values()], out),
                             checkpoints)
    rows, first_step = [], None
    print(f"{'arm':<24} {'tau (95% CI)':<24} {'slot 1':>7} {'steps':>6} {'train s':>8} "
          f"{'step s':>8} {'ratio':>6}")
    for name in checkpoints:
        off = offline[name]
        lo, hi = off["tau_ci95"]
        step, seconds = median_step_s(out / name), train_seconds(out / name)
        first_step = first_step or step
        slot1 = (off.get("cond_accept") or [None])[0]
        rows.append({"arm": name, "settings": extra_text(arms[name]), "tau": off["mean_tau"],
                     "tau_ci95": [lo, hi], "slot1_acceptance": slot1,
                     "steps": steps[name], "train_seconds": seconds,
                     "median_step_s": step, "blocks": off["n_blocks"]})
        shown = f"{slot1:.3f}" if isinstance(slot1, float) else "n/a"
        print(f"{name:<24} {off['mean_tau']:.3f} [{lo:.3f}, {hi:.3f}]{'':<5} {shown:>7} "
              f"{steps[name]:>6} {seconds:>8.0f} {step:>8.3f} {step / first_step:>5.2f}x")
    (out / "table.json").write_text(json.dumps(rows, indent=2))


def budget_steps(out: Path, arms: dict[str, list[str]], common: list[str], seconds: float,
                 probe_steps: int) -> dict[str, int]:
    """Each arm's step budget for `seconds` of training: seconds over the median step of a
    probe run of that arm. Kept in out/budgets.json, so a rerun trains the same steps."""
    path = out / "budgets.json"
    budgets = json.loads(path.read_text()) if path.is_file() else {}
    for name, extra in arms.items():
        if name in budgets:
            continue
        probe = {f"{name}.probe": [*extra, "--max-steps", str(probe_steps)]}
        train_arms(out, probe, common)
        step = median_step_s(out / f"{name}.probe")
        budgets[name] = max(1, int(seconds / step))
        print(f"{name}: {step:.3f} s a step -> {budgets[name]} steps", file=sys.stderr)
        path.write_text(json.dumps(budgets, indent=1))
    return budgets


def extra_text(sets: list[str]) -> str:
    return ",".join(sets[1::2])


if __name__ == "__main__":
    main()
