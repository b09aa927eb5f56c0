"""The one exception type of the evaluate package."""

from dflash_train.errors import DflashError


class EvalError(DflashError):
    """An eval input is wrong (checkpoint, store, option); the message names what and where."""
