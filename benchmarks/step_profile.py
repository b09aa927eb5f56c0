"""Where one training step's time goes, phase by phase, at a store's shape (SmolLM2's by default).

    python -m benchmarks.step_profile [--store URL] [--arms fp32 bf16 fp32-recompute] [--steps 4]
        [--anchors 16] [--batch-tokens 4096] [--layers 1] [--rounds 2] [--threads N]
        [--set KEY=VALUE ...]

Without --store it writes a synthetic store of SmolLM2-135M's shape (train_memory.py's) to a
temporary directory. Each arm (a precision; `-recompute` recomputes the lm_head's logits in
backward as the loss did before head_cross_entropy) times `dflash train`'s own step,
train.loop.train_step, on a run assembled in memory (train.run.assemble_run) over the same
batches, in turns (`--rounds` times each, so a noisy machine slows every arm alike). The
step's pieces are timed where they are called:
  loader     the StoreLoader's wait for its next batch (its prefetch thread overlaps it);
  blocks     anchors, labels and block inputs (train.step.make_blocks);
  noise      the noised copy of the context the drafter's fc reads (train.step.noised_context);
  forward    the drafter's forward to its last hidden states;
  lm_head    the loss call (train.step.block_loss): the lm_head's logits and, but in the
             -recompute arms, their gradient to the hidden states, built in the same pass;
  backward   the rest of the step: the backward (with the -recompute arms' second pass over
             the lm_head), gradient clipping, the accuracy pass of a log_every step;
  optimizer  the configured optimiser's step.
`attention` is the share of the forward spent in attention kernels, from torch.profiler on one
forward. It prints one table: median milliseconds of each phase and its share of the step.
Not a test.
"""

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import wraps
from pathlib import Path

import torch

from benchmarks.driver import package_errors_as_one_line
from dflash_train.train import loop
from dflash_train.train.config import TrainConfig, load_train_config
from dflash_train.train.data import StoreLoader
from dflash_train.train.run import (
    Placement,
    Run,
    assemble_run,
    head_dtype,
    noise_layer_rms,
)
from dflash_train.train.step import make_blocks

PHASES = ("loader", "blocks", "noise", "forward", "lm_head", "backward", "optimizer")
TIMED_CALLS = {"blocks": "make_blocks", "noise": "noised_context", "lm_head": "block_loss"}
"""Phases timed around the train_step module's own calls, by the name it calls them by."""
ATTENTION_OPS = ("attention", "flex", "softmax", "bmm", "baddbmm")
CPU = torch.device("cpu")


def drafter_for(cfg: TrainConfig, store):
    """A new drafter of the store's shape, borrowing its head in the dtype the run keeps it."""
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.train.drafter_shape import drafter_config

    torch.manual_seed(cfg.run.seed)
    model = DFlashDrafter(drafter_config(cfg, store))
    rows = store.target_rows()
    dtype = head_dtype(cfg.run.precision, CPU)
    model.attach_target_head(rows["embed_tokens"].to(dtype), rows["lm_head"].to(dtype))
    return model


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _timing(fn, seconds: list[float]):
    """fn, appending the seconds of each call to `seconds` (its attributes kept: the LR
    scheduler's mark on the optimiser's step among them)."""
    @wraps(fn)
    def call(*args, **kwargs):
        out, took = timed(lambda: fn(*args, **kwargs))
        seconds.append(took)
        return out

    return call


@contextmanager
def phase_clocks(run: Run):
    """{phase: [seconds of each call]} of the pieces train_step calls, for as long as this
    lasts: the train_step module's calls, the run's forward and its optimiser's step each
    wrapped in a clock (nothing else about them changes)."""
    clocks: dict[str, list[float]] = {p: [] for p in (*TIMED_CALLS, "forward", "optimizer")}
    real = {name: getattr(loop, name) for name in TIMED_CALLS.values()}
    forward, step = run.forward, run.optimizer.step
    for phase, name in TIMED_CALLS.items():
        setattr(loop, name, _timing(real[name], clocks[phase]))
    run.forward = _timing(forward, clocks["forward"])
    run.optimizer.step = _timing(step, clocks["optimizer"])
    try:
        yield clocks
    finally:
        for name, fn in real.items():
            setattr(loop, name, fn)
        run.forward, run.optimizer.step = forward, step


def one_step(run: Run, batch) -> dict:
    """Seconds of each phase but the loader's for one train_step on `batch`."""
    with phase_clocks(run) as clocks:
        _, total = timed(lambda: loop.train_step(run, batch))
    out = {phase: sum(seconds) for phase, seconds in clocks.items()}
    out["backward"] = max(0.0, total - sum(out.values()))
    return out


def attention_share(model, batch, cfg: TrainConfig, bf16: bool) -> float:
    """Fraction of one forward's CPU time in attention ops (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    dcfg = model.config
    blocks = make_blocks(batch, mask_token_id=dcfg.mask_token_id, block_size=dcfg.block_size,
                         anchors_per_seq=cfg.run.anchors_per_seq, seed=cfg.run.seed, epoch=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
            profile(activities=[ProfilerActivity.CPU]) as prof:
        model(batch.context, batch.lengths, blocks.block_ids, blocks.anchors,
              attention=cfg.run.attention)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    attn = sum(e.self_cpu_time_total for e in events
               if any(k in e.key.lower() for k in ATTENTION_OPS))
    return attn / max(1, total)


def profile_arm(cfg: TrainConfig, arm: str, steps: int) -> dict:
    import dflash_train.train.loss as loss_module

    precision = "bf16" if arm.startswith("bf16") else "fp32"
    fused = loss_module.head_cross_entropy
    if arm.endswith("-recompute"):  # the hard CE then recomputes the logits in backward
        loss_module.head_cross_entropy = loss_module.recomputed_cross_entropy
    try:
        return _profile(replace(cfg, run=replace(cfg.run, precision=precision)), steps)
    finally:
        loss_module.head_cross_entropy = fused


def in_memory_run(cfg: TrainConfig) -> Run:
    """The run `dflash train` would train on CPU, assembled without a run directory; its
    schedule as long as the run would be."""
    loader = StoreLoader(cfg.stores, cfg.loader)
    total = loader.batches_per_epoch() * cfg.optim.epochs
    return assemble_run(cfg, drafter_for(cfg, loader.stores[0]), placement=Placement(CPU),
                        total_steps=min(total, cfg.optim.max_steps or total), loader=loader,
                        layer_rms=noise_layer_rms(cfg, loader, CPU))


def _profile(cfg: TrainConfig, steps: int) -> dict:
    run = in_memory_run(cfg)
    rows = {p: [] for p in PHASES}
    labels = []
    batches = iter(run.loader.epoch(0))
    first = None
    for _ in range(steps + 1):  # the first step warms caches up and is not counted
        batch, t_load = timed(lambda: next(batches))
        first = first or batch
        step = one_step(run, batch)
        if first is not batch or steps == 0:
            rows["loader"].append(t_load)
            for p in PHASES[1:]:
                rows[p].append(step[p])
            labels.append(_labelled_slots(batch, run))
    out = {p: statistics.median(v) for p, v in rows.items()}
    out["labels"] = statistics.median(labels)
    out["attention_share"] = attention_share(run.model, first, cfg, run.bf16)
    return out


def _labelled_slots(batch, run: Run) -> int:
    """The batch's labelled block slots, as the step drew them (anchors are keyed by seed,
    epoch and sample: drawing them again gives the same blocks)."""
    dcfg = run.model.config
    blocks = make_blocks(batch, mask_token_id=dcfg.mask_token_id, block_size=dcfg.block_size,
                         anchors_per_seq=run.cfg.run.anchors_per_seq, seed=run.cfg.run.seed,
                         epoch=0)
    return int(blocks.valid[..., 1:].sum())


def report(results: dict[str, list[dict]]) -> str:
    lines = ["| phase | " + " | ".join(f"{a} ms (share)" for a in results) + " |",
             "| --- |" + " --- |" * len(results)]
    medians = {a: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for a, rs in results.items()}
    for phase in PHASES:
        cells = []
        for m in medians.values():
            total = sum(m[p] for p in PHASES)
            cells.append(f"{m[phase] * 1e3:.0f} ({m[phase] / total:.0%})")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    totals = {a: sum(m[p] for p in PHASES) for a, m in medians.items()}
    lines.append("| step | " + " | ".join(f"{t * 1e3:.0f}" for t in totals.values()) + " |")
    lines.append("| labels/s | " + " | ".join(
        f"{medians[a]['labels'] / totals[a]:.0f}" for a in medians) + " |")
    lines.append("| attention share of forward | " + " | ".join(
        f"{m['attention_share']:.0%}" for m in medians.values()) + " |")
    return "\n".join(lines)


@package_errors_as_one_line
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="Store to read (default: a synthetic SmolLM2-shape one).")
    ap.add_argument("--arms", nargs="+", default=["fp32-recompute", "fp32", "bf16"],
                    choices=["fp32", "bf16", "fp32-recompute", "bf16-recompute"])
    ap.add_argument("--steps", type=int, default=4, help="Counted steps per arm and round.")
    ap.add_argument("--rounds", type=int, default=2, help="Turns each arm takes.")
    ap.add_argument("--anchors", type=int, default=16, help="run.anchors_per_seq.")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=1, help="Drafter layers.")
    ap.add_argument("--length", type=int, default=192, help="Synthetic sample length.")
    ap.add_argument("--threads", type=int, help="torch intra-op threads.")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="Train settings, as `dflash train --set`.")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store
        if store is None:
            from benchmarks.train_memory import build_store

            store = str(Path(tmp) / "smollm2.zarr")
            build_store(store, "smollm2", args.length, samples=96)
        settings = [f"loader.batch_tokens={args.batch_tokens}",
                    f"run.anchors_per_seq={args.anchors}",
                    f"model.num_hidden_layers={args.layers}", "run.device=cpu", *args.overrides]
        cfg = replace(load_train_config(None, dict(s.split("=", 1) for s in settings)),
                      stores=[store])
        results: dict[str, list[dict]] = {a: [] for a in args.arms}
        for r in range(args.rounds):
            for precision in args.arms:
                results[precision].append(profile_arm(cfg, precision, args.steps))
                print(f"round {r + 1} {precision}: step "
                      f"{sum(results[precision][-1][p] for p in PHASES) * 1e3:.0f} ms",
                      flush=True)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, store "
          f"{args.store or 'synthetic'}, {args.layers}-layer drafter, {args.anchors} anchors, "
          f"{args.batch_tokens} batch tokens")
    print(report(results))


if __name__ == "__main__":
    main()
