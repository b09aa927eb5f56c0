"""The one exception type of the target package."""

from dflash_train.errors import DflashError


class TargetError(DflashError):
    """A target that cannot be found, read, loaded or run as asked; the message names which."""
