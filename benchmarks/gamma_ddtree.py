"""Does the loss weight gamma help DDTree? Decay gamma 4, 7, 10 and D-PACE at equal steps.

    python -m benchmarks.gamma_ddtree --stores DIR --out OUT   # DIR: real_target.py --long's
    python -m benchmarks.gamma_ddtree --preset full --steps 200 --stores DIR --out OUT

Trains one 1-layer drafter per position weighting and seed with real_target.py's recipe (Muon,
4,096-word draft vocabulary, bf16 auto, warmup + cosine over --steps) on DIR/train.zarr, then
evaluates each one's last checkpoint on DIR/held_out.zarr: chain tau and DDTree tau at 16,
32 and 64 nodes, each tree decoded as its own walk (the next anchor is a + the tree's tau, as
a tree decoder moves on), with 95 % intervals. Writes gamma.json, gamma.md and gamma.png into
OUT. Resumable: a finished run is only evaluated; `--no-eval` trains only. A benchmark:
it measures, CI does not run it.
"""

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line, writable_dir
from benchmarks.real_target import PRESETS, train_drafter

ARMS = {"decay gamma 4": ("decay", 4.0), "decay gamma 7": ("decay", 7.0),
        "decay gamma 10": ("decay", 10.0), "D-PACE": ("dpace", 4.0)}
"""Arm -> (loss.position_weights, gamma); gamma acts under decay only."""
BUDGETS = (16, 32, 64)


def arm_dir(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm.replace(' ', '_').lower()}_seed{seed}"


def train_arm(stores: Path, out: Path, arm: str, seed: int, steps: int,
              preset: str = "long") -> dict:
    weights, gamma = ARMS[arm]
    cfg = replace(PRESETS[preset], steps=steps, eval_every=steps, position_weights=weights,
                  gamma=gamma, seed=seed)
    return train_drafter(cfg, str(stores / "train.zarr"), arm_dir(out, arm, seed), 1)


def evaluate_arm(held: str, checkpoint: str) -> dict:
    from dflash_train.evaluate.config import EvalSettings
    from dflash_train.evaluate.pipeline import EvalConfig, run_eval

    start = time.perf_counter()
    outcome = run_eval(EvalConfig(store=held, checkpoints=[checkpoint], device="cpu",
                                  settings=EvalSettings(tree_budgets=BUDGETS)),
                       echo=lambda _: None)
    offline = outcome.report["checkpoints"][0]["offline"]
    walks = {"chain": (offline["mean_tau"], offline["tau_ci95"], offline["n_blocks"])}
    for b in BUDGETS:
        tree = offline["tree"][str(b)]
        walks[f"tree@{b}"] = (tree["mean_tau"], tree["tau_ci95"], tree["rounds"])
    return {"walks": walks, "eval_seconds": time.perf_counter() - start}


def markdown(results: dict) -> str:
    walks = ["chain", *(f"tree@{b}" for b in BUDGETS)]
    lines = [f"SmolLM2-135M-Instruct drafters, {results['steps']} steps each, held-out "
             f"{results['held_out']}, {results['date']}: mean tau (95 % CI)\n",
             "| arm | seed | " + " | ".join(walks) + " |", "|---|---|" + "---|" * len(walks)]
    for run in results["runs"]:
        cells = [f"{tau:.3f} ({lo:.3f}-{hi:.3f})" for tau, (lo, hi), _ in
                 (run["walks"][w] for w in walks)]
        lines.append(f"| {run['arm']} | {run['seed']} | " + " | ".join(cells) + " |")
    lines.append("\nmean over seeds:\n")
    lines.append("| arm | " + " | ".join(walks) + " | tree@64 / chain |")
    lines.append("|---|" + "---|" * (len(walks) + 1))
    for arm in ARMS:
        runs = [r for r in results["runs"] if r["arm"] == arm]
        if not runs:
            continue
        means = [sum(r["walks"][w][0] for r in runs) / len(runs) for w in walks]
        lines.append(f"| {arm} | " + " | ".join(f"{m:.3f}" for m in means) +
                     f" | {means[-1] / means[0]:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    walks = ["chain", *(f"tree@{b}" for b in BUDGETS)]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, arm in enumerate(ARMS):
        for run in (r for r in results["runs"] if r["arm"] == arm):
            taus = [run["walks"][w][0] for w in walks]
            errors = [[t - run["walks"][w][1][0] for t, w in zip(taus, walks, strict=True)],
                      [run["walks"][w][1][1] - t for t, w in zip(taus, walks, strict=True)]]
            x = [j + 0.08 * (i - 1.5) for j in range(len(walks))]
            ax.errorbar(x, taus, yerr=errors, marker="os"[run["seed"] % 2], capsize=2,
                        color=f"C{i}", linestyle="-" if run["seed"] == 0 else ":",
                        label=f"{arm} (seed {run['seed']})")
    ax.set_xticks(range(len(walks)), walks)
    ax.set_ylabel("mean acceptance length (tau), held-out")
    ax.set_title(f"SmolLM2 drafters: position weighting vs DDTree ({results['steps']} steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", type=Path, required=True,
                        help="A `real_target.py` working directory of --preset: its "
                             "train.zarr and held_out.zarr are read.")
    parser.add_argument("--preset", choices=("long", "full"), default="long",
                        help="The real_target.py preset whose recipe trains the arms "
                             "(its stores are --stores).")
    parser.add_argument("--out", type=Path, required=True, help="Working directory.")
    parser.add_argument("--steps", type=int, default=800, help="Steps per drafter.")
    parser.add_argument("--seeds", type=int, default=2, help="Seeds per arm (0, 1, ...).")
    parser.add_argument("--no-eval", action="store_true", help="Train only.")
    args = parser.parse_args()
    for name in ("train.zarr", "held_out.zarr"):
        if not (args.stores / name).is_dir():
            flag = " --long" if args.preset == "long" else ""
            parser.error(f"--stores {args.stores}: no {name} (run "
                         f"`python -m benchmarks.real_target{flag} --out DIR` first)")
    if args.steps < 1 or args.seeds < 1:
        parser.error("--steps and --seeds must be at least 1")
    args.out = writable_dir("--out", args.out.resolve())
    runs = []
    for seed in range(args.seeds):
        for arm in ARMS:
            trained = train_arm(args.stores, args.out, arm, seed, args.steps, args.preset)
            checkpoint = Path(trained["checkpoints"][trained["steps"]])
            runs.append({"arm": arm, "seed": seed, "train_seconds": trained["train_seconds"],
                         "checkpoint": str(checkpoint.relative_to(args.out.resolve()))})
    if args.no_eval:
        return
    held = str(args.stores / "held_out.zarr")
    for run in runs:
        run.update(evaluate_arm(held, str(args.out.resolve() / run["checkpoint"])))
    results = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps,
               "held_out": f"held_out.zarr of real_target.py's {args.preset} preset",
               "budgets": list(BUDGETS), "runs": runs}
    (args.out / "gamma.json").write_text(json.dumps(results, indent=1))
    (args.out / "gamma.md").write_text(markdown(results))
    plot(results, args.out / "gamma.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
