"""What answers are worth: held-out tau of the same recipe trained on the answers to the
first train prompts of a `benchmarks.real_target` run, at the same step budget (equal
training time).

    python -m benchmarks.data_vs_tau RUN --fractions 0.125,0.25,0.5,1

Each fraction f keeps the answers to the first f of the run's train prompts, trains the
run's recipe for its step budget with its validation store choosing the checkpoint, and
evaluates that checkpoint on its held-out store. RUN is either a finished run
(`python -m benchmarks.real_target --long --out RUN`: its recipe and stores are used, f = 1
is its own drafter, read back; results in RUN/data_vs_tau) or any other directory: there the
long preset's held-out and validation stores and the answers to the first largest-f of its
train prompts only are extracted first (resumable), so the points below f = 1 never wait
for the full store (results in RUN/data_vs_tau_<that store>). Smaller fractions train on
copies of the train store's first answers. Extract seconds are the measured extract of the
train store used, pro rata by tokens. Writes results.md there and prints it. A benchmark: it
measures.
"""

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line, writable_dir
from benchmarks.real_target import (
    PRESETS,
    RealTargetConfig,
    evaluate_drafter,
    extract_stores,
    prepare,
    train_drafter,
)
from dflash_train.store_schema import open_store
from scripts.prepare_smollm2 import default_cache


def preset_of(run: Path) -> RealTargetConfig:
    """The recipe a real_target run recorded (keys this version no longer has are left out)."""
    recorded = json.loads((run / "results.json").read_text())["config"]
    known = {f.name for f in fields(RealTargetConfig)}
    kept = {k: v for k, v in recorded.items() if k in known}
    if "drafter_layers" in kept:
        kept["drafter_layers"] = tuple(kept["drafter_layers"])
    return RealTargetConfig(**kept)


def train_rows(run: Path) -> int:
    """The run's train prompts (train.jsonl lists them all, however many were extracted)."""
    return sum(1 for _ in (run / "train.jsonl").open())


def first_answers(source: str, source_rows: int, cutoff: int, out: Path) -> str:
    """A store of the answers to the first `cutoff` train prompts, copied out of the train
    store `source` of the first `source_rows` (itself where the two are the same)."""
    from dflash_train.store_schema.subset import copy_store

    if cutoff == source_rows:
        return source
    url = out / f"train_first_{cutoff}.zarr"
    if not url.exists():  # written under another name, renamed when whole
        partial = out / f".{url.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        copy_store(source, str(partial), keep=lambda s: s.source_row < cutoff)
        partial.rename(url)
    return str(url)


def point(cfg: RealTargetConfig, stores: dict[str, str], train: str, where: Path) -> dict:
    """One curve point: the train store's size, its training in `where` and its chosen
    checkpoint's tau."""
    where.mkdir(parents=True, exist_ok=True)
    layers = max(cfg.drafter_layers)
    trained = train_drafter(cfg, train, where, layers, stores["validation"])
    evals, _ = evaluate_drafter(trained, stores["held_out"])
    chosen = evals["chosen_step"]
    kept = open_store(train)
    return {"answers": kept.num_samples, "tokens": kept.num_tokens,
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


def refuse_an_empty_point(rows: int, smallest: float) -> None:
    if round(rows * smallest) < 1:
        raise SystemExit(f"--fractions {smallest:g} of {rows} train prompts keeps none")


def finished_run(run: Path, smallest: float) -> tuple[RealTargetConfig, dict[str, str], float]:
    """(recipe, stores, train store's extract seconds) of a finished real_target run."""
    results = json.loads((run / "results.json").read_text())
    stores = {name: str(run / f"{name}.zarr") for name in ("train", "validation", "held_out")}
    if not Path(stores["validation"]).exists():
        raise SystemExit(f"{run}: a finished run without a validation store (the long "
                         "preset's chooses the checkpoint)")
    refuse_an_empty_point(train_rows(run), smallest)
    return preset_of(run), stores, results["seconds"]["extract_train"]


def prefix_run(run: Path, cache: Path, fractions: list[float]
               ) -> tuple[RealTargetConfig, dict[str, str], float]:
    """(recipe, stores, train store's extract seconds) of the long preset with the answers
    to the first largest of `fractions` of its train prompts only, extracted (or continued)
    in `run`."""
    cfg = PRESETS["long"]
    refuse_an_empty_point(cfg.train_prompts - cfg.val_prompts, fractions[0])
    model, sharegpt = prepare(cache)
    stores, seconds = extract_stores(cfg, run, model, sharegpt, train_share=fractions[-1])
    return cfg, stores, seconds["extract_train"]


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="A finished `benchmarks.real_target --long` "
                        "--out directory, or a directory for the long preset's stores (made "
                        "there: only the train answers the largest fraction needs).")
    parser.add_argument("--fractions", type=fractions_arg, default=[0.125, 0.25, 0.5, 1.0],
                        help="Shares of the train prompts, comma-separated (default: "
                        "0.125,0.25,0.5,1).")
    parser.add_argument("--cache", type=Path, default=default_cache(),
                        help="Where scripts/prepare_smollm2.py keeps the model and data "
                        "(a directory without a finished run only).")
    args = parser.parse_args()
    run, fractions = writable_dir("RUN", args.run.expanduser().resolve()), args.fractions
    if (run / "results.json").is_file():
        cfg, stores, spent = finished_run(run, fractions[0])
        rows = source_rows = train_rows(run)
        out = run / "data_vs_tau"
    else:
        cache = writable_dir("--cache", args.cache.expanduser().resolve())
        cfg, stores, spent = prefix_run(run, cache, fractions)
        # the copies and trainings of one train store apart from those of any other
        rows = train_rows(run)
        source_rows = round(rows * fractions[-1])
        out = run / f"data_vs_tau_{Path(stores['train']).stem}"
    out.mkdir(exist_ok=True)
    points = []
    for f in fractions:
        train = first_answers(stores["train"], source_rows, round(rows * f), out)
        where = run if f == 1 else out / f"f{f:g}"
        points.append({"fraction": f, **point(cfg, stores, train, where)})
        (out / "results.json").write_text(json.dumps(points, indent=1))
    text = markdown(points, spent, open_store(stores["train"]).num_tokens, cfg)
    (out / "results.md").write_text(text)
    print(text)
    print(f"written: {out}/results.json, results.md")


if __name__ == "__main__":
    main()
