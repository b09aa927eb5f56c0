"""One sample's arrays as the stages see them, and their checked conversion to stored arrays."""

from dataclasses import dataclass

import numpy as np
import torch

from dflash_train.dtypes import torch_dtype
from dflash_train.store_schema.errors import StoreError
from dflash_train.store_schema.layout import hidden_from_numpy, hidden_to_numpy


@dataclass
class Sample:
    """A sample's per-token arrays; position t holds what the target saw and predicted at t."""

    input_ids: torch.Tensor
    """int32 [L]."""
    loss_mask: torch.Tensor
    """bool [L]: True on tokens the drafter is trained to predict (assistant tokens)."""
    context: torch.Tensor
    """[L, n, H] in the store's hidden dtype: outputs of the context layers."""
    topk_ids: torch.Tensor
    """int32 [L, k]: the verifier's top-k next-token ids at each position, argmax first."""
    topk_logits: torch.Tensor
    """float32 [L, k]."""
    lse: torch.Tensor
    """float32 [L]: log-sum-exp of the verifier logits over the full vocab."""
    source_row: int
    """Row of the input dataset this sample came from."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def sample_to_arrays(
    s: Sample, *, n: int, hidden: int, top_k: int, hidden_dtype: str, where: str
) -> dict[str, np.ndarray]:
    """The stored arrays of `s`, after checking every shape and dtype (errors name `where`)."""
    length = len(s)
    expect = {
        "input_ids": ((length,), None),
        "loss_mask": ((length,), torch.bool),
        "context": ((length, n, hidden), torch_dtype(hidden_dtype)),
        "topk_ids": ((length, top_k), None),
        "topk_logits": ((length, top_k), torch.float32),
        "lse": ((length,), torch.float32),
    }
    if length < 1:
        raise StoreError(f"{where}: empty sample")
    for name, (shape, dtype) in expect.items():
        t = getattr(s, name)
        if tuple(t.shape) != shape:
            raise StoreError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape}")
        if dtype is not None and t.dtype != dtype:
            raise StoreError(f"{where}: {name} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise StoreError(f"{where}: {name} must hold integers, got {t.dtype}")
    context = hidden_to_numpy(s.context, hidden_dtype)
    return {
        "input_ids": s.input_ids.detach().cpu().numpy().astype(np.int32),
        "loss_mask": s.loss_mask.detach().cpu().numpy(),
        "context": context,
        "verifier_topk_ids": s.topk_ids.detach().cpu().numpy().astype(np.int32),
        "verifier_topk_logits": s.topk_logits.detach().cpu().numpy(),
        "verifier_lse": s.lse.detach().cpu().numpy(),
    }


def sample_from_arrays(a: dict[str, np.ndarray], hidden_dtype: str, source_row: int) -> Sample:
    return Sample(
        input_ids=torch.from_numpy(np.ascontiguousarray(a["input_ids"])),
        loss_mask=torch.from_numpy(np.ascontiguousarray(a["loss_mask"])),
        context=hidden_from_numpy(a["context"], hidden_dtype),
        topk_ids=torch.from_numpy(np.ascontiguousarray(a["verifier_topk_ids"])),
        topk_logits=torch.from_numpy(np.ascontiguousarray(a["verifier_topk_logits"])),
        lse=torch.from_numpy(np.ascontiguousarray(a["verifier_lse"])),
        source_row=int(source_row),
    )
