"""Whether a run may start or resume in a run directory, and from which checkpoint.

Owns three refusals: a new run in a directory that already holds one (the two would share
checkpoint rotation by step number, one log and one config.toml), a resume whose settings
differ from the run's in anything that shapes the trained weights, and a checkpoint that
cannot be read. Never deletes anything: the writes are moving a damaged checkpoint out of
rotation (renamed, kept for inspection) when a resume falls back to the one before it, and
moving the leftovers of a run that stopped before its first checkpoint into `aborted-N/`.
"""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_train.drafter import DrafterConfig
from dflash_train.run_layout import (
    ABORTED_PREFIX,
    CHECKPOINTS,
    COMPLETE,
    CONFIG,
    CONFIG_NAME,
    DAMAGED_PREFIX,
    LOCK_FILE,
    RUN_FILES,
    STEP_PREFIX,
)
from dflash_train.run_reader import training_checkpoint_root
from dflash_train.train.checkpoint import (
    SavedConfigError,
    TrainCheckpoint,
    complete_checkpoints,
    read_checkpoint,
)
from dflash_train.train.config import TrainConfig, load_train_config, to_toml
from dflash_train.train.drafter_shape import drafter_settings
from dflash_train.train.errors import TrainError
from dflash_train.train.options import option_name

RUN_MANAGEMENT_FIELDS = frozenset({
    "run.out_dir",  # the directory may have been moved; it is the one being resumed
    "stores",  # a store is its content, not its path: checkpoint.check_provenance(same_data)
    "run.device",  # where the run executes (auto vs cpu); precision stays compared
    "run.progress",
    "run.log_every",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.patience",  # when a run gives up, not what it computes: raised to train on
    "run.tensorboard",
    "run.fsdp",  # shards the same computation; proven equal to DDP / one process
    "run.gradient_checkpointing",  # recomputes activations in backward, same values
    "run.attention",  # the same attention computed another way, same values up to rounding
    "run.chunk_blocks",  # the same blocks in chunks, recomputed in backward, same values
    "loader.prefetch_batches",  # read-ahead and readers: the plan is fixed by seed and offsets
    "loader.workers",
    "loader.unit_cache_tokens",
    "loader.skip_corrupt",  # a run stopped by damage may resume skipping it; the plan holds
    "loss.chunk_rows",  # lm_head chunking of the same loss
})
"""The fields a `--resume` may change: how a run is watched, kept, read or memory-budgeted,
never which weights it computes. Every other field must equal the checkpoint's config.toml,
except a `model.*` field left at None (its default), which takes whatever the checkpoint has."""

@contextlib.contextmanager
def run_lock(run_dir: Path, rank: int) -> Iterator[None]:
    """One live run per directory: a second `train` on it (new or --resume) is refused
    while the first runs, instead of both writing checkpoints into one rotation."""
    if rank != 0:
        yield
        return
    check_run_dir_path(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 -- held for the whole run
    except OSError as e:
        raise TrainError(f"--out {run_dir}: cannot create the run directory: {e}") from e
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise TrainError(f"{run_dir} is in use by a running `dflash train` ({holder}); "
                             "wait for it or choose another --out") from e
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing drops the flock
        if created and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
            # refused before writing anything: leave no directory behind
            (run_dir / LOCK_FILE).unlink()
            run_dir.rmdir()


def check_run_dir_path(run_dir: Path) -> None:
    """Refuse an --out that cannot be a run directory: a file, or a drafter or training
    checkpoint directory (a run there would move the checkpoint's own config.toml aside and
    write its log and checkpoints into it)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainError(f"--out {run_dir} is a file, not a directory; choose another --out")
    checkpoint = training_checkpoint_root(run_dir)
    if checkpoint is not None:
        run = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None
        hint = f"to continue its run pass --out {run} --resume, " if run else ""
        raise TrainError(f"--out {run_dir} is {'' if checkpoint == run_dir else 'inside '}the "
                         f"training checkpoint {checkpoint}, not a run directory; {hint}"
                         "or choose another --out")
    if (run_dir / CONFIG_NAME).is_file():
        raise TrainError(f"--out {run_dir} holds a model ({CONFIG_NAME}), not a run; choose "
                         "another --out")


def check_new_run_dir(run_dir: Path) -> None:
    """Refuse to start a new run where one with a complete checkpoint lives (nothing is
    touched); leftovers of a run without one are moved aside by set_aside_leftovers."""
    check_run_dir_path(run_dir)
    found = complete_checkpoints(run_dir)
    if found:
        raise TrainError(f"{run_dir} already holds a run ({found[-1].relative_to(run_dir)}); "
                         "pass --resume to continue it or choose another --out")


def set_aside_leftovers(run_dir: Path) -> tuple[list[str], Path] | None:
    """Move what a run that stopped before its first complete checkpoint left (log, config,
    skipped list, tb/, torn saves) into a fresh `aborted-N/`; returns (moved, where), or None
    when there is nothing. Call only after check_new_run_dir, on one rank."""
    leftovers = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not leftovers:
        return None
    n = 1
    while (aside := run_dir / f"{ABORTED_PREFIX}{n}").exists():
        n += 1
    aside.mkdir()
    for name in leftovers:
        (run_dir / name).rename(aside / name)
    held = incomplete_checkpoints(aside)
    if held:  # said, not moved silently: a copy cut short may hold weights worth keeping
        leftovers[leftovers.index(CHECKPOINTS)] = (f"{CHECKPOINTS} (holding {', '.join(held)}, "
                                                   "none complete)")
    return leftovers, aside


def incomplete_checkpoints(run_dir: Path) -> list[str]:
    """Checkpoint directories under RUN/checkpoints/ without a COMPLETE marker (a save or a
    copy cut short, or one a resume stepped over as damaged); torn temporary saves aside."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith(
        (STEP_PREFIX, DAMAGED_PREFIX)) and not (p / COMPLETE).is_file())


def find_resume_point(run_dir: Path) -> TrainCheckpoint:
    """The newest complete checkpoint whose files all read back whole (checksums, weights,
    trainer state, provenance, config), with the newer ones it stepped over as damaged."""
    check_run_dir_path(run_dir)
    found = complete_checkpoints(run_dir)
    if not found:
        held = incomplete_checkpoints(run_dir)
        named = (f" (it holds {', '.join(held)}, without the {COMPLETE} marker a whole save "
                 "writes last: saves or copies cut short)" if held else "")
        raise TrainError(f"--resume: no complete checkpoint under {run_dir / CHECKPOINTS}"
                         f"{named}; run without --resume to start a new run there (what an "
                         f"earlier attempt left is moved to {ABORTED_PREFIX}N/)")
    damaged = []
    for path in reversed(found):
        try:
            return replace(read_checkpoint(path), damaged=damaged)
        except SavedConfigError:
            raise
        except TrainError as e:
            damaged.append((path, str(e)))
    raise TrainError(f"--resume: no checkpoint under {run_dir / CHECKPOINTS} reads whole; "
                     f"the newest: {damaged[0][1]}")


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of rotation; returns its new path."""
    aside = path.with_name(DAMAGED_PREFIX + path.name)
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{DAMAGED_PREFIX}{n}-{path.name}"), n + 1
    path.rename(aside)
    return aside


def local_paths_absolute(stores: list[str]) -> list[str]:
    """Store locations as a run records and compares them: a local path made absolute (the
    same store whatever the cwd), a URL (`s3://...`) unchanged."""
    return [s if "://" in s else os.path.abspath(s) for s in stores]


def check_same_plan(saved: list, now: list, checkpoint: Path) -> None:
    """Refuse a resume whose stores now offer other parts (or other sample counts) than the
    run planned over: its batches and schedule would silently be another run's."""
    if not saved or [list(x) for x in saved] == [list(x) for x in now]:
        return
    before, after = {tuple(x) for x in saved}, {tuple(x) for x in now}
    gone = sorted(before - after)
    new = sorted(after - before)

    def show(items):
        return ", ".join(f"store {s} part {p} ({n} samples)" for s, p, n in items) or "none"

    raise TrainError(f"--resume: the stores' usable parts changed since {checkpoint} (an "
                     f"unfinished part completed, or a part became damaged); no longer "
                     f"there: {show(gone)}; new: {show(new)}. Resume with the stores as they "
                     "were, or start a new run with another --out")


def config_changes(saved: TrainConfig, new: TrainConfig,
                   drafter: DrafterConfig | None = None) -> list[str]:
    """'field: old -> new' for every field outside RUN_MANAGEMENT_FIELDS that differs.

    A `model.*` field that `new` leaves at None means "whatever the run has" and is not
    compared; one it sets is compared with the checkpoint's `drafter` where given (the
    shape it really has, whatever defaults resolved it at the time), else with `saved`."""
    a, b = _flat(saved.to_dict()), _flat(new.to_dict())
    if drafter is not None:
        a |= {k: v for k, v in drafter_settings(drafter).items() if v is not None}
    for side in (a, b):
        side["stores"] = local_paths_absolute(side.get("stores") or [])
    return [f"{option_name(k)}: {_show(a.get(k))} -> {_show(b.get(k))}"
            for k in sorted(a.keys() | b.keys())
            if k not in RUN_MANAGEMENT_FIELDS
            and not (k.startswith("model.") and b.get(k) is None)
            and _norm(a.get(k)) != _norm(b.get(k))]


def check_resume_config(point: TrainCheckpoint, new: TrainConfig) -> None:
    """Refuse a resume whose settings would train other weights than the run's, or that
    would silently rewrite a RUN/config.toml edited since the run wrote it."""
    changes = config_changes(point.config, new, point.drafter.config)
    if changes:
        raise TrainError(
            f"--resume: {_fallback(point)}these settings differ from the run's "
            f"({point.path / CONFIG}), which a resume cannot change (old -> new):\n  "
            + "\n  ".join(changes)
            + "\nrepeat the run's settings, or start a new run with another --out")
    check_run_config_kept(point, new)


def _fallback(point: TrainCheckpoint) -> str:
    """The damaged newer checkpoints a resume stepped over, said before a refusal that
    compares with `point`: else an edit to the newest one's config.toml (which breaks its
    checksum) reads as if an older step's settings were the run's last."""
    if not point.damaged:
        return ""
    (newest, reason), others = point.damaged[0], len(point.damaged) - 1
    more = f" (and {others} more damaged checkpoint{'s' * (others > 1)})" if others else ""
    return (f"the newest checkpoint, {newest.name}, cannot be used: {reason}{more}; the "
            f"resume falls back to {point.path.name}, and ")


def check_run_config_kept(point: TrainCheckpoint, new: TrainConfig) -> None:
    """RUN/config.toml is what the run wrote, never read back: a resume takes its settings
    from the command line and --config, and rewrites it. Refuse one that says otherwise
    than both the checkpoint and this resume (edited by hand, thinking it is read), naming
    the settings, instead of overwriting it."""
    path = point.path.parent.parent / CONFIG
    if not path.is_file():
        return
    try:
        text = path.read_text(encoding="utf-8")
        if text in (to_toml(new), (point.path / CONFIG).read_text(encoding="utf-8")):
            return
        written = load_train_config(str(path), {})
    except (OSError, UnicodeDecodeError, TrainError) as e:
        raise TrainError(f"--resume: {path} is not the config the run wrote ({e}); a resume "
                         "rewrites it with the run's settings: restore it, or move it away "
                         "to keep it") from e
    a, b, c = (_flat(x.to_dict()) for x in (written, point.config, new))
    b |= {k: v for k, v in drafter_settings(point.drafter.config).items() if v is not None}
    edited = [f"{option_name(k)}: {_show(a.get(k))} in the file, {_show(c.get(k))} resumed"
              for k in sorted(a.keys() | c.keys()) if k != "run.out_dir"
              and not (k.startswith("model.") and c.get(k) is None)  # the run's own, as above
              and _norm(a.get(k)) not in (_norm(b.get(k)), _norm(c.get(k)))]
    if edited:
        raise TrainError(
            f"--resume: {_fallback(point)}{path} says otherwise than the run (edited?), and a "
            "resume reads no settings from it, it rewrites it:\n  " + "\n  ".join(edited)
            + f"\nto resume with what it says pass --config {path} (settings that shape the "
            "weights cannot change on a resume), or undo the edit")


def _flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        out |= _flat(v, f"{key}.") if isinstance(v, dict) else {key: v}
    return out


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return repr(value)
