"""The one exception type of the extract package."""

from dflash_train.errors import DflashError


class ExtractError(DflashError):
    """Bad input, model, layer choice or output for `dflash extract`; the message names which."""
