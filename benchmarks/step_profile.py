"""Where one training step's time goes, phase by phase, at a store's shape (SmolLM2's by default).

    python benchmarks/step_profile.py [--store URL] [--arms fp32 bf16 fp32-recompute] [--steps 4]
        [--anchors 16] [--batch-tokens 4096] [--layers 1] [--rounds 2] [--threads N]
        [--set KEY=VALUE ...]

Without --store it writes a synthetic store of SmolLM2-135M's shape (train_memory.py's) to a
temporary directory. Each arm (a precision; `-recompute` recomputes the lm_head's logits in
backward as the loss did before head_cross_entropy) runs the trainer's own pieces on the same
batches, in turns (`--rounds` times each, so a noisy machine slows every arm alike):
  loader     the StoreLoader's wait for its next batch (its prefetch thread overlaps it);
  blocks     anchors, labels and block inputs (train.step.make_blocks);
  forward    the drafter's forward to its last hidden states;
  lm_head    the loss through the frozen lm_head, forward and its backward to the hidden
             states, timed on a detached copy of them;
  backward   the drafter's own backward: the whole backward less the lm_head part;
  optimizer  clipping and the optimiser's step.
`attention` is the share of the forward spent in attention kernels, from torch.profiler on one
forward. It prints one table: median milliseconds of each phase and its share of the step.
Not a test.
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from dflash_train.train.config import TrainConfig, load_config  # noqa: E402
from dflash_train.train.data import StoreLoader  # noqa: E402
from dflash_train.train.optimizer import build_optimizer  # noqa: E402
from dflash_train.train.step import block_loss, make_blocks  # noqa: E402

PHASES = ("loader", "blocks", "forward", "lm_head", "backward", "optimizer")
ATTENTION_OPS = ("attention", "flex", "softmax", "bmm", "baddbmm")


def drafter_for(cfg: TrainConfig, store, bf16: bool):
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.train.drafter_shape import drafter_config

    torch.manual_seed(cfg.run.seed)
    model = DFlashDrafter(drafter_config(cfg, store))
    rows = store.target_rows()
    dtype = torch.bfloat16 if bf16 else torch.float32
    model.attach_target_head(rows["embed_tokens"].to(dtype), rows["lm_head"].to(dtype))
    model.train()
    return model


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def one_step(model, optimizer, batch, cfg: TrainConfig, bf16: bool) -> dict:
    """Seconds of each phase but the loader's for one step on `batch`."""
    dcfg = model.config
    blocks, t_blocks = timed(lambda: make_blocks(
        batch, mask_token_id=dcfg.mask_token_id, block_size=dcfg.block_size,
        anchors_per_seq=cfg.run.anchors_per_seq, seed=cfg.run.seed, epoch=0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden, t_fwd = timed(lambda: model(batch.context, batch.lengths, blocks.block_ids,
                                            blocks.anchors, attention=cfg.run.attention))
        # the lm_head alone, forward then backward to a detached copy of the hidden states
        probe = hidden.detach().requires_grad_()
        head_loss, t_head_fwd = timed(lambda: block_loss(probe, blocks, model.target_lm_head,
                                                         cfg.loss))
        _, t_head_bwd = timed(head_loss.backward)
        loss = block_loss(hidden, blocks, model.target_lm_head, cfg.loss)
    optimizer.zero_grad(set_to_none=True)
    _, t_bwd = timed(loss.backward)  # the lm_head's backward again, then the drafter's
    t_head = t_head_fwd + t_head_bwd

    def opt():
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()

    _, t_opt = timed(opt)
    slots = int(blocks.valid[..., 1:].sum())
    return {"blocks": t_blocks, "forward": t_fwd, "lm_head": t_head,
            "backward": max(0.0, t_bwd - t_head_bwd), "optimizer": t_opt, "labels": slots}


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

    bf16 = arm.startswith("bf16")
    fused = loss_module.head_cross_entropy
    if arm.endswith("-recompute"):  # block_ce_loss then takes its checkpointed path
        loss_module.head_cross_entropy = None
    try:
        return _profile(cfg, bf16, steps)
    finally:
        loss_module.head_cross_entropy = fused


def _profile(cfg: TrainConfig, bf16: bool, steps: int) -> dict:
    loader = StoreLoader(cfg.stores, cfg.loader)
    model = drafter_for(cfg, loader.stores[0], bf16)
    optimizer = build_optimizer(model, cfg.optim)
    rows = {p: [] for p in PHASES}
    labels = []
    batches = iter(loader.epoch(0))
    first = None
    for _ in range(steps + 1):  # the first step warms caches up and is not counted
        batch, t_load = timed(lambda: next(batches))
        first = first or batch
        step = one_step(model, optimizer, batch, cfg, bf16)
        if first is not batch or steps == 0:
            rows["loader"].append(t_load)
            for p in PHASES[1:]:
                rows[p].append(step[p])
            labels.append(step["labels"])
    out = {p: statistics.median(v) for p, v in rows.items()}
    out["labels"] = statistics.median(labels)
    out["attention_share"] = attention_share(model, first, cfg, bf16)
    return out


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
            from train_memory import build_store

            store = str(Path(tmp) / "smollm2.zarr")
            build_store(store, "smollm2", args.length, samples=96)
        settings = [f"loader.batch_tokens={args.batch_tokens}",
                    f"run.anchors_per_seq={args.anchors}",
                    f"model.num_hidden_layers={args.layers}", "run.device=cpu", *args.overrides]
        cfg = replace(load_config(None, dict(s.split("=", 1) for s in settings)),
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
