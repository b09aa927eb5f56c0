"""`speculators train` on a CPU-only machine, measured: run INSIDE speculators' own venv.

    SPECULATORS_VENV/bin/python -m benchmarks.peer.launch REPORT.json -- <speculators train flags>

Imports nothing of ours (dflash_train is not installed there). Applies the run-time patches
below, then hands argv to speculators' own command-line entry point, unchanged, so its
trainer runs the way its users run it. Every patch is a CPU workaround or a measurement; none
changes what a training step computes (5 only stops a run that would not compare):

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
5. Check only: with DFLASH_PEER_EXPECTED_HEAD set (benchmarks.peer.verifier writes that
   file), the verifier head its model built (frozen lm_head, final norm gain) must equal the
   store's, or the run stops before its first step: its labels are that head's argmax.
6. Measurement only: training steps, training tokens (non-padding positions of each packed
   batch, `document_ids != -1`, the count its own profiler uses) and the wall time spent in
   train_epoch are counted, and which of its code paths are in use is recorded (autocast,
   optimizers, schedulers, attention, mask builder, loss functions, slot weights, compiled
   forward, loader workers); at exit REPORT.json gets them with the process's peak RSS
   (VmHWM, read by the process itself).

Flex attention has no CPU backward and triton is absent, so the runner passes
`--draft-attn-impl sdpa --loss-implementation eager`: on a GPU its users run flex attention
and the fused loss instead.
"""

import atexit
import json
import os
import sys
import time
from pathlib import Path


def peak_rss_kb() -> int:
    """This process's peak resident set (VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def check_head(model, expected: Path) -> None:
    """Refuse a verifier head (lm_head rows, final norm gain) other than the store's."""
    import torch
    from safetensors.torch import load_file

    want = load_file(str(expected))
    lm_head = model.verifier_lm_head.weight.detach().float().cpu()
    probe = torch.full((1, lm_head.shape[1]), 1e3, device=model.verifier_norm.weight.device)
    with torch.no_grad():
        gain = model.verifier_norm(probe).float().cpu()[0]
    if not torch.equal(lm_head, want["lm_head"]):
        raise SystemExit(f"speculators' verifier lm_head differs from the store's ({expected})")
    if not torch.allclose(gain, want["final_norm"], rtol=1e-4, atol=1e-5):
        worst = (gain - want["final_norm"]).abs().max().item()
        raise SystemExit(f"speculators' verifier final norm gain differs from the store's by up "
                         f"to {worst:.3g} ({type(model.verifier_norm).__name__}): its labels "
                         "would not be the store's verifier argmax")


def install(report: Path) -> dict:
    """Apply patches 1-6; returns the counters filled during the run."""
    import torch
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train import trainer

    counts = {"steps": 0, "train_tokens": 0, "train_seconds": 0.0, "patched": [],
              "paths": {}}
    cpu = not torch.accelerator.is_available()
    if cpu:
        trainer.get_local_rank = lambda: "cpu"  # 1
        torch.accelerator.synchronize = lambda *a, **k: None  # 2
        counts["patched"] += ["local rank -> cpu", "accelerator.synchronize -> no-op",
                              "autocast device -> cpu"]

    init, forward = trainer.Trainer.__init__, DFlashDraftModel.forward

    def recorded_init(self, *args, **kwargs):  # 3, 5, and 6: which of its code paths run
        init(self, *args, **kwargs)
        if cpu:
            self.device_type = "cpu"
        model = self.model
        if os.environ.get("DFLASH_PEER_EXPECTED_HEAD"):
            check_head(model, Path(os.environ["DFLASH_PEER_EXPECTED_HEAD"]))
            counts["paths"]["verifier_head"] = "equal to the store's"
        counts["paths"].update(
            autocast=f"{self.device_type} {self.config.hidden_states_dtype}",
            optimizers=[type(o).__name__ for o in self.optimizers],
            schedulers=[type(x).__name__ for x in self.schedulers],
            attention=model._attn_impl, mask=model._create_mask_fn.__name__,
            compiled_forward=hasattr(forward, "_torchdynamo_orig_callable"),
            losses={name: f"{fn.__module__}.{fn.__name__}"
                    for name, (fn, _) in self.config.train_call_kwargs["loss_config"].items()},
            slot_weights=self.config.train_call_kwargs["per_position_loss_weight"],
            loader_workers=self.train_loader.num_workers)

    trainer.Trainer.__init__ = recorded_init

    train_epoch = trainer.Trainer.train_epoch

    def bounded_train_epoch(self, *args, **kwargs):  # 4, 6
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

    def counted_forward(self, *args, **kwargs):  # 6
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
