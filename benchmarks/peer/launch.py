"""`speculators train` on a CPU-only machine, measured: run INSIDE speculators' own venv.

    SPECULATORS_VENV/bin/python -m benchmarks.peer.launch REPORT.json -- <speculators train flags>

Imports nothing of ours (dflash_train is not installed there). Applies the run-time patches
below, then hands argv to speculators' own command-line entry point, unchanged, so its
trainer runs the way its users run it. Every patch is a CPU workaround or a measurement; none
changes what a training step computes:

1. Trainer.__init__ reads `get_local_rank()` (an int, 0) and moves the model and every batch
   with `.to(0)`, which means cuda:0: the name is rebound in its trainer module to return
   "cpu" (a single-process run has no other rank).
2. Its step timer calls `torch.accelerator.synchronize()`, which raises without an
   accelerator: a no-op when none is available (there is nothing to wait for on a CPU).
3. It picks its autocast device as `current_accelerator().type`, else "cuda": on a CPU that
   is "cuda", so autocast would be disabled with a warning and the run would be fp32. After
   __init__ its `device_type` is set to "cpu", which keeps its bf16 autocast.
4. With --max-steps, its train_epoch stops mid-epoch, but run_training still enters every
   later epoch, whose first batch is trained before the check: one step too many per
   remaining epoch. A later epoch is skipped when max_steps is already reached, so the run
   takes exactly --max-steps steps (its validation passes still run: they do not train).
5. Measurement only: training steps, training tokens (non-padding positions of each packed
   batch, `document_ids != -1`, the count its own profiler uses) and the wall time spent in
   train_epoch are counted; at exit REPORT.json gets them with the process's peak RSS
   (VmHWM, read by the process itself).

Flex attention has no CPU backward and triton is absent, so the runner passes
`--draft-attn-impl sdpa --loss-implementation eager`: on a GPU its users run flex attention
and the fused loss instead.
"""

import atexit
import json
import sys
import time
from pathlib import Path


def peak_rss_kb() -> int:
    """This process's peak resident set (VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def install(report: Path) -> dict:
    """Apply patches 1-5; returns the counters filled during the run."""
    import torch
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train import trainer

    counts = {"steps": 0, "train_tokens": 0, "train_seconds": 0.0, "patched": []}

    if not torch.accelerator.is_available():
        trainer.get_local_rank = lambda: "cpu"  # 1
        torch.accelerator.synchronize = lambda *a, **k: None  # 2
        counts["patched"] += ["local rank -> cpu", "accelerator.synchronize -> no-op"]

        init = trainer.Trainer.__init__

        def cpu_init(self, *args, **kwargs):  # 3
            init(self, *args, **kwargs)
            self.device_type = "cpu"

        trainer.Trainer.__init__ = cpu_init
        counts["patched"].append("autocast device -> cpu")

    train_epoch = trainer.Trainer.train_epoch

    def bounded_train_epoch(self, *args, **kwargs):  # 4, 5
        limit = self.config.max_steps
        if limit is not None and self.global_step >= limit:
            return None
        start = time.perf_counter()
        try:
            return train_epoch(self, *args, **kwargs)
        finally:
            counts["train_seconds"] += time.perf_counter() - start

    trainer.Trainer.train_epoch = bounded_train_epoch
    counts["patched"].append("no step past --max-steps")

    forward = DFlashDraftModel.forward

    def counted_forward(self, *args, **kwargs):  # 5
        if self.training:
            counts["steps"] += 1
            counts["train_tokens"] += int((kwargs["document_ids"] != -1).sum())
        return forward(self, *args, **kwargs)

    DFlashDraftModel.forward = counted_forward

    start = time.perf_counter()

    def write() -> None:
        out = dict(counts, wall_seconds=time.perf_counter() - start, peak_rss_kb=peak_rss_kb(),
                   torch=torch.__version__, argv=sys.argv[1:])
        report.write_text(json.dumps(out, indent=2) + "\n")

    atexit.register(write)
    return counts


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit("usage: python -m benchmarks.peer.launch REPORT.json -- <train flags>")
    report = Path(sys.argv[1])
    flags = sys.argv[3:]
    install(report)
    from speculators.__main__ import app

    sys.argv = ["speculators", "train", *flags]
    app()


if __name__ == "__main__":
    main()
