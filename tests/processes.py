"""What tests ask of a process they started or that a command under test started."""

from pathlib import Path


def is_running(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its parent's wait does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
