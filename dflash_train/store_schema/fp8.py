"""fp8 context: E4M3 values with one float32 scale per token and context layer.

Opt-in at extract (`--context-dtype float8_e4m3`); it halves a bf16 store's raw context
(0.60x compressed, measured on SmolLM2: benchmarks/fp8_store.py). The
writer quantizes, every reader dequantizes back to the store's hidden dtype, so what train and
eval see is an ordinary context tensor.

Why one scale per (token, layer): hidden states hold a few outlier channels hundreds of times
larger than the rest, and their size differs from layer to layer and token to token. A scale
shared across tokens or layers would be set by the largest outlier anywhere in it and push the
other rows' values into E4M3's subnormals (3 mantissa bits there shrink to fewer). Per row,
the row's own absmax maps to E4M3's largest finite value, 448, so every row uses the whole
range; the cost is 4 bytes per row of H values (0.7 % at H = 576, 0.08 % at 5120).

Why amax / 448 and not a power of two: a power-of-two scale makes the product exact in
fewer bits, but leaves up to one binade at the top unused, which moves every small value one
binade nearer the subnormals; the exact ratio uses the whole range and puts each row's absmax
on a representable value (it comes back to within float32 rounding). The scale
is clamped to float32's smallest normal: an all-zero row then stores codes 0 and a positive
scale, and every stored scale is finite and > 0, which `store validate` checks.
"""

import numpy as np
import torch

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
MIN_SCALE = float(torch.finfo(torch.float32).tiny)
"""The smallest scale stored (all-zero rows and rows too small for amax / 448 in float32)."""
_GRAIN = 32768
"""torch's parallel grain (at::internal::GRAIN_SIZE): smaller ops run on the calling thread."""
_VALUES = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
"""The float32 value of every E4M3 code: a gather from it measured ~1.7x faster on CPU than
torch's fp8 -> float32 cast, with the same result."""


def _block_rows(row_values: int) -> int:
    """Tokens per block whose ops each stay under torch's parallel grain (32768 elements), so
    they run inline on the calling thread: measured 5-10x faster per 190-token sample on a
    loaded 2-core machine, where every parallel op waited ~12 ms on its OpenMP barrier (a
    writer thread beside the forward, or a loader thread beside the step, is just that)."""
    return max(1, _GRAIN // row_values)


def quantize(context: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[T, n, H] floating context -> (uint8 E4M3 bits [T, n, H], float32 scales [T, n]).
    ValueError for NaN or Inf (the codes have no Inf, and a NaN scale would spoil its row)."""
    x = context.detach().to("cpu")
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32)
    rows = _block_rows(int(np.prod(x.shape[1:])))
    for a in range(0, len(x), rows):
        block = x[a:a + rows]
        # the absmax straight from the stored dtype (exact), and a division that promotes
        # to float32 as it goes: no float32 copy of the context first
        amax = torch.linalg.vector_norm(block, float("inf"), dim=-1, keepdim=True).float()
        if not torch.isfinite(amax).all():
            raise ValueError("context holds NaN or Inf")
        scale = torch.clamp(amax / FP8_MAX, min=MIN_SCALE)
        # x / scale can round a hair past 448; the clamp keeps it off E4M3's NaN code
        codes[a:a + rows] = torch.div(block, scale).clamp_(-FP8_MAX, FP8_MAX)
        scales[a:a + rows] = scale.squeeze(-1)
    return codes.view(torch.uint8).numpy(), scales.numpy()


def bad_scales(scales: np.ndarray) -> np.ndarray:
    """Boolean mask of scales no writer stores: NaN, Inf, zero or negative."""
    return ~(np.isfinite(scales) & (scales > 0))


def dequantize_into(codes: np.ndarray, scales: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """codes [T, n, H] x scales [T, n] written into `out` ([T, n, H], any floating dtype),
    a block of tokens at a time (_block_rows: the float32 temporary stays 128 KB); ValueError
    for a scale no writer stores (the reader then names the sample as damaged, instead of
    handing NaN or zeros to training)."""
    if bad_scales(scales).any():
        raise ValueError("context_scale holds a value that is not finite and > 0")
    rows = _block_rows(int(np.prod(codes.shape[1:])))
    block = np.empty((min(rows, len(codes)), *codes.shape[1:]), np.float32)
    for a in range(0, len(codes), rows):
        b = min(a + rows, len(codes))
        values = block[:b - a]
        np.take(_VALUES, codes[a:b], out=values)
        np.multiply(values, scales[a:b, :, None], out=values)
        out[a:b] = torch.from_numpy(values)  # one rounding, to out's dtype
    return out
