"""The run's best checkpoint: the marker (RUN/best.json) the training loop writes when a
checkpoint scores best on the validation stores, and which checkpoint a run directory stands
for when `dflash export RUN` or `dflash eval RUN` is handed one.

The marker only ever names a complete checkpoint: the loop writes it once the checkpoint is
whole, and rotation (train.checkpoint.save_checkpoint's `spare`) never deletes the one it
names. Never decides what "best" is (train.validation does) and never deletes a checkpoint.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_train.run_layout import BEST, CHECKPOINTS, COMPLETE, checkpoint_dir
from dflash_train.train.checkpoint import TrainState, complete_checkpoints
from dflash_train.train.errors import TrainError


@dataclass
class BestMark:
    """What best.json holds."""

    step: int
    """The step of the best checkpoint (RUN/checkpoints/step_N)."""
    figure: str
    """The validation figure it is best by: `tau` (the chain's) or `tree_tau@B`."""
    value: float
    """Its value there, pooled over the validation stores."""

    def checkpoint(self, run_dir: str | Path) -> Path:
        return checkpoint_dir(run_dir, self.step)


def write_best(run_dir: str | Path, mark: BestMark) -> None:
    """Mark `mark`'s checkpoint (complete: the caller saved it) as the run's best; a crash
    leaves the old marker or the new one, never a torn file."""
    path = Path(run_dir) / BEST
    tmp = path.with_name(f".{BEST}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(mark), indent=1) + "\n")
    os.replace(tmp, path)


def mark_best(run_dir: str | Path, state: TrainState, figure: str) -> Path | None:
    """Point best.json at the checkpoint of `state.best_step` when it is there whole, and
    return it; else remove a marker naming anything else (a resume that stepped back over
    a damaged checkpoint: the best it knows may be gone) and return None."""
    if state.best_step is not None:
        mark = BestMark(state.best_step, figure, state.best_value)
        if (mark.checkpoint(run_dir) / COMPLETE).is_file():
            write_best(run_dir, mark)
            return mark.checkpoint(run_dir)
    (Path(run_dir) / BEST).unlink(missing_ok=True)
    return None


def read_best(run_dir: str | Path) -> BestMark | None:
    """The run's marker, or None when it has none (no validation, or none done yet)."""
    path = Path(run_dir) / BEST
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        mark = BestMark(step=raw["step"], figure=raw["figure"], value=raw["value"])
        if not isinstance(mark.step, int) or isinstance(mark.step, bool) or mark.step < 1:
            raise ValueError(f"step {mark.step!r} is not a positive integer")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise TrainError(f"{path} is unreadable ({type(e).__name__}: {e}); name a checkpoint "
                         f"({Path(run_dir) / CHECKPOINTS}/step_N) instead") from e
    return mark


def marked_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint best.json names, None without a marker; a TrainError when that
    checkpoint is not there whole (a run directory copied in part, or edited)."""
    mark = read_best(run_dir)
    if mark is None:
        return None
    path = mark.checkpoint(run_dir)
    if not (path / COMPLETE).is_file():
        raise TrainError(f"{Path(run_dir) / BEST} names step {mark.step}, but {path} is not a "
                         "complete checkpoint (copied in part?); name a checkpoint instead")
    return path


def is_run_dir(path: str | Path) -> bool:
    """A training run directory (it holds checkpoints/), not a checkpoint or drafter."""
    return (Path(path) / CHECKPOINTS).is_dir()


def run_checkpoint(run_dir: str | Path) -> tuple[Path, str]:
    """The checkpoint a run directory stands for, with why in a few words: its best on the
    validation stores (best.json), else its newest complete one."""
    best = marked_checkpoint(run_dir)
    if best is not None:
        mark = read_best(run_dir)
        return best, f"its best checkpoint ({mark.figure} {mark.value:.4f} on validation)"
    found = complete_checkpoints(run_dir)
    if not found:
        raise TrainError(f"{run_dir} holds no complete checkpoint under {CHECKPOINTS}/")
    return found[-1], "its newest checkpoint (the run has no validation: no best.json)"
