"""The one map between dtype names, as options and the store's hidden_dtype spell them, and
torch dtypes. Every stage converts through it, so a name means the same dtype everywhere."""

import torch

from dflash_train.devices import native_bf16

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {d: name for name, d in TORCH_DTYPES.items()}[dtype]


DTYPE_CHOICES = ("auto", *TORCH_DTYPES)
"""What a --dtype option accepts."""


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """The one rule for `--dtype auto`: bfloat16 where the model runs on a CUDA card with
    native bf16 (devices.native_bf16; `--device auto` on a machine with CUDA included), else
    float32; any other name as it says. A CPU keeps float32 even with AVX-512 BF16: this dtype
    is also what extract stores and what eval's target verifies in, so a CPU run's results
    stay float32 ones (training's run.precision=auto is the rule that uses CPU bf16)."""
    if name != "auto":
        return torch_dtype(name)
    where = str(device)
    if where == "auto":
        where = "cuda" if torch.cuda.is_available() else "cpu"
    place = torch.device(where)
    return torch.bfloat16 if place.type == "cuda" and native_bf16(place) else torch.float32
