"""Whether a step left the run trainable: a non-finite loss or gradient, or a gradient that
died, stops the run before that step can reach a checkpoint.

Reads global values only (every rank agrees, so every rank stops at the same step); never
writes anything.
"""

import math
from pathlib import Path

from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.errors import TrainError

COLLAPSED_STEPS = 5
"""Steps in a row with a positive loss and a gradient norm of exactly 0 that stop a run as
collapsed: no weight receives any signal (a sum of squares over every gradient is exactly 0
only when each is), so no later step can learn; a too-high --lr typically leaves this."""


class StepHealth:
    """Stops a run whose step went non-finite or whose gradient died, before the step can
    reach a checkpoint: the latest one stays the last finite (and live) weights."""

    def __init__(self, run_dir: Path, vocab_size: int, lr: float):
        self.run_dir, self.vocab_size, self.lr = run_dir, vocab_size, lr
        self.zero_since: int | None = None

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            kept = latest_checkpoint(self.run_dir)
            kept = f"the latest checkpoint, {kept}," if kept else "no checkpoint was written; it"
            raise TrainError(
                f"step {step}: non-finite loss {loss} / gradient norm {grad_norm}: training "
                f"diverged and is stopped before this step is saved; {kept} holds the last "
                "finite weights. Lower --lr or --noise-std, or check the store with `dflash "
                "store validate`, then start a new run with another --out")
        if grad_norm != 0 or not loss > 0:
            self.zero_since = None
            return
        self.zero_since = self.zero_since or step
        if step - self.zero_since + 1 >= COLLAPSED_STEPS:
            raise TrainError(
                f"steps {self.zero_since}-{step}: the gradient norm is exactly 0 at a loss of "
                f"{loss:.4f} (ln V = {math.log(self.vocab_size):.4f}: uniform predictions): "
                f"the drafter collapsed and no further step can train it (a too-high --lr "
                f"does this; this run's: {self.lr:g}); start a new run with a lower --lr or "
                "other initial weights, in another --out")
