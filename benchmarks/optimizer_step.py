"""Muon's training step against AdamW's where bf16 is emulated (issue 63).

    python -m benchmarks.optimizer_step [--steps 3] [--as-is]

One child process trains the quick preset's recipe (benchmarks/real_target.py: SmolLM2's
shape, a 1-layer drafter, 4,096 draft ids, D-PACE, 16 anchors, 4,096-token batches) on a
synthetic store, with oneDNN and ATen held to AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2,
ATEN_CPU_CAPABILITY=avx2) and bf16 reported non-native (DFLASH_NATIVE_BF16=0): an AVX-512 BF16
machine then computes like an AVX2-only Zen 3. `--as-is` leaves the machine as it is. The
child first times a float32 and a bf16 GEMM at 512x576x1536, to show bf16 is emulated there.

Arms, each its own run over the same batches:
  adamw       optim.optimizer=adamw;
  muon-torch  torch.optim.Muon, whose Newton-Schulz casts to bf16: the path at 6498e34;
  muon        ours (train/optimizer.py): float32 Newton-Schulz where bf16 is emulated.
In each round every arm takes one `dflash train` step (train.loop.train_step) in turn, so a
shared machine's load falls on the three alike; round 0 warms up and is not counted. Prints
the median step and optimiser seconds and, per round, each arm's step over AdamW's. Not a test.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "DFLASH_NATIVE_BF16": "0"}
"""The child's environment: kernels and the precision rule of an AVX2-only CPU."""
RECIPE = {"model.num_hidden_layers": "1", "model.draft_vocab_size": "4096",
          "loss.position_weights": "dpace", "run.anchors_per_seq": "16",
          "loader.batch_tokens": "4096", "optim.lr": "3e-3", "run.device": "cpu",
          "run.progress": "false"}
"""benchmarks/real_target.py's quick preset, as train settings."""
ARMS = ("adamw", "muon-torch", "muon")
CPU = torch.device("cpu")


def gemm_gflops(dtype: torch.dtype, m: int = 512, k: int = 576, n: int = 1536) -> float:
    """GFLOP/s of an m x k by k x n matmul in `dtype` (SmolLM2's MLP at 512 rows)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    reps, start = 3, time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9


def build_run(store: str, arm: str, settings: dict[str, str] | None = None):
    """The run `dflash train` would assemble on CPU for `arm` (an ARMS name) with the recipe
    (and `settings` over it), in memory."""
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.train import optimizer
    from dflash_train.train.config import load_train_config
    from dflash_train.train.data import StoreLoader
    from dflash_train.train.drafter_shape import drafter_config, most_frequent_labels
    from dflash_train.train.run import Placement, assemble_run, head_dtype, noise_layer_rms

    settings = {**RECIPE, "optim.optimizer": "adamw" if arm == "adamw" else "muon",
                **(settings or {})}
    cfg = replace(load_train_config(None, settings), stores=[store])
    loader = StoreLoader(cfg.stores, cfg.loader)
    torch.manual_seed(cfg.run.seed)
    model = DFlashDrafter(drafter_config(cfg, loader.stores[0]))
    model.set_draft_vocab(most_frequent_labels(loader.stores, cfg.model.draft_vocab_size)[0])
    rows, dtype = loader.stores[0].target_rows(), head_dtype(cfg.run.precision, CPU)
    model.attach_target_head(rows["embed_tokens"].to(dtype), rows["lm_head"].to(dtype))
    ours = optimizer.Muon
    if arm == "muon-torch":  # build_optimizer's Muon, swapped for torch's own
        optimizer.Muon = lambda params, ns_dtype, ranks=1, rank=0, **kw: torch.optim.Muon(
            params, **kw)
    try:
        return assemble_run(cfg, model, placement=Placement(CPU), total_steps=1000,
                            loader=loader, layer_rms=noise_layer_rms(cfg, loader, CPU))
    finally:
        optimizer.Muon = ours


class ClockedRun:
    """An arm's run whose train steps are timed whole and in the optimiser's step."""

    def __init__(self, store: str, arm: str) -> None:
        self.run = build_run(store, arm)
        self.batches = iter(self.run.loader.epoch(0))
        self.spent: list[float] = []
        inner = self.run.optimizer.step

        def clocked(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.spent.append(time.perf_counter() - start)
            return out

        # the LR scheduler warns that the step it wrapped was replaced: by this clock, on purpose
        warnings.filterwarnings("ignore", message="Seems like `optimizer.step",
                                category=UserWarning)
        self.run.optimizer.step = clocked

    def step(self) -> tuple[float, float, float]:
        """(wall seconds of one train step on the next batch, of its optimiser step, the
        process's CPU seconds in the step: less swayed by other jobs on a shared machine)."""
        from dflash_train.train.loop import train_step

        start, cpu = time.perf_counter(), time.process_time()
        train_step(self.run, next(self.batches))
        return time.perf_counter() - start, self.spent[-1], time.process_time() - cpu


def child(steps: int) -> None:
    from benchmarks.train_memory import build_store
    from dflash_train.devices import native_bf16

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen "
          f"{torch.backends.cpu.get_cpu_capability()}, native bf16: {native_bf16(CPU)}; GEMM "
          f"512x576x1536: float32 {gemm_gflops(torch.float32):.1f} GFLOP/s, bf16 "
          f"{gemm_gflops(torch.bfloat16):.1f} GFLOP/s", flush=True)
    rounds: list[dict[str, tuple[float, float, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "smollm2.zarr")
        build_store(store, "smollm2", 192, samples=32 * (steps + 1))
        runs = {arm: ClockedRun(store, arm) for arm in ARMS}
        for r in range(steps + 1):  # round 0 warms caches and kernels up, uncounted
            rounds.append({arm: run.step() for arm, run in runs.items()})
            print(f"round {r}: " + ", ".join(f"{arm} {s:.2f} s (optimizer {o:.2f} s)"
                                             for arm, (s, o, _) in rounds[-1].items()),
                  flush=True)
    print(report(rounds[1:]))


def report(counted: list[dict[str, tuple[float, float, float]]]) -> str:
    """Medians of the counted rounds, and each round's ratio to AdamW's step."""
    lines = ["| arm | step s | optimizer s | step / adamw's, per round | CPU s / adamw's |",
             "| --- | --- | --- | --- | --- |"]
    for arm in ARMS:
        walls = ", ".join(f"{r[arm][0] / r['adamw'][0]:.2f}" for r in counted)
        cpus = ", ".join(f"{r[arm][2] / r['adamw'][2]:.2f}" for r in counted)
        lines.append(f"| {arm} | {statistics.median(r[arm][0] for r in counted):.2f} | "
                     f"{statistics.median(r[arm][1] for r in counted):.2f} | {walls} | {cpus} |")
    return "\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3,
                    help="Counted rounds; in each, every arm takes one step in turn.")
    ap.add_argument("--as-is", action="store_true",
                    help="Keep this machine's kernels and bf16 rule (no AVX2 emulation).")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.steps)
    # the kernel caps are read when torch loads: only a new process can take them
    env = {**os.environ, **({} if args.as_is else AVX2_ONLY)}
    command = [sys.executable, "-m", "benchmarks.optimizer_step", "--child",
               "--steps", str(args.steps)]
    print(" ".join(f"{k}={v}" for k, v in AVX2_ONLY.items() if not args.as_is),
          *command[1:], flush=True)
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
