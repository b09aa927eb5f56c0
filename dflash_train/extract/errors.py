"""The one exception type of the extract package."""


class ExtractError(Exception):
    """Bad input, model, layer choice or output for `dflash extract`; the message names which."""
