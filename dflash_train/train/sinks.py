"""Where a run's step records go: log.jsonl and TensorBoard (rank 0), the progress bar, and
the ledger of damaged samples skipped (every rank appends its own).

Writes only into the run directory, one line per record; never decides anything about the
run (train.health stops it, train.loop drives it).
"""

import json
from pathlib import Path

from tqdm import tqdm

from dflash_train.train.errors import TrainError
from dflash_train.train.record import StepRecord


class RunLog:
    """log.jsonl, one JSON object per step (appended: a resumed run continues the file), and
    the same numbers as TensorBoard scalars when asked for."""

    def __init__(self, path: Path, tensorboard_dir: Path | None):
        self.file = path.open("a")
        self.board = _tensorboard(tensorboard_dir) if tensorboard_dir is not None else None

    def write(self, record: StepRecord) -> None:
        line = record.to_json()
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()  # `dflash log summary` and users' tail -f read it while it runs
        if self.board is not None:
            _board_write(self.board, line)

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def _tensorboard(directory: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise TrainError("run.tensorboard needs tensorboardX: "
                         "pip install 'dflash-train[tb]'") from e
    return SummaryWriter(str(directory))


def _board_write(board, line: dict) -> None:
    """The log line's numbers as scalars; per-slot accuracy as one scalar per slot."""
    step = line["step"]
    for key, value in line.items():
        if key in ("step", "epoch"):
            continue
        if key == "slot_acc":
            for slot, acc in enumerate(value, 1):
                if acc is not None:
                    board.add_scalar(f"slot_acc/{slot:02d}", acc, step)
        elif isinstance(value, (int, float)) and value is not None:
            board.add_scalar(key, value, step)


def progress_bar(total: int, initial: int, shown: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not shown, desc="train", unit="step",
                dynamic_ncols=True)


class SkipLedger:
    """Damaged samples skipped by this rank: each is announced and listed once (a sample
    skipped again in a later epoch is not repeated)."""

    def __init__(self, path: Path, rank: int, echo):
        self.path, self.rank, self.echo = path, rank, echo
        self.seen: set[tuple] = set()

    @property
    def count(self) -> int:
        return len(self.seen)

    def record(self, damage, step: int) -> None:
        key = (damage.store, damage.part, damage.sample)
        if key in self.seen:
            return
        self.seen.add(key)
        self.echo(f"skipping damaged data (--skip-corrupt): {damage}")
        line = json.dumps({"step": step, "rank": self.rank, **damage.as_dict()}) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # one small append per line: ranks may share the file
            f.write(line)
