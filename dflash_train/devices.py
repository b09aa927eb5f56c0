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


def native_bf16(device: torch.device) -> str | None:
    """What runs bf16 matmuls natively on `device` ("cuda", "amx" or "avx512_bf16"), or None
    where bf16 would be emulated (slower than float32). On a CPU with AVX-512 BF16 or AMX a
    bf16 matmul at SmolLM2's lm_head shape ran 2.5-5x a float32 one (docs/benchmarks.md)."""
    if device.type == "cuda":
        return "cuda"
    if device.type != "cpu":
        return None
    # torch.cpu's probes are private; a torch without them is treated as having neither
    for name, probe in (("amx", "_is_amx_tile_supported"),
                        ("avx512_bf16", "_is_avx512_bf16_supported")):
        if getattr(torch.cpu, probe, lambda: False)():
            return name
    return None
