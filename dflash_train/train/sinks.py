"""Where a run's step records go: log.jsonl and TensorBoard (rank 0), the progress bar, and
the ledger of damaged samples skipped (every rank appends its own). `Sinks` holds one of each;
its defaults do nothing, so a rank above 0 or a run in memory is not asked which it is.

Writes only into the run directory, one line per record; never decides anything about the
run (train.health stops it, train.loop drives it).
"""

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from dflash_train.train.errors import TrainError
from dflash_train.train.record import StepRecord


class RunLog:
    """log.jsonl, one JSON object per step (appended: a resumed run continues the file), and
    the same numbers as TensorBoard scalars when asked for."""

    def __init__(self, path: Path, tensorboard_dir: Path | None):
        cut_torn_tail(path)
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


def cut_torn_tail(path: Path) -> int:
    """Cut what follows the last newline of `path` (a line a crash cut mid-write: a record
    is whole only with its newline), so the next record starts a line of its own instead
    of being glued to the torn one. Returns the bytes cut."""
    if not path.is_file():
        return 0
    with path.open("rb+") as f:
        end = f.seek(0, os.SEEK_END)
        keep = end
        while keep > 0:
            start = max(0, keep - _TAIL_BLOCK)
            f.seek(start)
            newline = f.read(keep - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
        if keep < end:
            f.truncate(keep)
    return end - keep


_TAIL_BLOCK = 1 << 16


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
        elif key == "validation":
            _board_validation(board, value, step)
        elif isinstance(value, (int, float)) and value is not None:
            board.add_scalar(key, value, step)


def _board_validation(board, figures: dict, step: int) -> None:
    """The validation figures as val/tau, val/tree_tau_B (pooled over the stores) and, with
    several stores, val/<store>/... each; val/seconds what it took."""
    stores = figures["stores"]
    tags = [("val", figures)] + ([(f"val/{Path(url).name}", f) for url, f in stores.items()]
                                 if len(stores) > 1 else [])
    for tag, figure in tags:
        if figure["tau"] is not None:
            board.add_scalar(f"{tag}/tau", figure["tau"], step)
        for budget, tau in figure["tree_tau"].items():
            if tau is not None:
                board.add_scalar(f"{tag}/tree_tau_{budget}", tau, step)
    board.add_scalar("val/seconds", figures["seconds"], step)


class NullLog:
    """The log of a rank above 0, or of a run in memory: records go nowhere."""

    def write(self, record: StepRecord) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, initial: int, shown: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not shown, desc="train", unit="step",
                dynamic_ncols=True)


class SkipLedger:
    """Damaged samples skipped by this rank: each is announced and listed once (a sample
    skipped again in a later epoch is not repeated) in `path` (None: counted only)."""

    def __init__(self, path: Path | None, rank: int, echo: Callable[[str], None]):
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
        if self.path is None:
            return
        line = json.dumps({"step": step, "rank": self.rank, **damage.as_dict()}) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # one small append per line: ranks may share the file
            f.write(line)

    def summarise(self) -> None:
        """The run's last word on damage: how many were skipped and where they are listed."""
        if self.count:
            self.echo(f"skipped {self.count} damaged sample(s) or part(s) (--skip-corrupt); "
                      f"listed in {self.path}")


def _silent(_: str) -> None:
    pass


@dataclass
class Sinks:
    """Where the loop's records go. The defaults do nothing: a rank above 0 gets them for the
    log and the bar (rank 0 logs and shows progress for all), a run in memory for all three."""

    log: RunLog | NullLog = field(default_factory=NullLog)
    bar: tqdm = field(default_factory=lambda: progress_bar(0, 0, shown=False))
    skipped: SkipLedger = field(default_factory=lambda: SkipLedger(None, 0, _silent))
