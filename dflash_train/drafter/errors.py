"""The one exception type of the drafter package."""

from dflash_train.errors import DflashError


class DrafterError(DflashError):
    """A drafter config, checkpoint or input is wrong; the message names what and where."""
