"""A padded training batch (`Batch`): its samples padded to one length (`collate`), the empty
batch of a rank with no sample in a step, and how this process allocates batches (glibc's mmap
threshold). Never touches labels or noise: a batch carries the stored arrays as they are; and
never reads a store (train/data.py reads the samples it pads).
"""

import ctypes
import os
import sys
from dataclasses import dataclass, field

import torch

from dflash_train.dtypes import torch_dtype
from dflash_train.store_schema import Damage, Sample, Store
from dflash_train.train.epoch_plan import SampleRef


@dataclass
class Batch:
    """Padded samples; position t of row b is valid where t < lengths[b]."""

    input_ids: torch.Tensor  # int64 [b, T]
    loss_mask: torch.Tensor  # bool [b, T], False on padding
    context: torch.Tensor  # [b, T, n, H]
    topk_ids: torch.Tensor  # int64 [b, T, k]
    topk_logits: torch.Tensor  # float32 [b, T, k]
    lse: torch.Tensor  # float32 [b, T]
    lengths: torch.Tensor  # int64 [b]
    refs: list[SampleRef] = field(default_factory=list)
    skipped: list[Damage] = field(default_factory=list)
    """Samples of this batch left out as damaged (only with LoaderConfig.skip_corrupt)."""

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def empty_batch(store: Store, skipped: list[Damage] | None = None) -> Batch:
    """A one-token batch with nothing to learn: a rank with no sample in a step still steps."""
    m = store.meta
    return Batch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.bool),
                 torch.zeros(1, 1, m.num_context_layers, m.target.hidden_size,
                             dtype=torch_dtype(m.hidden_dtype)),
                 torch.zeros(1, 1, m.top_k, dtype=torch.long), torch.zeros(1, 1, m.top_k),
                 torch.zeros(1, 1), torch.ones(1, dtype=torch.long), refs=[],
                 skipped=list(skipped or []))


def collate(samples: list[Sample], refs: list[SampleRef], pad_to: int = 1,
            context: torch.Tensor | None = None) -> Batch:
    """Pad samples to the longest, rounded up to a multiple of `pad_to` (few distinct shapes
    keep compiled kernels from recompiling); padding is never a loss position.

    context: the batch's [b, T, n, H] context when the samples' context was already read
    into its rows (sample i's is context[i, :len(i)]); only its padding is written then."""
    b, t = len(samples), round_up(max(len(s) for s in samples), pad_to)
    s0 = samples[0]
    n, h = s0.context.shape[1:]
    k = s0.topk_ids.shape[1]
    in_place = context is not None
    if in_place and (tuple(context.shape) != (b, t, n, h) or any(
            s.context.data_ptr() != context[i].data_ptr() for i, s in enumerate(samples))):
        raise ValueError(f"collate: context {tuple(context.shape)} does not hold the samples' "
                         f"context in its rows (expected {(b, t, n, h)})")
    out = Batch(
        input_ids=torch.zeros(b, t, dtype=torch.int64),
        loss_mask=torch.zeros(b, t, dtype=torch.bool),
        # the largest array: filled row by row below, only its padding zeroed (not all of it)
        context=context if in_place else torch.empty(b, t, n, h, dtype=s0.context.dtype),
        topk_ids=torch.zeros(b, t, k, dtype=torch.int64),
        topk_logits=torch.full((b, t, k), float("-inf")),
        lse=torch.zeros(b, t),
        lengths=torch.tensor([len(s) for s in samples], dtype=torch.int64),
        refs=refs,
    )
    for i, s in enumerate(samples):
        n_i = len(s)
        out.input_ids[i, :n_i] = s.input_ids
        out.loss_mask[i, :n_i] = s.loss_mask
        if not in_place:
            out.context[i, :n_i] = s.context
        out.context[i, n_i:] = 0
        out.topk_ids[i, :n_i] = s.topk_ids
        out.topk_logits[i, :n_i] = s.topk_logits
        out.lse[i, :n_i] = s.lse
    return out


BATCH_MMAP_THRESHOLD = 8 << 20
"""Bytes from which glibc serves an allocation by its own mmap (returned to the OS on free):
above an inner chunk of the widest target (256 x 5120 x 2 B = 2.6 MB), below a batch's."""


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at BATCH_MMAP_THRESHOLD for this process; True if set.

    Every batch allocates its large arrays afresh and frees them a step later in another
    thread. glibc raises its mmap threshold to the size of each mmapped block freed, so
    after the first batches these come from the heap instead, whose fragmentation grew
    the loader's peak RSS with the size of the store (measured: a 10x store 1.41x of a 1x
    one; with the threshold fixed 1.00x, and both ~300 MiB instead of 320-450). Blocks
    below it (decode buffers, chunk bytes) stay on the heap, so reading stays as fast.
    Left alone where the user set MALLOC_MMAP_THRESHOLD_ or the C library is not glibc."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD
    return bool(mallopt(m_mmap_threshold, BATCH_MMAP_THRESHOLD))
