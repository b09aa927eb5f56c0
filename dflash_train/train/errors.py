"""The one exception type of the train stage."""

from dflash_train.errors import DflashError


class TrainError(DflashError):
    """A training run cannot start or continue: bad config, store, or checkpoint."""
