"""Whether a run may start or resume in a run directory, and from which checkpoint.

Owns three refusals: a new run in a directory that already holds one (the two would share
checkpoint rotation by step number, one log and one config.toml), a resume whose settings
differ from the run's in anything that shapes the trained weights, and a checkpoint that
cannot be read. Never deletes anything: the one write is moving a damaged checkpoint out of
rotation (renamed, kept for inspection) when a resume falls back to the one before it.
"""

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.train.checkpoint import CHECKPOINTS, CONFIG, complete_checkpoints, read_checkpoint
from dflash.train.config import TrainConfig, config_from_dict
from dflash.train.errors import TrainError
from dflash.train.options import option_name

RUN_FILES = (CHECKPOINTS, "log.jsonl", CONFIG, "skipped.jsonl", "tb")
"""What a run leaves in its directory; any of them means the directory holds a run."""

DAMAGED_PREFIX = "damaged-"
"""A damaged checkpoint a resume stepped over is renamed `damaged-step_...`: out of rotation
(`step_*`), so a later save can neither prune the resumed run's checkpoints for it nor take
it for the latest."""

RUN_MANAGEMENT_FIELDS = frozenset({
    "run.out_dir",  # the directory may have been moved; it is the one being resumed
    "run.progress",
    "run.log_every",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.tensorboard",
    "run.fsdp",  # shards the same computation; proven equal to DDP / one process
    "run.gradient_checkpointing",  # recomputes activations in backward, same values
    "loader.prefetch_batches",  # read-ahead and readers: the plan is fixed by seed and offsets
    "loader.workers",
    "loader.unit_cache_tokens",
    "loader.skip_corrupt",  # a run stopped by damage may resume skipping it; the plan holds
    "loss.chunk_rows",  # lm_head chunking of the same loss
})
"""The fields a `--resume` may change: how a run is watched, kept, read or memory-budgeted,
never which weights it computes. Every other field must equal the checkpoint's config.toml."""


@dataclass
class ResumePoint:
    """The newest checkpoint that reads whole, and what was read from it."""

    path: Path
    drafter_state: dict
    trainer: dict
    """trainer.pt: optimizer, scheduler, state, torch_rng."""
    damaged: list[tuple[Path, str]]
    """Newer complete checkpoints that could not be read, newest first, with the reason."""


def refuse_file(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainError(f"--out {run_dir} is a file, not a directory; choose another --out")


def check_new_run_dir(run_dir: Path) -> None:
    """Refuse to start a new run where one already lives (nothing is touched)."""
    refuse_file(run_dir)
    found = complete_checkpoints(run_dir)
    if found:
        raise TrainError(f"{run_dir} already holds a run ({found[-1].relative_to(run_dir)}); "
                         "pass --resume to continue it or choose another --out")
    leftovers = [name for name in RUN_FILES if (run_dir / name).exists()]
    if leftovers:
        raise TrainError(f"{run_dir} already holds a run ({', '.join(leftovers)}) with no "
                         "complete checkpoint to resume; choose another --out, or remove "
                         "those to start over there")


def find_resume_point(run_dir: Path) -> ResumePoint:
    """The newest complete checkpoint whose weights and trainer state read back whole."""
    refuse_file(run_dir)
    found = complete_checkpoints(run_dir)
    if not found:
        raise TrainError(f"--resume: no complete checkpoint under {run_dir / CHECKPOINTS}")
    damaged = []
    for path in reversed(found):
        try:
            drafter_state, trainer = read_checkpoint(path)
        except TrainError as e:
            damaged.append((path, str(e)))
            continue
        return ResumePoint(path, drafter_state, trainer, damaged)
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


def saved_config(checkpoint: Path) -> TrainConfig:
    """The config a checkpoint was trained with (its config.toml)."""
    file = checkpoint / CONFIG
    try:
        return config_from_dict(tomllib.loads(file.read_text()))
    except (OSError, tomllib.TOMLDecodeError, TrainError) as e:
        raise TrainError(f"{file}: cannot read the run's saved config: {e}") from e


def config_changes(saved: TrainConfig, new: TrainConfig) -> list[str]:
    """'field: old -> new' for every field outside RUN_MANAGEMENT_FIELDS that differs."""
    a, b = _flat(saved.to_dict()), _flat(new.to_dict())
    return [f"{option_name(k)}: {_show(a.get(k))} -> {_show(b.get(k))}"
            for k in sorted(a.keys() | b.keys())
            if k not in RUN_MANAGEMENT_FIELDS and _norm(a.get(k)) != _norm(b.get(k))]


def check_resume_config(checkpoint: Path, new: TrainConfig) -> None:
    """Refuse a resume whose settings would train other weights than the run's."""
    changes = config_changes(saved_config(checkpoint), new)
    if changes:
        raise TrainError(
            f"--resume: these settings differ from the run's ({checkpoint / CONFIG}), which a "
            "resume cannot change (old -> new):\n  " + "\n  ".join(changes)
            + "\nrepeat the run's settings, or start a new run with another --out")


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
