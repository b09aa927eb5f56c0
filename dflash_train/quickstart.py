"""`dflash quickstart`: the whole pipeline on the embedded tiny target, on a CPU, in minutes.

Owns the quickstart's settings and the order of its stages: extract the embedded train and
held-out prompts with --regenerate (the stored responses are the target's own greedy text)
-> save the untrained drafter (the seeded initial weights) -> train -> eval both side by
side on the held-out store, and again on its answers that do not loop (a drafter learns a
looping target's loops easily; this shows the gain is not only that) -> print the commands
that do the same on a real model. Every stage is the same entry point its CLI command calls
(run_extract, train, run_eval); this module never re-implements a stage and never reads or
writes anything outside `out`.

Extract and train run as one process per usable core (`dflash_train.ranks`): a 3M-parameter
model's ops are too small for torch's intra-op threads to share well: two threads on two cores
did less than two ranks, and far less whenever anything else ran beside them.
"""

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import click

from dflash_train.assets.embedded import prompt_file, target_dir
from dflash_train.assets.stdlib_corpus import repeated_ngram_share
from dflash_train.blocks import MAX_SEED
from dflash_train.errors import reported_as_one_line
from dflash_train.ranks import extract_rank, in_ranks, stage_ranks, train_rank

REAL_MODEL_COMMANDS = """\
The same on a real target (one GPU machine for extract; any GPU for train and eval):

  dflash extract --model Qwen/Qwen3.6-27B --data chats.jsonl --out hs.zarr --regenerate \\
      --max-new-tokens 1024 --max-length 4096
  dflash extract --model Qwen/Qwen3.6-27B --data held_out.jsonl --out held_out.zarr \\
      --regenerate --max-new-tokens 1024
  dflash train --store hs.zarr --out runs/d1
  dflash eval --store held_out.zarr runs/d1/checkpoints/step_* z-lab/Qwen3.6-27B-DFlash
  dflash export runs/d1/checkpoints/step_<last> out/Qwen3.6-27B-DFlash

(omit --data to extract the embedded coding prompts this quickstart used)"""


TRAIN_ROWS_PER_PART = 256
HELD_OUT_ROWS_PER_PART = 32
"""Rows per extract part: every rank gets parts of both stores (a part is one rank's unit)."""

LOOP_FREE_SHARE = 0.2
"""An answer "does not loop" when at most this share of its 4-grams repeat an earlier one
(96-token windows of real held-out stdlib code: 6.8 %)."""


@dataclass
class QuickstartConfig:
    """What `dflash quickstart` runs; the defaults finish in under 5 minutes on 2 cores."""

    out: str = "dflash-quickstart"
    """Working directory: prompt subsets, both stores, the untrained drafter, the run, eval."""
    train_prompts: int = 1024
    """Embedded train prompts to extract (at most the set's size)."""
    held_out_prompts: int = 64
    """Embedded held-out prompts to extract and evaluate on."""
    max_new_tokens: int = 64
    """Tokens the target generates per prompt (--regenerate)."""
    drafter_layers: int = 1
    """Drafter decoder layers."""
    epochs: int = 6
    """Passes of drafter training over the train store. 9 (684 steps, 1.56x the time) gave
    held-out tau 1.448 against 6's 1.446 (Muon, D-PACE): the small store is spent by then."""
    max_steps: int | None = None
    """Stop training after this many steps (the schedule still spans `epochs`)."""
    lr: float = 6e-3
    """Peak learning rate of the drafter (high: a tiny drafter, a few hundred steps)."""
    optimizer: Literal["adamw", "muon"] = "muon"
    """Muon on the drafter's matrices (AdamW on the rest). Held-out tau 1.409 vs AdamW's
    1.319 at the same 455 steps on one pair of stores (both with decay gamma 2)."""
    position_weights: Literal["decay", "dpace"] = "dpace"
    """D-PACE loss weights (from the drafter's own confidence). With Muon, held-out tau 1.446
    (1.411-1.480) vs 1.409 (1.378-1.441) under decay gamma 2, same stores and steps ("decay"
    here takes the trainer's default gamma)."""
    batch_tokens: int = 4096
    """Padded tokens per training batch."""
    anchors_per_seq: int = 24
    """Blocks per sequence per epoch. 24 trains in 0.63x the time of 32 to the same held-out
    tau (1.311 vs 1.307; 16: 0.51x, 1.305), measured side by side on one pair of stores."""
    seed: int = 0
    """Seeds the drafter's initial weights, the data order and the anchors."""
    progress: bool = True
    """Show progress bars."""


@dataclass
class QuickstartResult:
    """What a quickstart measured."""

    untrained_tau: float
    """Held-out mean acceptance length of the initial (untrained) drafter."""
    trained_tau: float
    """Held-out mean acceptance length of the trained drafter."""
    report: dict
    """The eval report (both checkpoints)."""
    repeated_4gram_share: float
    """Share of the stored responses' 4-grams that repeat an earlier one (target looping)."""
    loop_free: dict | None = None
    """Held-out answers that do not loop: samples, of, untrained_tau, trained_tau (None when
    there are none)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage."""


def _first_rows(src: Path, dst: Path, n: int) -> str:
    """The first `n` rows of a jsonl file, written to `dst` (unchanged if already equal)."""
    rows = src.read_text().splitlines(keepends=True)[:n]
    text = "".join(rows)
    if not dst.is_file() or dst.read_text() != text:
        dst.write_text(text)
    return str(dst)


def _extract_job(target: str, data: str, out: str, rows_per_part: int,
                 cfg: QuickstartConfig):
    from dflash_train.extract.config import ExtractConfig

    return ExtractConfig(model=target, data=[data], out=out, device="cpu", regenerate=True,
                         max_new_tokens=cfg.max_new_tokens, rows_per_part=rows_per_part,
                         shard_tokens=4096, progress=cfg.progress)


def response_loop_share(url: str) -> float:
    """Repeated-4-gram share over the assistant tokens of every sample in a store."""
    repeated = total = 0
    for _, answer in _answers(url):
        r, t = repeated_ngram_share(answer)
        repeated, total = repeated + r, total + t
    return repeated / max(1, total)


def _answers(url: str):
    """((part, index), assistant token ids) of every sample of a store, reading only the
    token ids and the loss mask."""
    from dflash_train.store_schema import open_store

    for part in open_store(url).parts():
        arrays = part.read_tokens(0, part.num_tokens, ("input_ids", "loss_mask"))
        offsets = part.offsets()
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            yield (part.index, i), arrays["input_ids"][lo:hi][arrays["loss_mask"][lo:hi]].tolist()


def _does_not_loop(answer: list[int]) -> bool:
    repeated, total = repeated_ngram_share(answer)
    return repeated <= LOOP_FREE_SHARE * total


def save_untrained(train_cfg, out: Path) -> str:
    """The drafter train starts from: same config, same seed, no step taken."""
    import torch

    from dflash_train.drafter import save_drafter
    from dflash_train.store_schema import open_store
    from dflash_train.train.drafter_shape import new_drafter

    store = open_store(train_cfg.stores[0])
    torch.manual_seed(train_cfg.run.seed)
    return str(save_drafter(new_drafter(train_cfg, store), out, overwrite=True))


def _train_config(cfg: QuickstartConfig, store: str, run_dir: Path):
    from dflash_train.train.config import ModelConfig, OptimConfig, RunConfig, TrainConfig
    from dflash_train.train.loader_config import LoaderConfig
    from dflash_train.train.loss import LossConfig

    return TrainConfig(
        stores=[store],
        loader=LoaderConfig(batch_tokens=cfg.batch_tokens, seed=cfg.seed),
        model=ModelConfig(num_hidden_layers=cfg.drafter_layers),
        loss=LossConfig(position_weights=cfg.position_weights),
        optim=OptimConfig(optimizer=cfg.optimizer, lr=cfg.lr, epochs=cfg.epochs,
                          max_steps=cfg.max_steps),
        run=RunConfig(out_dir=str(run_dir), seed=cfg.seed, device="cpu",
                      anchors_per_seq=cfg.anchors_per_seq, checkpoint_every=10**9,
                      # Rows of ~180 tokens and 24 anchors: the dense mask's scores are
                      # small, one SDPA beats the split path, and nothing needs chunks.
                      attention="dense", chunk_blocks=0,
                      keep_checkpoints=1, log_every=10, progress=cfg.progress),
    )


def run_quickstart(cfg: QuickstartConfig, echo=print) -> QuickstartResult:
    """Extract -> untrained drafter -> train -> eval on the embedded target; see module doc."""
    from dflash_train.evaluate.pipeline import EvalConfig, run_eval

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = str(target_dir())
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name], clock = now - clock, now

    world = stage_ranks()
    train_store, held_store, loops = _extract_stage(cfg, out, target, world, echo)
    lap("extract")
    echo(f"\n[2/3] train: a {cfg.drafter_layers}-layer drafter, {cfg.epochs} epochs, "
         f"{cfg.optimizer}, {cfg.position_weights} loss weights (the untrained drafter is its "
         "seeded starting point)")
    run_dir = out / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run each time; the stores above are resumed
    train_cfg = _train_config(cfg, train_store, run_dir)
    untrained = save_untrained(train_cfg, out / "untrained")
    result = in_ranks(train_rank, train_cfg, echo=echo, world=world)
    echo(f"trained {result.steps} steps, final loss {result.final_loss:.3f}"
         + (f" ({world} DDP ranks)" if world > 1 else ""))

    lap("train")
    echo("\n[3/3] eval: untrained vs trained drafter on the held-out store")
    outcome = run_eval(EvalConfig(store=held_store, checkpoints=[untrained, str(result.checkpoint)],
                                  device="cpu", out=str(out / "eval"), progress=cfg.progress),
                       echo=echo)
    echo(outcome.text)
    untrained_tau, trained_tau = (c["offline"]["mean_tau"]
                                  for c in outcome.report["checkpoints"])
    loop_free = _loop_free_taus(held_store, outcome, echo)
    lap("eval")
    echo(f"\nheld-out tau: untrained {untrained_tau:.3f} -> trained {trained_tau:.3f}")
    if loop_free:
        echo(f"  on the {loop_free['samples']} of {loop_free['of']} answers that do not loop: "
             f"untrained {loop_free['untrained_tau']:.3f} -> trained "
             f"{loop_free['trained_tau']:.3f}")
    echo(f"({sum(seconds.values()):.0f} s: "
         + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + ")")
    echo(f"trained drafter: {result.checkpoint}\n\n{REAL_MODEL_COMMANDS}")
    return QuickstartResult(untrained_tau, trained_tau, outcome.report, loops, loop_free,
                            seconds)


def _extract_stage(cfg: QuickstartConfig, out: Path, target: str, world: int, echo
                   ) -> tuple[str, str, float]:
    """The train and held-out stores (resumed when there), and the share of the train
    answers' 4-grams that repeat an earlier one."""
    from dflash_train.store_schema import open_store

    echo(f"[1/3] extract: the embedded target {target} answers {cfg.train_prompts} train and "
         f"{cfg.held_out_prompts} held-out coding prompts (greedy, --regenerate)")
    train_data = _first_rows(prompt_file("train"), out / "train_prompts.jsonl",
                             cfg.train_prompts)
    held_data = _first_rows(prompt_file("held_out"), out / "held_out_prompts.jsonl",
                            cfg.held_out_prompts)
    train_store, held_store = str(out / "train.zarr"), str(out / "held_out.zarr")
    in_ranks(extract_rank, [_extract_job(target, train_data, train_store, TRAIN_ROWS_PER_PART,
                                          cfg),
                             _extract_job(target, held_data, held_store,
                                          HELD_OUT_ROWS_PER_PART, cfg)],
             echo=echo, world=world)
    for url in (train_store, held_store):
        store = open_store(url)
        echo(f"extracted {store.num_samples} samples, {store.num_tokens} tokens into {url}"
             + (f" ({world} processes)" if world > 1 else ""))
    loops = response_loop_share(train_store)
    echo(f"target's responses: {loops:.1%} of their 4-grams repeat an earlier one")
    return train_store, held_store, loops


def _loop_free_taus(held_store: str, outcome, echo) -> dict | None:
    """Both drafters' mean tau on the held-out samples whose answers do not loop, from the
    eval's own rounds (replay's blocks of those samples: the figure an eval of a store of
    only them reports, without a second replay)."""
    answers = dict(_answers(held_store))
    kept = {key for key, answer in answers.items() if _does_not_loop(answer)}
    if not kept:
        echo("no held-out answer is free of loops: nothing to compare there")
        return None
    means = []
    for results in outcome.offline.values():
        taus = [t for key, rounds in results.walks[None].rounds.items() if key in kept
                for _, t in rounds]
        means.append(sum(taus) / len(taus) if taus else float("nan"))
    untrained, trained = means
    return {"samples": len(kept), "of": len(answers), "untrained_tau": untrained,
            "trained_tau": trained}


@click.command("quickstart", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", default=QuickstartConfig.out, show_default=True,
              help="Working directory (stores, runs, eval report).")
@click.option("--train-prompts", default=QuickstartConfig.train_prompts, show_default=True,
              type=click.IntRange(1), help="Embedded train prompts to extract.")
@click.option("--held-out-prompts", default=QuickstartConfig.held_out_prompts,
              show_default=True, type=click.IntRange(1),
              help="Embedded held-out prompts to evaluate on.")
@click.option("--max-new-tokens", default=QuickstartConfig.max_new_tokens, show_default=True,
              type=click.IntRange(1), help="Tokens the target generates per prompt.")
@click.option("--epochs", default=QuickstartConfig.epochs, show_default=True,
              type=click.IntRange(1), help="Drafter training epochs.")
@click.option("--max-steps", default=None, type=click.IntRange(1),
              help="Stop drafter training after this many steps.")
@click.option("--seed", default=QuickstartConfig.seed, show_default=True,
              type=click.IntRange(0, MAX_SEED),
              help="Seed of the drafter's weights, data order and anchors.")
@click.option("--progress/--no-progress", default=True, help="Show progress bars.")
def quickstart(**options) -> None:
    """Run extract -> train -> eval on the embedded tiny target (CPU, a few minutes).

    The target is a tiny Qwen3.5 hybrid trained on the standard library's source; the
    prompts ask it to continue held-out stdlib code. Extract and train run as one
    single-threaded process per core (at most 4), as torchrun ranks would. Prints the
    untrained and the trained drafter side by side, then the commands for a real model.
    """
    try:
        with reported_as_one_line():
            run_quickstart(QuickstartConfig(**options), echo=click.echo)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from e
