"""The one exception type of the evaluate package."""


class EvalError(Exception):
    """An eval input is wrong (checkpoint, store, option); the message names what and where."""
