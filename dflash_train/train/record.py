"""One training step's record: what log.jsonl holds a line of, TensorBoard plots, and
`dflash log summary` reads back.

The line's keys and their order are a contract with users' scripts and older logs: the
fields below are written in this order, the accuracy ones only on the steps that measure
them, selector_recall only for a DFlash 2 drafter, `validation` (one object) only on the
checkpoint steps of a run with validation stores. Never computes anything from tensors.
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
class StoreFigures:
    """The drafter replayed offline on one validation store (or on all of them pooled):
    the figures `dflash eval` reports first, from the same code."""

    tau: float | None
    """Mean tokens committed per block of the chain's replay walk (None: no block)."""
    tree_tau: dict[int, float | None]
    """Per DDTree node budget: mean tokens committed per round of that budget's walk."""
    blocks: int
    """Blocks the chain's walk drafted: the figures' sample size."""

    def to_json(self) -> dict[str, Any]:
        return {"tau": self.tau, "tree_tau": {str(b): t for b, t in self.tree_tau.items()},
                "blocks": self.blocks}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "StoreFigures":
        return cls(raw.get("tau"), {int(b): t for b, t in (raw.get("tree_tau") or {}).items()},
                   raw.get("blocks") or 0)


@dataclass
class ValidationFigures:
    """The drafter evaluated on the validation stores at a checkpoint step (train.validation):
    every store's blocks pooled, each store's own, and where the best stands after it."""

    pooled: StoreFigures
    """Over every validation store's blocks together: what chooses the best checkpoint."""
    tau_ci95: list[float] | None
    """95 % interval of the pooled tau (blocks treated as independent)."""
    stores: dict[str, StoreFigures]
    """Per validation store, by its location as the run records it."""
    seconds: float
    """Wall-clock seconds the validation took (not part of step_s)."""
    best_step: int | None = None
    """The run's best checkpoint after this validation (validation.best_by)."""

    def to_json(self) -> dict[str, Any]:
        return {**self.pooled.to_json(), "tau_ci95": self.tau_ci95,
                "best_step": self.best_step, "seconds": self.seconds,
                "stores": {url: f.to_json() for url, f in self.stores.items()}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ValidationFigures":
        return cls(StoreFigures.from_json(raw), raw.get("tau_ci95"),
                   {url: StoreFigures.from_json(f) for url, f in (raw.get("stores") or {}).items()},
                   raw.get("seconds") or 0.0, raw.get("best_step"))


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
    validation: ValidationFigures | None = None
    """On a checkpoint step of a run with validation stores: the drafter's figures there."""

    def to_json(self) -> dict[str, Any]:
        """The log line's object, keys in the order the loop has always written them."""
        out = {"step": self.step, "epoch": self.epoch, "loss": self.loss, "lr": self.lr,
               "grad_norm": self.grad_norm, "tokens": self.tokens, "samples": self.samples,
               "skipped": self.skipped, "blocks": self.blocks, "noise_std": self.noise_std,
               "data_wait_s": self.data_wait_s, "step_s": self.step_s,
               "tokens_per_s": self.tokens_per_s}
        out |= self.accuracy.to_json() if self.accuracy is not None else {}
        return out | ({"validation": self.validation.to_json()}
                      if self.validation is not None else {})

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "StepRecord":
        """A record from a log line already checked (log_summary.check_record); keys it
        does not know are passed over."""
        accuracy = None
        if "slot_acc" in raw or "train_tau" in raw:
            accuracy = BatchAccuracy(raw.get("slot_acc"), raw.get("train_tau"),
                                     raw.get("selector_recall"))
        known = {name: raw.get(name) for name in _SCALARS}
        validation = raw.get("validation")
        return cls(**known, accuracy=accuracy, validation=None if validation is None
                   else ValidationFigures.from_json(validation))


_SCALARS = ("step", "epoch", "loss", "lr", "tokens", "grad_norm", "samples", "skipped",
            "blocks", "noise_std", "data_wait_s", "step_s", "tokens_per_s")
