"""How a config field is named to the user: its `dflash train` option where it has one.

Owns the map from config fields to command-line options and the one range check the config
sections use, so every refusal names the option the user typed (`--weights`), with the
field (`loader.store_weights`) a TOML file or `--set` would use. Never reads a store or a run.
"""

from typing import Any

from dflash_train.train.errors import TrainError

CLI_OPTIONS = {
    "run.out_dir": "--out",
    "optim.epochs": "--epochs",
    "optim.max_steps": "--max-steps",
    "optim.lr": "--lr",
    "loader.batch_tokens": "--batch-tokens",
    "loader.max_length": "--max-length",
    "loss.gamma": "--gamma",
    "loss.kind": "--loss",
    "noise.kind": "--noise",
    "noise.std": "--noise-std",
    "run.anchors_per_seq": "--anchors-per-seq",
    "model.num_hidden_layers": "--layers",
    "run.device": "--device",
    "run.seed": "--seed",
    "loader.store_weights": "--weights",
    "run.fsdp": "--fsdp",
    "loader.skip_corrupt": "--skip-corrupt",
    "run.progress": "--progress",
    "validation.stores": "--val-store",
    "validation.limit": "--val-limit",
    "validation.tree_budgets": "--tree-budget",
}
"""Config field (section.field) -> the `dflash train` option that sets it."""


def option_name(key: str) -> str:
    """`--lr (optim.lr)` for a field with an option, else the dotted field itself."""
    option = CLI_OPTIONS.get(key)
    return f"{option} ({key})" if option else key


def require(ok: bool, key: str, rule: str, value: Any) -> None:
    """Refuse `value` of field `key` unless `ok`, saying which `rule` it breaks."""
    if not ok:
        raise TrainError(f"{option_name(key)} must be {rule}, got {value!r}")
