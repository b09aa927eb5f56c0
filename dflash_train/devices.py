"""Which torch device a stage runs on: one resolution and one refusal for every command.

Owns the meaning of a `--device` value only; never moves a tensor.
"""

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DEFAULT_DEVICE = "auto"
"""Every stage's default: the same command runs on a GPU machine and on a laptop."""
DEVICE_HELP = "Torch device: auto (cuda when torch sees one, else cpu), cpu, cuda or cuda:N."
"""The rule, as each command's --help states it."""
RANKS_HELP = " Under torchrun each rank of a node takes its own card."


def resolve_device(name: str, error: type[Exception], rank: int = 0) -> torch.device:
    """`auto` (CUDA when torch sees one, else CPU), `cpu`, `cuda` or `cuda:N`.

    A device torch cannot use raises `error` (the calling stage's exception type) with the
    fix, instead of torch's own assertion deep inside the first `.to()`.
    """
    cuda = torch.cuda.is_available()
    if name == "auto":
        name = "cuda" if cuda else "cpu"
    if name == "cuda" and cuda:
        # under torchrun each rank of a node takes its own card
        name = f"cuda:{rank % torch.cuda.device_count()}"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise error(f"--device {name!r}: not a device (expected {DEVICE_CHOICES})") from e
    if device.type not in ("cpu", "cuda"):
        raise error(f"--device {name!r}: unsupported (expected {DEVICE_CHOICES})")
    if device.type == "cuda":
        if not cuda:
            raise error(f"--device {name!r}: torch {torch.__version__} sees no CUDA device "
                        "on this machine; pass --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise error(f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) "
                        "visible")
    return device
