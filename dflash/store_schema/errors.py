"""The one exception type of the store package."""


class StoreError(Exception):
    """A store is missing, malformed, corrupt, or does not match what the caller expects."""
