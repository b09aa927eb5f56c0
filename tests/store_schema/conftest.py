"""Small stores with random contents, for the store tests."""

import numpy as np
import pytest
import torch

from dflash_train.store_schema import Sample, StoreMeta
from tests.store_factory import store_meta

HIDDEN, LAYERS, TOP_K, VOCAB = 16, 3, 4, 97


def make_meta(num_parts: int = 2, hidden_dtype: str = "bfloat16", context_dtype=None,
              **target) -> StoreMeta:
    """`target`: fields of TargetInfo (hidden_size, name_or_path, weights_sha256, ...)."""
    return store_meta(target={"hidden_size": HIDDEN, "vocab_size": VOCAB, **target},
                      context_layer_ids=[1, 3, 5], top_k=TOP_K, hidden_dtype=hidden_dtype,
                      num_parts=num_parts, context_dtype=context_dtype)


def random_sample(
    length: int, row: int, gen: torch.Generator, dtype=torch.bfloat16, hidden: int = HIDDEN
) -> Sample:
    logits = torch.randn(length, TOP_K, generator=gen).sort(dim=1, descending=True).values
    return Sample(
        input_ids=torch.randint(0, VOCAB, (length,), generator=gen, dtype=torch.int32),
        loss_mask=torch.rand(length, generator=gen) > 0.3,
        # Wide range of magnitudes, as real hidden states with outlier channels have.
        context=(torch.randn(length, LAYERS, hidden, generator=gen) * 100).to(dtype),
        topk_ids=torch.randint(0, VOCAB, (length, TOP_K), generator=gen, dtype=torch.int32),
        topk_logits=logits,
        lse=logits[:, 0] + torch.rand(length, generator=gen) + 0.1,
        source_row=row,
    )


def assert_same_sample(a: Sample, b: Sample) -> None:
    assert a.source_row == b.source_row
    for name in ("input_ids", "loss_mask", "topk_ids", "topk_logits", "lse"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.context.dtype == b.context.dtype
    # Bit-exact, NaN-safe: compare the raw bits.
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    assert torch.equal(a.context.view(bits[a.context.dtype]), b.context.view(bits[b.context.dtype]))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def flip_bytes(path) -> None:
    """Corrupt a stored object in place: 8 bytes in its middle inverted (as bit rot would)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2
    data[i:i + 8] = bytes(b ^ 0x5A for b in data[i:i + 8])
    path.write_bytes(bytes(data))
