"""The one map between dtype names, as options and the store's hidden_dtype spell them, and
torch dtypes. Every stage converts through it, so a name means the same dtype everywhere."""

import torch

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {d: name for name, d in TORCH_DTYPES.items()}[dtype]
