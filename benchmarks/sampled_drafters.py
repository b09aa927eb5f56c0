"""Train on greedy or on sampled answers? Two drafters, each held-out temperature.

    python -m benchmarks.sampled_drafters --stores DIR --out OUT       # DIR: real_target --quick's
    python -m benchmarks.sampled_drafters --stores DIR --out OUT --preset full --temperatures 0,1.0

DIR is a `benchmarks.real_target` working directory (train.jsonl/.zarr, held_out.jsonl/.zarr,
run_1L, results.json). The target that made DIR's greedy stores answers the same prompts
again, sampled (extract --regenerate --temperature T --seed S, every other extract setting
read from the greedy store's provenance): the train prompts at --train-temperature, the
held-out prompts at each of --temperatures (T = 0 is DIR/held_out.zarr itself). Two 1-layer
drafters, real_target's recipe and the same steps, one on the greedy train store (DIR/run_1L
when its recipe and steps are these, else trained in OUT), one on the sampled one; both are
evaluated on every held-out store in one `eval` each (the same sequences): chain tau and
DDTree tau @16/32/64 with 95 % intervals.

Writes OUT/results.json, results.md (drafter x held-out temperature x walk) and
tau_by_temperature.png, with the held-out prompts an offline figure at --train-temperature
needs for a +-0.02 interval. Resumable: a complete store is skipped, an incomplete one
continued (extract resumes), a finished run only read back; evaluation always runs. Nothing in
DIR is written. A benchmark: it measures, CI does not run it.
"""

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.driver import package_errors_as_one_line, writable_dir
from benchmarks.real_target import EXTRACT_BATCH_TOKENS, PRESETS, RealTargetConfig, train_drafter

GREEDY_PIECES = ("train.jsonl", "train.zarr", "held_out.jsonl", "held_out.zarr", "results.json")
"""What real_target leaves in its --out; results.json, written last, says it finished."""
LAYERS = 1
"""Drafter depth compared: the quick preset's only one, and the full preset's first."""
BUDGETS = (16, 32, 64)
WALKS = ("chain", *(f"tree@{b}" for b in BUDGETS))
TRAIN_SEED, HELD_OUT_SEED = 0, 1
"""Sampling seeds. The noise is keyed by (seed, source row, position), so a held-out row and
the train row at the same index would share their noise under one seed: two seeds keep them
independent."""
TARGET_HALF_WIDTH = 0.02
"""The interval half-width the needed-prompts estimate aims at."""
NOT_RECIPE = ("eval_every", "fidelity_prompts", "drafter_layers")
"""RealTargetConfig fields that change neither the stores nor a drafter's training."""


@dataclass(frozen=True)
class StoreJob:
    """One sampled store to extract (or finish) from the prompts of a greedy one."""

    prompts: Path
    """DIR's JSONL of the prompts the greedy store answered."""
    store: Path
    """The sampled store, in OUT."""
    temperature: float
    seed: int


@dataclass(frozen=True)
class DrafterJob:
    name: str
    """"greedy" or "T=<train temperature>": how its train store's answers were drawn."""
    train_store: Path
    out: Path
    """Folder holding its run_1L (train_drafter's layout)."""
    reused: bool
    """DIR/run_1L already trained with this recipe and these steps: read, never trained."""


@dataclass(frozen=True)
class Plan:
    cfg: RealTargetConfig
    """real_target's preset with the steps asked for; one checkpoint, at the end."""
    stores: tuple[StoreJob, ...]
    held_out: dict[float, Path]
    """Held-out temperature -> its store (0: DIR/held_out.zarr)."""
    drafters: tuple[DrafterJob, ...]


def label(t: float) -> str:
    return f"T{t:g}"


def parse_temperatures(text: str) -> tuple[float, ...]:
    """'0,0.7,1.0' -> (0.0, 0.7, 1.0): sorted, each once; SystemExit naming a bad one."""
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError as e:
        raise SystemExit(f"--temperatures {text}: {e}") from None
    if not values or not all(0 <= v < math.inf for v in values):
        raise SystemExit(f"--temperatures {text}: give finite temperatures >= 0, e.g. 0,0.7")
    return tuple(values)


def greedy_results(stores: Path, preset: str) -> dict:
    """DIR's results.json, once every greedy piece is there and it is of `preset`; else
    SystemExit with the command that makes them."""
    flag = " --quick" if preset == "quick" else ""
    missing = [name for name in GREEDY_PIECES if not (stores / name).exists()]
    if missing:
        raise SystemExit(f"--stores {stores}: no {', '.join(missing)}; make them with "
                         f"`python -m benchmarks.real_target{flag} --out {stores}`")
    results = json.loads((stores / "results.json").read_text())
    if results.get("preset") != preset:
        raise SystemExit(f"--stores {stores} holds real_target's {results.get('preset')} "
                         f"preset, not {preset}: pass --preset {results.get('preset')}")
    return results


def recipe(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in NOT_RECIPE}


def greedy_run_matches(stores: Path, results: dict, cfg: RealTargetConfig) -> bool:
    """Whether DIR/run_1L trained with `cfg`'s recipe and steps and holds that last step."""
    from dflash_train.run_layout import checkpoint_dir
    from dflash_train.run_reader import complete_checkpoints

    run = stores / f"run_{LAYERS}L"
    made = results.get("config", {})
    same = recipe(made) == recipe(json.loads(json.dumps(asdict(cfg))))
    return (same and LAYERS in made.get("drafter_layers", ()) and
            checkpoint_dir(run, cfg.steps) in complete_checkpoints(run))


def make_plan(stores: Path, out: Path, results: dict, temperatures: tuple[float, ...],
              train_t: float, steps: int) -> Plan:
    """Which stores are extracted, which drafters trained, and on what each is evaluated."""
    cfg = replace(PRESETS[results["preset"]], steps=steps, eval_every=steps)
    jobs = [StoreJob(stores / "train.jsonl", out / f"train_{label(train_t)}.zarr", train_t,
                     TRAIN_SEED)]
    held = {}
    for t in temperatures:
        if t == 0:
            held[t] = stores / "held_out.zarr"
            continue
        jobs.append(StoreJob(stores / "held_out.jsonl", out / f"held_out_{label(t)}.zarr", t,
                             HELD_OUT_SEED))
        held[t] = jobs[-1].store
    reuse = greedy_run_matches(stores, results, cfg)
    drafters = (DrafterJob("greedy", stores / "train.zarr", stores if reuse else out / "greedy",
                           reuse),
                DrafterJob(f"T={train_t:g}", jobs[0].store, out / f"sampled_{label(train_t)}",
                           False))
    return Plan(cfg, tuple(jobs), held, drafters)


def extract_config(greedy: str, job: StoreJob):
    """The sampled job's ExtractConfig: every setting that shapes the answers or the stored
    states read from the greedy store's provenance, so only the sampling differs."""
    from dflash_train.extract.config import ExtractConfig
    from dflash_train.store_schema import open_store
    from dflash_train.target_model.sampling import SamplingConfig

    meta = open_store(greedy).meta
    return ExtractConfig(
        model=meta.target.name_or_path, data=[str(job.prompts)], out=str(job.store),
        layers=",".join(map(str, meta.context_layer_ids)), top_k=meta.top_k,
        max_length=meta.source.max_length, overlong=meta.extra["overlong"],
        rows_per_part=meta.extra["rows_per_part"], device="cpu", dtype=meta.hidden_dtype,
        regenerate=True, max_new_tokens=meta.extra["max_new_tokens"],
        batch_tokens=EXTRACT_BATCH_TOKENS,
        sampling=SamplingConfig(temperature=job.temperature, seed=job.seed))


def is_complete(job: StoreJob) -> bool:
    """The job's store is whole; one there sampled otherwise is refused, naming both."""
    from dflash_train.store_schema import StoreError, open_store
    from dflash_train.store_schema.info import summarize

    try:
        store = open_store(str(job.store))
    except StoreError:  # not there, or cut short before it could be read: extract decides
        return False
    wanted = {"temperature": job.temperature, "seed": job.seed}
    drawn = store.meta.sampling or {}
    if {k: drawn.get(k) for k in wanted} != wanted:
        raise SystemExit(f"{job.store} holds answers sampled with {drawn or 'greedy'}, not "
                         f"{wanted}: delete it to redo it")
    s = summarize(store)
    return (s.parts_complete == s.parts_planned and not s.frozen_unfinished
            and not s.parts_damaged)


def build_stores(plan: Plan, greedy_dir: Path) -> dict[str, float]:
    """Extract (or continue) every sampled store not complete yet; seconds of this sitting."""
    from dflash_train.extract.pipeline import run_extract

    seconds = {}
    for job in plan.stores:
        if is_complete(job):
            print(f"{job.store.name}: complete, kept")
            continue
        greedy = greedy_dir / job.prompts.with_suffix(".zarr").name
        start = time.perf_counter()
        summary = run_extract(extract_config(str(greedy), job), echo=print)
        print(summary.lines()[0])
        seconds[f"extract {job.store.name}"] = time.perf_counter() - start
    return seconds


def train_drafters(plan: Plan) -> dict[str, Path]:
    """Each drafter's last checkpoint, training (or finishing) the ones not reused."""
    from dflash_train.run_layout import checkpoint_dir

    checkpoints = {}
    for d in plan.drafters:
        if not d.reused:
            print(f"training the drafter on {d.name} answers in {d.out}")
            train_drafter(plan.cfg, str(d.train_store), d.out, LAYERS)
        checkpoints[d.name] = checkpoint_dir(d.out / f"run_{LAYERS}L", plan.cfg.steps)
    return checkpoints


def evaluate_store(held: Path, checkpoints: dict[str, Path]) -> dict[str, dict]:
    """{drafter: {"prompts": n, walk: {"tau", "ci95", "blocks"}}}: one eval of every drafter
    on `held`, so they draft the same sequences."""
    from dflash_train.evaluate.config import EvalSettings
    from dflash_train.evaluate.pipeline import EvalConfig, run_eval

    config = EvalConfig(store=str(held), checkpoints=[str(c) for c in checkpoints.values()],
                        device="cpu", settings=EvalSettings(tree_budgets=BUDGETS))
    outcome = run_eval(config, echo=lambda _: None)
    report, figures = outcome.report, {}
    for name, column in zip(checkpoints, report["checkpoints"], strict=True):
        offline = column["offline"]
        walks = {"chain": (offline["mean_tau"], offline["tau_ci95"], offline["n_blocks"])}
        for b in BUDGETS:
            tree = offline["tree"][str(b)]
            walks[f"tree@{b}"] = (tree["mean_tau"], tree["tau_ci95"], tree["rounds"])
        figures[name] = {"prompts": report["samples"],
                         **{w: {"tau": t, "ci95": ci, "blocks": n}
                            for w, (t, ci, n) in walks.items()}}
    return figures


def prompts_needed(half_width: float | None, prompts: int,
                   target: float = TARGET_HALF_WIDTH) -> int | None:
    """Prompts for a half-width of `target`, if it shrinks as 1/sqrt(prompts): an estimate
    (eval's interval is over blocks, and blocks grow with the prompts)."""
    if half_width is None:
        return None
    return math.ceil(round(prompts * (half_width / target) ** 2, 6))


def needed_at(evals: dict, temperature: float) -> dict[str, dict[str, int | None]]:
    """{drafter: {walk: prompts for +-0.02}} from the evals at held-out `temperature`."""
    needed = {}
    for drafter, by_t in evals.items():
        figures = by_t[str(temperature)]
        needed[drafter] = {w: prompts_needed(None if figures[w]["ci95"] is None else
                                             (figures[w]["ci95"][1] - figures[w]["ci95"][0]) / 2,
                                             figures["prompts"]) for w in WALKS}
    return needed


def cell(figure: dict) -> str:
    ci = figure["ci95"]
    return f"{figure['tau']:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")


def markdown(results: dict) -> str:
    temps = results["temperatures"]
    lines = [f"SmolLM2-135M-Instruct, real_target's {results['preset']} preset, "
             f"{results['steps']} steps per 1-layer drafter, {results['date']}: held-out tau "
             f"(95 % CI) by the temperature the held-out answers were sampled at.\n",
             "| trained on | " + " | ".join(f"T={t:g} {w}" for t in temps for w in WALKS) + " |",
             "|---|" + "---|" * (len(temps) * len(WALKS))]
    for drafter, by_t in results["evals"].items():
        cells = [cell(by_t[str(t)][w]) for t in temps for w in WALKS]
        lines.append(f"| {drafter} | " + " | ".join(cells) + " |")
    need = results["prompts_for_0.02"]
    if need:
        worst = max((n for walks in need["by_drafter"].values() for n in walks.values()
                     if n is not None), default=None)
        lines.append(f"\nAn offline figure at T={need['temperature']:g} needs about {worst} "
                     f"held-out prompts for a +-{TARGET_HALF_WIDTH} interval (the most of any "
                     f"drafter and walk, from {need['prompts']} prompts; an estimate assuming "
                     "the half-width shrinks as 1/sqrt(prompts)).")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = results["temperatures"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (drafter, by_t) in enumerate(results["evals"].items()):
        for j, walk in enumerate(WALKS):
            figures = [by_t[str(t)][walk] for t in temps]
            taus = [f["tau"] for f in figures]
            errors = [[t - (f["ci95"] or (t, t))[0] for t, f in zip(taus, figures, strict=True)],
                      [(f["ci95"] or (t, t))[1] - t for t, f in zip(taus, figures, strict=True)]]
            # the drafters side by side at each temperature, their intervals apart
            x = [t + 0.01 * (2 * i - 1) for t in temps]
            ax.errorbar(x, taus, yerr=errors, color=f"C{j}", linestyle="-:"[i % 2],
                        marker="os"[i % 2], capsize=2, label=f"trained on {drafter}, {walk}")
    ax.set_xlabel("temperature of the held-out answers")
    ax.set_ylabel("mean acceptance length (tau), held-out")
    ax.set_title(f"Drafters trained on greedy vs sampled answers ({results['steps']} steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def where(path: Path, stores: Path, out: Path) -> str:
    """A path as results.json records it: under --stores or --out, never the machine's."""
    for flag, root in (("--out", out), ("--stores", stores)):
        if path.resolve().is_relative_to(root.resolve()):
            return f"{flag}/{path.resolve().relative_to(root.resolve()).as_posix()}"
    return str(path)


def run(plan: Plan, stores: Path, out: Path, preset: str) -> dict:
    seconds = build_stores(plan, stores)
    start = time.perf_counter()
    checkpoints = train_drafters(plan)
    seconds["train (this sitting)"] = time.perf_counter() - start
    evals = {name: {} for name in checkpoints}
    for t, held in plan.held_out.items():
        start = time.perf_counter()
        for name, figures in evaluate_store(held, checkpoints).items():
            evals[name][str(t)] = figures
        seconds[f"eval {label(t)}"] = time.perf_counter() - start
    train_t = plan.stores[0].temperature
    at = train_t if train_t in plan.held_out else max(plan.held_out)
    need = {"temperature": at, "prompts": next(iter(evals.values()))[str(at)]["prompts"],
            "by_drafter": needed_at(evals, at)} if at > 0 else None
    results = {"date": time.strftime("%Y-%m-%d"), "preset": preset, "steps": plan.cfg.steps,
               "train_temperature": train_t, "temperatures": list(plan.held_out),
               "seeds": {"train": TRAIN_SEED, "held_out": HELD_OUT_SEED},
               "drafters": {d.name: {"train_store": where(d.train_store, stores, out),
                                     "checkpoint": where(checkpoints[d.name], stores, out),
                                     "reused": d.reused} for d in plan.drafters},
               "held_out_stores": {str(t): where(p, stores, out)
                                   for t, p in plan.held_out.items()},
               "evals": evals, "prompts_for_0.02": need, "seconds": seconds}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "tau_by_temperature.png")
    return results


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", type=Path, required=True,
                        help="A `benchmarks.real_target` --out directory of --preset: its "
                             "prompts, greedy stores and run are read, never written.")
    parser.add_argument("--out", type=Path, required=True,
                        help="Working directory: the sampled stores, runs and results.")
    parser.add_argument("--preset", choices=("quick", "full"), default="quick",
                        help="The real_target preset DIR was made with; its recipe trains.")
    parser.add_argument("--temperatures", default="0,0.7,1.0",
                        help="Held-out answer temperatures, comma-separated (0: greedy).")
    parser.add_argument("--train-temperature", type=float, default=0.7,
                        help="Temperature of the sampled train store's answers (> 0).")
    parser.add_argument("--steps", type=int, default=None,
                        help="Steps per drafter (default: DIR's run's, so it is reused).")
    args = parser.parse_args()
    temperatures = parse_temperatures(args.temperatures)
    if not 0 < args.train_temperature < math.inf:
        parser.error(f"--train-temperature must be > 0, got {args.train_temperature}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    stores = args.stores.expanduser().resolve()
    results = greedy_results(stores, args.preset)
    if args.out.expanduser().resolve() == stores:
        parser.error("--out must differ from --stores: DIR's own results would be replaced")
    out = writable_dir("--out", args.out.expanduser().resolve())
    plan = make_plan(stores, out, results, temperatures, args.train_temperature,
                     args.steps or results["config"]["steps"])
    done = run(plan, stores, out, args.preset)
    print(markdown(done))
    print(f"written: {out}/results.json, results.md, tau_by_temperature.png")


if __name__ == "__main__":
    main()
