"""The run's best checkpoint: the marker (RUN/best.json) the training loop writes when a
checkpoint scores best on the validation stores.

The marker only ever names a complete checkpoint: the loop writes it once the checkpoint is
whole, and rotation (train.checkpoint.save_checkpoint's `spare`) never deletes the one it
names. Reading it, and which checkpoint a run directory stands for, live below every stage
(dflash_train.run_reader). Never decides what "best" is (train.validation does) and never
deletes a checkpoint.
"""

import json
import os
from dataclasses import asdict
from pathlib import Path

from dflash_train.run_layout import BEST, COMPLETE
from dflash_train.run_reader import BestMark
from dflash_train.train.checkpoint import TrainState


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
