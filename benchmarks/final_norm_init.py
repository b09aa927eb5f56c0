"""A new drafter's final-norm init before and after, on SmolLM2-135M-Instruct at equal steps.

    python -m benchmarks.final_norm_init             # the quick preset's stores and recipe
    python -m benchmarks.final_norm_init --steps 300

Two runs that differ only in `model.final_norm_init` (drafter.model.FinalNormInit): `ones`,
HF's init, what every drafter trained with before, and `unit`, the default. They start from
the same weights but the final norm's, so their untrained drafters draft the same.

The stores and the recipe are `real_target.py --quick`'s: 96 train / 16 held-out ShareGPT
first turns answered by the target (64 new tokens), kept in the same working directory, so
either script extracts them once and the other continues or reuses them; a 1-layer drafter,
150 steps, lr 3e-3, Muon, D-PACE, a 4,096-word draft vocabulary, seed 0, a checkpoint every
50 steps. Both untrained drafters and every checkpoint of both runs are evaluated on the
held-out store in one eval, so every drafter drafts the same sequences.

Prints, and writes as final_norm_init.json and .md into the working directory: per init, the
loss at steps 1 (the new drafter's: the step's forward runs before its update), 10, 50 and
the last, beside ln V of the draft vocabulary, and the held-out tau with its 95 % interval at
step 0 and at every checkpoint. A re-run continues the runs from their last checkpoint. A
benchmark: it measures, CI does not run it.
"""

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line, writable_dir
from benchmarks.real_target import (
    PRESETS,
    RealTargetConfig,
    evaluate,
    extract,
    first_turn_prompts,
    prepare,
    prompt_sets,
    train_config,
    write_prompts,
)
from scripts.prepare_smollm2 import default_cache

INITS = ("ones", "unit")
"""model.final_norm_init of the two runs: HF's init (before) and the default (after)."""
LOSS_STEPS = (1, 10, 50)
"""Steps whose training loss is reported, with the last."""


def quick_stores(cfg: RealTargetConfig, out: Path, cache: Path) -> dict[str, str]:
    """{'train': url, 'held_out': url}: real_target.py's stores for `cfg`, in `out`,
    extracted there unless already whole (extract continues a partial one)."""
    model, sharegpt = prepare(cache)
    sets = prompt_sets(*first_turn_prompts(sharegpt, cfg), cfg.val_prompts)
    stores = {}
    for name, prompts in sets.items():
        stores[name] = str(out / f"{name}.zarr")
        extract(model, write_prompts(prompts, out / f"{name}.jsonl"), stores[name], cfg,
                out / "extract_seconds.json")
    return stores


def init_config(cfg: RealTargetConfig, store: str, out: Path, init: str):
    """The preset's train config for its first drafter depth, with this final-norm init."""
    tc = train_config(cfg, store, out / f"run_{init}", cfg.drafter_layers[0])
    return replace(tc, model=replace(tc.model, final_norm_init=init))


def train_init(cfg: RealTargetConfig, store: str, out: Path, init: str) -> dict:
    """Train (or continue) one init's run, its untrained drafter saved beside it first:
    {"loss": {step: loss}, "checkpoints": {step: drafter path}, "ln_v": ln(draft vocab)}."""
    from dflash_train.drafter import read_drafter_config
    from dflash_train.quickstart import save_untrained
    from dflash_train.run_layout import CHECKPOINTS, CONFIG_NAME, checkpoint_dir
    from dflash_train.train.log_summary import read_log
    from dflash_train.train.loop import train

    tc = init_config(cfg, store, out, init)
    run_dir = Path(tc.run.out_dir)
    untrained = out / f"untrained_{init}"
    if not (untrained / CONFIG_NAME).is_file():
        save_untrained(tc, untrained)
    train(tc, resume=(run_dir / CHECKPOINTS).is_dir())
    losses = {r.step: r.loss for r in read_log(run_dir)}
    steps = max(losses)
    saved = sorted({*range(cfg.eval_every, steps + 1, cfg.eval_every), steps})
    return {"loss": losses, "ln_v": math.log(read_drafter_config(untrained).draft_vocab),
            "checkpoints": {0: str(untrained),
                            **{s: str(checkpoint_dir(run_dir, s)) for s in saved}}}


def compare(cfg: RealTargetConfig, stores: dict[str, str], out: Path) -> dict:
    """Both inits trained on stores["train"], every drafter evaluated on stores["held_out"]
    in one eval; the results as final_norm_init.json holds them."""
    runs = {init: train_init(cfg, stores["train"], out, init) for init in INITS}
    drafters = {(init, step): path for init, run in runs.items()
                for step, path in run["checkpoints"].items()}
    taus, eval_seconds = evaluate(stores["held_out"], drafters)
    last = max(runs[INITS[0]]["loss"])
    report_steps = [s for s in LOSS_STEPS if s < last] + [last]
    return {"date": time.strftime("%Y-%m-%d"), "config": asdict(cfg), "stores": stores,
            "ln_v": runs[INITS[0]]["ln_v"], "eval_seconds": eval_seconds,
            "inits": {init: {"loss": {str(s): run["loss"][s] for s in report_steps},
                             "held_out": {str(step): {"tau": taus[(init, step)]["tau"],
                                                      "tau_ci95": taus[(init, step)]["tau_ci95"]}
                                          for step in run["checkpoints"]}}
                      for init, run in runs.items()}}


def markdown(results: dict) -> str:
    cfg, inits = results["config"], results["inits"]
    first = next(iter(inits.values()))
    loss_steps, tau_steps = list(first["loss"]), list(first["held_out"])
    lines = [f"model.final_norm_init on SmolLM2-135M-Instruct, {results['date']}: "
             f"{cfg['train_prompts']} train / {cfg['held_out_prompts']} held-out prompts, "
             f"{cfg['steps']} steps, ln V = {results['ln_v']:.2f} (draft vocabulary "
             f"{cfg['draft_vocab_size'] or 'all'}).\n",
             "| init | " + " | ".join(f"loss @{s}" for s in loss_steps) + " | "
             + " | ".join(f"held-out tau @{s} (95 % CI)" for s in tau_steps) + " |",
             "|---" * (1 + len(loss_steps) + len(tau_steps)) + "|"]
    for init, r in inits.items():
        taus = []
        for step in tau_steps:
            t = r["held_out"][step]
            ci = t["tau_ci95"]
            taus.append(f"{t['tau']:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else ""))
        lines.append(f"| {init} | " + " | ".join(f"{r['loss'][s]:.2f}" for s in loss_steps)
                     + " | " + " | ".join(taus) + " |")
    return "\n".join(lines) + "\n"


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="Working directory (default: <cache>/real_target_quick, where "
                        "real_target.py --quick keeps the same stores).")
    parser.add_argument("--cache", type=Path, default=default_cache(),
                        help="Where scripts/prepare_smollm2.py keeps the model and data.")
    parser.add_argument("--steps", type=int, default=None,
                        help="Steps of both runs (default: the quick preset's 150).")
    args = parser.parse_args()
    cfg = PRESETS["quick"]
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be at least 1, got {args.steps}")
        cfg = replace(cfg, steps=args.steps, eval_every=min(cfg.eval_every, args.steps))
    cache = args.cache.expanduser().resolve()
    out = writable_dir("--out", (args.out or cache / "real_target_quick").expanduser().resolve())
    results = compare(cfg, quick_stores(cfg, out, cache), out)
    (out / "final_norm_init.json").write_text(json.dumps(results, indent=1))
    (out / "final_norm_init.md").write_text(markdown(results))
    print(markdown(results))
    print(f"written: {out}/final_norm_init.json, final_norm_init.md")


if __name__ == "__main__":
    main()
