"""One training step's record: what log.jsonl holds a line of, TensorBoard plots, and
`dflash log summary` reads back.

The line's keys and their order are a contract with users' scripts and older logs: the
fields below are written in this order, the accuracy ones only on the steps that measure
them, selector_recall only for a DFlash 2 drafter. Never computes anything from tensors.
"""

from dataclasses import dataclass
from typing import Any


@dataclass
class BatchAccuracy:
    """How the drafts of one batch's blocks did, measured on rank 0 every run.log_every
    steps and at the last one."""

    slot_acc: list[float | None]
    """Per block slot after the anchor: the fraction of its labelled positions drafted right."""
    train_tau: float | None
    """The mean accepted length of those drafts (the training estimate of eval's tau)."""
    selector_recall: float | None = None
    """DFlash 2 only: the fraction of labelled slots whose label is among the top-K
    candidates the selector walks over."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"slot_acc": self.slot_acc, "train_tau": self.train_tau}
        if self.selector_recall is not None:
            out["selector_recall"] = self.selector_recall
        return out


@dataclass
class StepRecord:
    """One optimiser step. Read back from a log, a field a record lacks (logs written by
    older versions, or by hand) is None."""

    step: int
    """Steps taken after this one (the first step is 1)."""
    epoch: int
    loss: float
    """The global loss: every rank's share summed, as one process would compute it."""
    lr: float
    """The learning rate after the scheduler stepped (the next step's)."""
    tokens: int
    """Tokens this rank's batch held."""
    grad_norm: float | None = None
    """The global gradient norm before clipping."""
    samples: int | None = None
    skipped: int | None = None
    """Damaged samples this batch left out (loader.skip_corrupt)."""
    blocks: int | None = None
    """Blocks with at least one labelled slot."""
    noise_std: float | None = None
    data_wait_s: float | None = None
    """Wall-clock seconds waiting for the batch; this and the two below vary run to run."""
    step_s: float | None = None
    tokens_per_s: float | None = None
    accuracy: BatchAccuracy | None = None

    def to_json(self) -> dict[str, Any]:
        """The log line's object, keys in the order the loop has always written them."""
        out = {"step": self.step, "epoch": self.epoch, "loss": self.loss, "lr": self.lr,
               "grad_norm": self.grad_norm, "tokens": self.tokens, "samples": self.samples,
               "skipped": self.skipped, "blocks": self.blocks, "noise_std": self.noise_std,
               "data_wait_s": self.data_wait_s, "step_s": self.step_s,
               "tokens_per_s": self.tokens_per_s}
        return out | (self.accuracy.to_json() if self.accuracy is not None else {})

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "StepRecord":
        """A record from a log line already checked (log_summary.record_problem); keys it
        does not know are passed over."""
        accuracy = None
        if "slot_acc" in raw or "train_tau" in raw:
            accuracy = BatchAccuracy(raw.get("slot_acc"), raw.get("train_tau"),
                                     raw.get("selector_recall"))
        known = {name: raw.get(name) for name in _SCALARS}
        return cls(**known, accuracy=accuracy)


_SCALARS = ("step", "epoch", "loss", "lr", "tokens", "grad_norm", "samples", "skipped",
            "blocks", "noise_std", "data_wait_s", "step_s", "tokens_per_s")
