"""What answers are worth: held-out tau of the same recipe trained on the first part of a
`benchmarks.real_target` run's train store, at the same step budget (equal training time).

    python -m benchmarks.real_target --long --out RUN          # the stores and the full run
    python -m benchmarks.data_vs_tau RUN --fractions 0.125,0.25,0.5,1

Each fraction f keeps the answers to the first f of the run's train prompts (a store copy;
f = 1 is the run's own drafter, read back), trains the run's recipe for its step budget with
its validation store choosing the checkpoint, and evaluates that checkpoint on its held-out
store. Extract seconds are the run's measured extract of the whole train store, pro rata by
tokens. Writes RUN/data_vs_tau/results.md and prints it. A benchmark: it measures.
"""

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line
from benchmarks.real_target import RealTargetConfig, evaluate_drafter, train_drafter
from dflash_train.store_schema import open_store


def preset_of(run: Path) -> RealTargetConfig:
    """The recipe a real_target run recorded (keys this version no longer has are left out)."""
    recorded = json.loads((run / "results.json").read_text())["config"]
    known = {f.name for f in fields(RealTargetConfig)}
    kept = {k: v for k, v in recorded.items() if k in known}
    if "drafter_layers" in kept:
        kept["drafter_layers"] = tuple(kept["drafter_layers"])
    return RealTargetConfig(**kept)


def first_answers(run: Path, fraction: float, out: Path) -> str:
    """A store of the answers to the first `fraction` of the run's train prompts."""
    from dflash_train.store_schema.subset import copy_store

    if fraction == 1:
        return str(run / "train.zarr")
    rows = sum(1 for _ in (run / "train.jsonl").open())
    cutoff = round(rows * fraction)
    if cutoff < 1:
        raise SystemExit(f"--fractions {fraction:g} of {rows} train prompts keeps none")
    url = out / f"train_first_{cutoff}.zarr"
    if not url.exists():  # written under another name, renamed when whole
        partial = out / f".{url.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        copy_store(str(run / "train.zarr"), str(partial), keep=lambda s: s.source_row < cutoff)
        partial.rename(url)
    return str(url)


def point(run: Path, cfg: RealTargetConfig, fraction: float, out: Path) -> dict:
    """One curve point: the subset's size, its training and its chosen checkpoint's tau."""
    store = first_answers(run, fraction, out)
    where = run if fraction == 1 else out / f"f{fraction:g}"
    where.mkdir(parents=True, exist_ok=True)
    layers = max(cfg.drafter_layers)
    trained = train_drafter(cfg, store, where, layers, str(run / "validation.zarr"))
    evals, _ = evaluate_drafter(trained, str(run / "held_out.zarr"))
    chosen = evals["chosen_step"]
    kept = open_store(store)
    return {"fraction": fraction, "answers": kept.num_samples, "tokens": kept.num_tokens,
            "train_seconds": trained["train_seconds"], "chosen_step": chosen,
            "held_out": evals["eval"][chosen], "last": evals["eval"][trained["steps"]]}


def markdown(points: list[dict], extract_seconds: float, full_tokens: int,
             cfg: RealTargetConfig) -> str:
    """The curve's table; `extract_seconds` took the whole store's `full_tokens`."""
    lines = [f"Same recipe ({cfg.steps} steps, checkpoint chosen on validation), first answers "
             "of one train store:\n",
             "| answers | tokens | extract s (pro rata) | train s | chosen step | "
             "held-out tau (95 % CI) | last step's tau |", "|---|---|---|---|---|---|---|"]
    for p in points:
        held, ci = p["held_out"], p["held_out"].get("tau_ci95") or (float("nan"),) * 2
        lines.append(f"| {p['answers']:,} | {p['tokens']:,} | "
                     f"{extract_seconds * p['tokens'] / full_tokens:,.0f} | "
                     f"{p['train_seconds']:,.0f} | {p['chosen_step']} | {held['tau']:.3f} "
                     f"({ci[0]:.3f}-{ci[1]:.3f}) | {p['last']['tau']:.3f} |")
    return "\n".join(lines) + "\n"


def fractions_arg(text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers, got {text!r}") from None
    if not values or values[0] <= 0 or values[-1] > 1:
        raise argparse.ArgumentTypeError(f"each fraction in (0, 1], got {text!r}")
    return values


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="A benchmarks.real_target --out directory "
                        "with a validation store (the long preset's).")
    parser.add_argument("--fractions", type=fractions_arg, default=[0.125, 0.25, 0.5, 1.0],
                        help="Shares of the train prompts, comma-separated (default: "
                        "0.125,0.25,0.5,1).")
    args = parser.parse_args()
    results = args.run / "results.json"
    if not results.is_file() or not (args.run / "validation.zarr").exists():
        parser.error(f"{args.run}: no finished real_target run with a validation store "
                     "(results.json, validation.zarr)")
    cfg, out = preset_of(args.run), args.run / "data_vs_tau"
    spent = json.loads(results.read_text())["seconds"]["extract_train"]
    full_tokens = open_store(str(args.run / "train.zarr")).num_tokens
    out.mkdir(exist_ok=True)
    points = [point(args.run, cfg, f, out) for f in args.fractions]
    text = markdown(points, spent, full_tokens, cfg)
    (out / "results.json").write_text(json.dumps(points, indent=1))
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
