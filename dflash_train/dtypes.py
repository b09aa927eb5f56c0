"""The one map between dtype names, as options and the store's hidden_dtype spell them, and
torch dtypes. Every stage converts through it, so a name means the same dtype everywhere."""

import torch

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {d: name for name, d in TORCH_DTYPES.items()}[dtype]


DTYPE_CHOICES = ("auto", *TORCH_DTYPES)
"""What a --dtype option accepts."""


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """The one rule for `--dtype auto`: bfloat16 where the model runs on CUDA (`--device
    auto` on a machine with CUDA included), else float32; any other name as it says."""
    if name != "auto":
        return torch_dtype(name)
    where = str(device)
    cuda = where.startswith("cuda") or (where == "auto" and torch.cuda.is_available())
    return torch.bfloat16 if cuda else torch.float32
