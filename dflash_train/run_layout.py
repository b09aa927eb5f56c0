"""The name of every file a training run writes: its run directory, the checkpoints in it,
and the drafter directory each checkpoint (and each export) holds.

    RUN/                          a run directory (`--out`)
      .lock                       held by the live run's rank 0 (train.rundir.run_lock)
      config.toml                 the resolved training config
      log.jsonl                   one StepRecord per step (train.record)
      skipped.jsonl               damaged samples skipped under loader.skip_corrupt
      best.json                   the checkpoint best on the validation stores (train.best)
      tb/                         TensorBoard events (run.tensorboard)
      checkpoints/step_00000100/  a training checkpoint (train.checkpoint):
        drafter/                    a drafter directory, below
        trainer.pt                  optimiser, scheduler, position, RNG
        provenance.json             the store's provenance it was trained on
        config.toml                 the resolved training config, again
        checksums.json              sha256 of trainer.pt, provenance.json, config.toml
        COMPLETE                    written last; a directory without it is never trusted
      checkpoints/.tmp-step_...   a save in progress (or torn by a crash)
      checkpoints/damaged-step_.. a damaged checkpoint a resume stepped over
      aborted-N/                  what a run that stopped before its first checkpoint left

    DRAFTER/                      a drafter directory (drafter/checkpoint.py), what engines load
      config.json, model.safetensors (or .index.json + shards), modeling_dflash_train.py,
      checksums.json (written last)

Names only, and the one path rule built from them (checkpoint_dir); reads and writes
nothing. The drafter loader, train and `dflash log summary` all name files through here.
"""

from pathlib import Path

# -- a drafter directory ---------------------------------------------------------------------
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CHECKSUMS_NAME = "checksums.json"
"""sha256 of every other file a directory was written with; the checkpoint has its own."""
LOADER_MODULE = "modeling_dflash_train"
"""The module every drafter directory we write ships for transformers' AutoModel (auto_map)."""
LOADER_NAME = f"{LOADER_MODULE}.py"
LOADER_CLASS = "AutoModelLoader"
"""The class LOADER_MODULE re-exports (drafter.checkpoint.AutoModelLoader)."""
OWN_FILES = (CONFIG_NAME, WEIGHTS_NAME, LOADER_NAME, CHECKSUMS_NAME)
"""Everything save_drafter / export write: the only files an overwrite may replace."""

# -- a training checkpoint -------------------------------------------------------------------
DRAFTER_SUBDIR = "drafter"
"""Where a training checkpoint keeps its drafter directory."""
TRAINER_STATE = "trainer.pt"
PROVENANCE = "provenance.json"
"""A training checkpoint's record of the store it was trained on."""
CONFIG = "config.toml"
"""The resolved training config, in the run directory and in each checkpoint."""
COMPLETE = "COMPLETE"
"""A training checkpoint's marker, written last (train.checkpoint.save_checkpoint)."""
CHECKPOINT_FILES = (COMPLETE, TRAINER_STATE, PROVENANCE)
"""Files only a training checkpoint holds beside drafter/: any one of them marks the
directory as one (z-lab / HF drafter directories hold none; a run directory holds a
config.toml too, so that is no mark)."""
CHECKSUMMED = (TRAINER_STATE, PROVENANCE, CONFIG)
"""The checkpoint's own files recorded in its checksums.json (drafter/ has its own record)."""
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"
"""A damaged checkpoint a resume stepped over is renamed `damaged-step_...`: out of rotation
(`step_*`), so a later save can neither prune the resumed run's checkpoints for it nor take
it for the latest."""

# -- a run directory -------------------------------------------------------------------------
CHECKPOINTS = "checkpoints"
LOG = "log.jsonl"
SKIPPED = "skipped.jsonl"
"""Each damaged sample skipped under loader.skip_corrupt, one JSON line per sample."""
BEST = "best.json"
"""Which checkpoint scored best on the validation stores (--val-store), and by what figure:
never rotated out by run.keep_checkpoints; `dflash export RUN` and `dflash eval RUN` take it."""
TENSORBOARD = "tb"
LOCK_FILE = ".lock"
"""Held (flock) by rank 0 of the run using the directory; the kernel drops it when that
process dies, so a crashed run never leaves a stale lock."""
RUN_FILES = (CHECKPOINTS, LOG, CONFIG, SKIPPED, TENSORBOARD, BEST)
"""What a run leaves in its directory; any of them means the directory holds a run."""
ABORTED_PREFIX = "aborted-"
"""A run that stopped before its first checkpoint leaves files a new run moves to
`aborted-N/` (never deleted) before it starts in the same directory."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """The checkpoint of `step` in a run directory: names sort in step order."""
    return Path(run_dir) / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"
