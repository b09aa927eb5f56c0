"""The one exception type of the drafter package."""


class DrafterError(Exception):
    """A drafter config, checkpoint or input is wrong; the message names what and where."""
