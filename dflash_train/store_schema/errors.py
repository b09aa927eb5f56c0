"""The one exception type of the store package, and how an error's text is put in one line."""

from dflash_train.errors import DflashError


class StoreError(DflashError):
    """A store is missing, malformed, corrupt, or does not match what the caller expects."""


def one_line(text: object, limit: int = 300) -> str:
    """`text` (e.g. a codec's multi-line error) as one line of at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
