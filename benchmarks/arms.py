"""Held-out tau and step time of training recipes side by side, at an equal step budget.

    python benchmarks/arms.py --store TRAIN.zarr --held-out HELD_OUT.zarr --out DIR
        --arm fp32=run.precision=fp32 --arm bf16=run.precision=bf16 [--steps 100]
        [--set KEY=VALUE ...]

Each `--arm NAME=KEY=VALUE[,KEY=VALUE...]` is one `dflash train` run (`--set` adds settings
to every arm). The arms train one after another, never overlapping, so a quiet machine
gives each the same cores; then every final checkpoint is evaluated in ONE `dflash eval
--store HELD_OUT` call, so every drafter drafts the same sequences. Prints one row per arm:
replay tau with its 95 % interval, slot-1 acceptance, and the median step time of the steps
after the first, with the step-time ratio to the first arm. Rerun with the same --out to
continue after an interruption (finished arms are not trained again). Not a test.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from benchmarks.runs import dflash, median_step_s, train_arms  # noqa: E402


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, action="append", help="store to train on")
    p.add_argument("--held-out", required=True, help="store to evaluate on")
    p.add_argument("--out", required=True, help="directory for the runs")
    p.add_argument("--arm", dest="arms", action="append", required=True,
                   help="NAME=KEY=VALUE[,KEY=VALUE...] (repeatable)")
    p.add_argument("--steps", type=int, default=100, help="optimiser steps of every arm")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a `dflash train --set` for every arm (repeatable)")
    a = p.parse_args()
    arms = dict(parse_arm(t) for t in a.arms)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [x for s in a.store for x in ("--store", s)]
    common += ["--max-steps", str(a.steps), "--no-progress", "--device", "cpu"]
    for s in a.sets:
        common += ["--set", s]
    checkpoints = train_arms(out, arms, common)
    report = json.loads(dflash("eval", "--store", a.held_out, "--json",
                               *map(str, checkpoints.values())))
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    by_path = {Path(c["path"]).resolve(): c["offline"] for c in report["checkpoints"]}
    rows, first_step = [], None
    print(f"{'arm':<24} {'tau (95% CI)':<24} {'slot 1':>7} {'step s':>8} {'ratio':>6}")
    for name, ckpt in checkpoints.items():
        off = by_path[ckpt.resolve()]
        lo, hi = off["tau_ci95"]
        step = median_step_s(out / name)
        first_step = first_step or step
        slot1 = (off.get("cond_accept") or [None])[0]
        rows.append({"arm": name, "settings": extra_text(arms[name]), "tau": off["mean_tau"],
                     "tau_ci95": [lo, hi], "slot1_acceptance": slot1,
                     "median_step_s": step, "blocks": off["n_blocks"]})
        shown = f"{slot1:.3f}" if isinstance(slot1, float) else "n/a"
        print(f"{name:<24} {off['mean_tau']:.3f} [{lo:.3f}, {hi:.3f}]{'':<5} {shown:>7} "
              f"{step:>8.3f} {step / first_step:>5.2f}x")
    (out / "table.json").write_text(json.dumps(rows, indent=2))


def extra_text(sets: list[str]) -> str:
    return ",".join(sets[1::2])


if __name__ == "__main__":
    main()
