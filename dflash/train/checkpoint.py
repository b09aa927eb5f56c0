"""Training checkpoints: written whole or not at all, resumed exactly.

A checkpoint is a directory `checkpoints/step_00000100/` holding
  drafter/          the drafter in the serving format (dflash export copies it),
  trainer.pt        optimiser, scheduler, step / epoch / batch position, RNG states,
  provenance.json   the store's provenance it was trained on (checked on resume and eval),
  config.toml       the resolved training config,
  COMPLETE          written last; a directory without it is never trusted.
It is assembled under a temporary name (`.tmp-step_...`) and renamed into place, so a crash
mid-save leaves the previous checkpoint as the latest one; the next save removes the torn
temporary directory.
"""

import json
import os
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash.drafter import DRAFTER_SUBDIR, load_drafter, save_drafter
from dflash.store_schema import StoreMeta
from dflash.train.errors import TrainError

COMPLETE = "COMPLETE"
PROVENANCE = "provenance.json"
TRAINER_STATE = "trainer.pt"
CONFIG = "config.toml"
CHECKPOINTS = "checkpoints"
TMP_PREFIX = ".tmp-"
KILL_IN_SAVE_ENV = "DFLASH_TRAIN_KILL_IN_SAVE_STEP"
"""Fault injection for the crash tests: SIGKILL this process while it writes the checkpoint of
that step, after the weights and trainer state are on disk, before the marker and rename."""


@dataclass
class TrainState:
    """Where the run is: resume continues from exactly here."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def save_checkpoint(
    run_dir: str | Path,
    model: torch.nn.Module,
    model_state: dict,
    optimizer_state: dict,
    scheduler,
    state: TrainState,
    provenance: StoreMeta,
    config_toml: str,
    keep: int = 3,
) -> Path:
    """Write a complete checkpoint for `state.step` atomically; prune to the `keep` newest.

    model_state / optimizer_state: full (gathered) states, see parallel.full_states."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    remove_torn_saves(run_dir)
    tmp.mkdir(parents=True)
    save_drafter(model, tmp / DRAFTER_SUBDIR, state_dict=model_state)
    torch.save({
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "state": asdict(state),
        "torch_rng": torch.get_rng_state(),
    }, tmp / TRAINER_STATE)
    if os.environ.get(KILL_IN_SAVE_ENV) == str(state.step):
        os.kill(os.getpid(), signal.SIGKILL)
    (tmp / PROVENANCE).write_text(json.dumps(provenance.to_dict(), indent=2))
    (tmp / CONFIG).write_text(config_toml)
    (tmp / COMPLETE).write_text(f"step {state.step}\n")
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again (e.g. resumed exactly at it)
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_torn_saves(run_dir: str | Path) -> None:
    """Delete temporary directories of saves a crash cut short (one writer per run dir)."""
    root = Path(run_dir) / CHECKPOINTS
    if root.is_dir():
        for torn in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(torn, ignore_errors=True)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_provenance(path: str | Path) -> StoreMeta | None:
    """The store provenance a checkpoint was trained on, or None for a bare drafter dir."""
    file = Path(path) / PROVENANCE
    if not file.is_file():
        return None
    return StoreMeta.from_dict(json.loads(file.read_text()))


def check_provenance(checkpoint: StoreMeta, store: StoreMeta, store_url: str, where: str) -> None:
    """Refuse a store made from another target or layer set than the checkpoint's."""
    diffs = checkpoint.target_mismatches(store)
    if diffs:
        raise TrainError(
            f"{where} was trained on a store of another target or layer set than {store_url} "
            "(checkpoint != store):\n  " + "\n  ".join(diffs))


def read_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(drafter state_dict, trainer.pt contents) of a complete checkpoint; a file that does not
    read back whole (truncated, bit rot) is a TrainError naming it."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise TrainError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    try:
        blob = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
        missing = {"optimizer", "scheduler", "state", "torch_rng"} - set(blob)
        if missing:
            raise KeyError(f"no {sorted(missing)}")
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise TrainError(f"{path / TRAINER_STATE} is damaged and cannot be read "
                         f"({type(e).__name__}: {_first_line(e)})") from e
    try:
        drafter_state = load_drafter(path).state_dict()
    except Exception as e:  # a truncated safetensors or config.json
        raise TrainError(f"{path / DRAFTER_SUBDIR} is damaged and cannot be read "
                         f"({type(e).__name__}: {_first_line(e)})") from e
    return drafter_state, blob


def restore_trainer(blob: dict, scheduler) -> tuple[TrainState, dict]:
    """Restore scheduler and RNG from trainer.pt contents; returns the run position and the
    full optimiser state (for parallel.load_optimizer_state)."""
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    return TrainState(**blob["state"]), blob["optimizer"]


def load_trainer_state(path: str | Path, scheduler) -> tuple[TrainState, dict]:
    """Restore scheduler and RNG from a checkpoint; returns the run position and the full
    optimiser state (for parallel.load_optimizer_state)."""
    return restore_trainer(read_checkpoint(path)[1], scheduler)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
