"""Load the checkpoints `dflash eval` compares and refuse those that do not fit the store.

Three kinds of directory load the same way (dflash_train.drafter.load_drafter): a training
checkpoint (`drafter/` + `provenance.json`, the StoreMeta it was trained on), an exported
drafter and a third-party DFlash or DFlash 2 drafter in the published HF format (config.json +
model.safetensors). A checkpoint is refused, naming both values, when its target, layer ids
or vocabulary differ from the store's: a training checkpoint by its provenance (the rule
training applies on resume, StoreMeta.target_mismatches), every checkpoint by what its
config.json carries (hidden, vocab, target layer count, layer ids; a drafter reading a subset
of the store's layers takes them by id). A training run directory stands for its best
checkpoint on validation, else its newest (run_reader.run_checkpoint). This module never
runs a model.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.drafter import DFlashDrafter, DrafterConfig, DrafterError, load_drafter
from dflash_train.drafter.config import DRAFTER_KINDS
from dflash_train.evaluate.errors import EvalError
from dflash_train.run_layout import PROVENANCE
from dflash_train.run_reader import (
    RunDirError,
    is_run_dir,
    read_provenance,
    run_checkpoint,
    training_checkpoint_root,
)
from dflash_train.store_schema import StoreMeta


@dataclass
class EvalCheckpoint:
    """A loaded drafter and where it came from."""

    name: str
    """Short unique name shown in tables (the directory name)."""
    path: str
    """The path as given on the command line."""
    model: DFlashDrafter
    """The drafter, without the target head attached."""
    provenance: StoreMeta | None
    """The store a training checkpoint was trained on; None for a bare drafter directory."""

    @property
    def config(self) -> DrafterConfig:
        return self.model.config


def compatibility_problems(
    config: DrafterConfig, provenance: StoreMeta | None, store: StoreMeta
) -> list[str]:
    """Every reason the drafter cannot be evaluated on the store, each naming both values."""
    t = store.target
    problems = []
    if provenance is not None:
        # The same rule training applies on resume: another target, tokenizer or layer set.
        problems += [f"{d} (checkpoint != store)" for d in provenance.target_mismatches(store)]
    if config.hidden_size != t.hidden_size:
        problems.append(f"hidden_size: checkpoint {config.hidden_size}, store {t.hidden_size}")
    if config.vocab_size != t.vocab_size:
        problems.append(f"vocab_size: checkpoint {config.vocab_size}, store {t.vocab_size}")
    if config.num_target_layers is not None and config.num_target_layers != t.num_hidden_layers:
        problems.append(f"target layers: checkpoint expects a {config.num_target_layers}-layer "
                        f"target, store target has {t.num_hidden_layers}")
    missing = [i for i in config.target_layer_ids if i not in store.context_layer_ids]
    if missing:
        problems.append(f"layer ids: checkpoint reads target layers {config.target_layer_ids}, "
                        f"store holds {store.context_layer_ids} (missing {missing})")
    return problems


def layer_selection(config: DrafterConfig, store: StoreMeta) -> list[int] | None:
    """Indices into the store's context layers, in the drafter's order; None = all, as is."""
    index = [store.context_layer_ids.index(i) for i in config.target_layer_ids]
    return None if index == list(range(store.num_context_layers)) else index


def load_checkpoint(
    path: str, store: StoreMeta, *, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> EvalCheckpoint:
    """Load `path` (training checkpoint, its drafter/, or a drafter dir) and check it
    against the store. A training checkpoint must be whole (load_drafter refuses a half-copied
    one) and hold its provenance: without it, another target's drafter of the same shape
    would be evaluated without a word. A run directory loads the checkpoint it stands for,
    named `RUN/step_N`."""
    name = Path(path.rstrip("/")).name or path
    if is_run_dir(path):
        try:
            chosen, _ = run_checkpoint(path)
        except RunDirError as e:
            raise EvalError(f"checkpoint {path}: {e}") from e
        path, name = str(chosen), f"{name}/{chosen.name}"
    try:
        # Every kind: drafting.BlockDrafter follows a DFlash 2 drafter's selector walk. A
        # factorised one loads as the codebooks it exports (E W), what an engine would run.
        model = load_drafter(path, dtype=dtype, device=device, kinds=DRAFTER_KINDS,
                             materialise=True)
    except DrafterError as e:
        raise EvalError(f"checkpoint {path}: {e}") from e
    root = training_checkpoint_root(path)
    provenance = read_provenance(path)
    if root is not None and provenance is None:
        raise EvalError(f"checkpoint {path}: {root / PROVENANCE} is missing, so the store "
                        "it was trained on cannot be checked; copy the checkpoint again whole")
    problems = compatibility_problems(model.config, provenance, store)
    if problems:
        raise EvalError(f"checkpoint {path} does not fit the store:\n  " + "\n  ".join(problems))
    model.eval().requires_grad_(False)
    return EvalCheckpoint(name=name, path=path, model=model, provenance=provenance)


def unique_names(checkpoints: list[EvalCheckpoint]) -> None:
    """Make display names unique by appending #2, #3 to repeats (in command-line order)."""
    seen: dict[str, int] = {}
    for c in checkpoints:
        seen[c.name] = seen.get(c.name, 0) + 1
        if seen[c.name] > 1:
            c.name = f"{c.name}#{seen[c.name]}"
