"""The one exception type of the train stage."""


class TrainError(Exception):
    """A training run cannot start or continue: bad config, store, or checkpoint."""
