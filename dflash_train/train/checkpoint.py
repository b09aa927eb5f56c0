"""Training checkpoints: written whole or not at all, resumed exactly.

A checkpoint is a directory `checkpoints/step_00000100/` (its files named in run_layout)
holding
  drafter/          the drafter in the serving format (dflash export copies it),
  trainer.pt        optimiser, scheduler, step / epoch / batch position, RNG states,
  provenance.json   the store's provenance it was trained on (checked on resume and eval),
  config.toml       the resolved training config,
  checksums.json    sha256 of trainer.pt, provenance.json and config.toml (drafter/ keeps its
                    own), checked on resume so bit rot in any of them reads as damage,
  COMPLETE          written last; a directory without it is never trusted.
It is assembled under a temporary name (`.tmp-step_...`) and renamed into place, so a crash
mid-save leaves the previous checkpoint as the latest one; the next save removes the torn
temporary directory. A checkpoint is deleted (pruned, or replaced by a save of its step) by
renaming it to a temporary name first, so a crash mid-delete never leaves one half there.
"""

import json
import os
import pickle
import shutil
import signal
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash_train.drafter import DFlashDrafter, DrafterError, load_drafter, save_drafter
from dflash_train.drafter.config import DRAFTER_KINDS
from dflash_train.drafter.files import (
    DamagedFile,
    check_checkpoint_whole,
    check_finite,
    write_checksums,
)
from dflash_train.run_layout import (
    CHECKPOINTS,
    CHECKSUMMED,
    COMPLETE,
    CONFIG,
    DRAFTER_SUBDIR,
    PROVENANCE,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_dir,
)
from dflash_train.run_reader import complete_checkpoints
from dflash_train.store_schema import StoreError, StoreMeta
from dflash_train.store_schema.errors import one_line
from dflash_train.train.config import TrainConfig, train_config_from_dict
from dflash_train.train.errors import TrainError

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
    plan: list = field(default_factory=list)
    """[store, part, samples] of every part the batches are planned over (StoreLoader
    .plan_inputs): a resume over other parts would replay another plan. Empty in
    checkpoints written before it was recorded."""
    best_step: int | None = None
    """The step whose checkpoint scored best on the validation stores so far (train.validation;
    None: no validation yet)."""
    best_value: float | None = None
    """Its figure (validation.best_by)."""
    evaluations_since_best: int = 0
    """Validations since that one that did not beat it: run.patience counts these."""


@dataclass
class CheckpointContents:
    """Everything one checkpoint holds, gathered before the write starts."""

    model: torch.nn.Module
    """The drafter whose config and shape are saved (its weights come from model_state)."""
    model_state: dict
    """Full (gathered) weights, see parallel.full_states."""
    optimizer_state: dict
    """Full (gathered) optimizer state, see parallel.full_states."""
    scheduler: object
    """The LR scheduler (its state_dict goes into trainer.pt)."""
    state: TrainState
    provenance: StoreMeta
    """The store it trained on."""
    config_toml: str
    """The resolved training config, as written to config.toml."""


def save_checkpoint(run_dir: str | Path, contents: CheckpointContents, keep: int = 3,
                    spare: Path | None = None) -> Path:
    """Write a complete checkpoint for `contents.state.step` atomically; prune to the `keep`
    newest, `spare` (the run's best, train.best) apart.

    Weights or optimizer state holding NaN or Inf are refused before anything is written."""
    state = contents.state
    final = checkpoint_dir(run_dir, state.step)
    check_finite(contents.model_state, f"{final}: the drafter's weights")
    check_finite(contents.optimizer_state, f"{final}: the optimizer state")
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    remove_torn_saves(run_dir)
    tmp.mkdir(parents=True)
    save_drafter(contents.model, tmp / DRAFTER_SUBDIR, state_dict=contents.model_state)
    torch.save({
        "optimizer": contents.optimizer_state,
        "scheduler": contents.scheduler.state_dict(),
        "state": asdict(state),
        "torch_rng": torch.get_rng_state(),
    }, tmp / TRAINER_STATE)
    if os.environ.get(KILL_IN_SAVE_ENV) == str(state.step):
        os.kill(os.getpid(), signal.SIGKILL)
    (tmp / PROVENANCE).write_text(json.dumps(contents.provenance.to_dict(), indent=2))
    (tmp / CONFIG).write_text(contents.config_toml)
    write_checksums(tmp, list(CHECKSUMMED))
    (tmp / COMPLETE).write_text(f"step {state.step}\n")
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again (e.g. resumed exactly at it)
        _retire(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    prune_checkpoints(run_dir, keep, spare)
    return final


def prune_checkpoints(run_dir: str | Path, keep: int, spare: Path | None = None) -> None:
    """Delete complete checkpoints older than the `keep` newest (0 keeps all), never
    `spare`."""
    for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if spare is None or old.name != Path(spare).name:
            _retire(old)


def _retire(checkpoint: Path) -> None:
    """Delete a checkpoint, first renamed out of rotation: a kill mid-delete then leaves a
    temporary directory (removed by the next save), never a checkpoint that still has its
    COMPLETE marker but not all its files."""
    aside = checkpoint.parent / f"{TMP_PREFIX}{checkpoint.name}-retired-{os.getpid()}"
    checkpoint.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_torn_saves(run_dir: str | Path) -> None:
    """Delete temporary directories of saves a crash cut short (one writer per run dir)."""
    root = Path(run_dir) / CHECKPOINTS
    if root.is_dir():
        for torn in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(torn, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def check_provenance(checkpoint: StoreMeta, store: StoreMeta, store_url: str, where: str,
                     same_data: bool = False) -> None:
    """Refuse a store made from another target or layer set than the checkpoint's; with
    `same_data` (a resume), any store but the one it trained on. A store is known by its
    provenance (the target's weights fingerprint where both have one, the data's sha256, the
    parts planned, ...), never by its path: a copy or a move of it is the same store."""
    if same_data:
        diffs = checkpoint.mismatches(store)
        if diffs:
            other = ("a store of another target or layer set" if
                     checkpoint.target_mismatches(store) else "another store")
            raise TrainError(
                f"--resume: {where} was trained on {other} than {store_url} (checkpoint "
                "!= store):\n  " + "\n  ".join(diffs) + "\ngive the run's own store (a copy "
                "or a move of it is the same store), or start a new run with another --out")
        return
    diffs = checkpoint.target_mismatches(store)
    if diffs:
        raise TrainError(
            f"{where} was trained on a store of another target or layer set than {store_url} "
            "(checkpoint != store):\n  " + "\n  ".join(diffs))


BAD_FILE_ERRORS = (
    DrafterError, StoreError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError,
    KeyError, IndexError, TypeError, AttributeError, ImportError, FileNotFoundError,
    IsADirectoryError, NotADirectoryError,
)
"""What reading a truncated, bit-rotten or missing file raises (torch.load alone raises most of
these; JSON and TOML decode errors are ValueErrors). Not MemoryError, nor an OSError such as
EIO: those say nothing about the file, and one rank taking them for damage would resume from
another checkpoint than its peers."""


@dataclass
class TrainCheckpoint:
    """A complete checkpoint read back whole: what a resume continues from."""

    path: Path
    drafter: DFlashDrafter
    """The drafter as saved, built from its own config.json and weights, on CPU: the one a
    resume trains."""
    trainer: dict
    """trainer.pt: optimizer, scheduler, state, torch_rng."""
    provenance: StoreMeta
    """The store provenance it was trained on."""
    config: TrainConfig
    """The run's settings (its config.toml)."""
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    """Newer complete checkpoints a resume found unreadable and stepped over, newest first,
    with the reason (rundir.find_resume_point)."""


class SavedConfigError(TrainError):
    """A checkpoint's config.toml reads whole but is not a config this version accepts:
    not damage (an older checkpoint would not help), so a resume stops on it."""


def read_checkpoint(path: str | Path) -> TrainCheckpoint:
    """Everything a resume needs from a complete checkpoint; a file that does not read back
    whole (truncated, bit rot, a checksum that differs) is a TrainError naming it, a
    config.toml that reads but is refused a SavedConfigError. A checkpoint written before
    checksums.json existed is read without that check."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise TrainError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    try:
        check_checkpoint_whole(path)
    except DamagedFile as e:
        raise TrainError(f"{e.path} is damaged and cannot be read ({e.reason})") from e
    except DrafterError as e:  # an unreadable checksums.json
        raise TrainError(f"{path} is damaged and cannot be read ({one_line(e)})") from e
    try:
        file = path / TRAINER_STATE
        blob = torch.load(file, map_location="cpu", weights_only=False)
        missing = {"optimizer", "scheduler", "state", "torch_rng"} - set(blob)
        if missing:
            raise KeyError(f"no {sorted(missing)}")
        file = path / PROVENANCE
        provenance = StoreMeta.from_dict(json.loads(file.read_text()))
        file = path / CONFIG
        config = tomllib.loads(file.read_text())
        file = path / DRAFTER_SUBDIR
        drafter = load_drafter(path, checked_whole=True, kinds=DRAFTER_KINDS)
    except BAD_FILE_ERRORS as e:
        if _out_of_memory(e):
            raise
        raise TrainError(f"{file} is damaged and cannot be read "
                         f"({type(e).__name__}: {one_line(e)})") from e
    try:
        settings = train_config_from_dict(config)
    except TrainError as e:
        raise SavedConfigError(f"{path / CONFIG}: cannot read the run's saved config: {e}"
                               ) from e
    return TrainCheckpoint(path, drafter, blob, provenance, settings)


def restore_trainer(blob: dict, scheduler) -> tuple[TrainState, dict]:
    """Restore scheduler and RNG from trainer.pt contents; returns the run position and the
    full optimiser state (for parallel.load_optimizer_state)."""
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    return TrainState(**blob["state"]), blob["optimizer"]


def _out_of_memory(e: Exception) -> bool:
    """torch reports a failed CPU allocation as a RuntimeError: this process's trouble, not
    the file's."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text
                                            or "can't allocate memory" in text)


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
