"""Noise regulariser on the drafter's fc input (the target's context-layer features) only.

docs/reference.md §5, docs/design.md invariant 1: noise goes on the concatenated features that
feed `fc`, never on anything that produces labels. This module therefore takes the context
tensor and nothing else from a batch: it cannot see verifier ids, token ids or loss masks,
and it returns a new tensor instead of writing into the one it is given.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dflash_train.blocks import BlockError
from dflash_train.train.options import require

RELATIVE_STD_MAX = 10.0
"""Largest relative std: noise 10x a layer's RMS leaves the fc input a signal-to-noise
power ratio of 1/100, past which the drafter is fed noise, not the target's features."""
ABSOLUTE_STD_MAX = 1e38
"""Largest absolute std: the uniform noise's half-width std * sqrt(3) must be a float32
(max 3.4e38); the raw features' scale is the target's, unknown to the config."""


@dataclass
class NoiseConfig:
    """Distribution and scale of the noise added to the fc input."""

    kind: Literal["none", "uniform", "gaussian"] = "uniform"
    """Distribution of the noise added to the fc input (the context features only)."""
    std: float = 0.05
    """Standard deviation (for both kinds), relative to each context layer's RMS unless
    `absolute` is set. Uniform noise is drawn from U(-std*sqrt(3), +std*sqrt(3))."""
    absolute: bool = False
    """Treat `std` as an absolute value on the raw features."""
    std_end: float | None = None
    """If set, std moves linearly from `std` to `std_end` over `schedule_steps` steps, then
    stays at `std_end`."""
    schedule_steps: int = 0
    """Length of the linear schedule in optimiser steps (used only with `std_end`)."""
    stats_max_tokens: int | None = 1 << 20
    """Tokens (whole shards spread over the store) read to estimate each layer's RMS when
    the store has no cached statistics (`dflash store stats` caches them); None: all."""

    def __post_init__(self) -> None:
        if self.kind not in ("none", "uniform", "gaussian"):
            raise BlockError(
                f"noise kind must be 'none', 'uniform' or 'gaussian', got {self.kind!r}"
            )
        if self.std < 0 or (self.std_end is not None and self.std_end < 0):
            raise BlockError(f"noise std must be >= 0, got std={self.std}, std_end={self.std_end}")
        limit, scale = ((ABSOLUTE_STD_MAX, "absolute") if self.absolute
                        else (RELATIVE_STD_MAX, "times each layer's RMS"))
        for key, value in (("noise.std", self.std), ("noise.std_end", self.std_end)):
            require(value is None or (math.isfinite(value) and value <= limit), key,
                    f"a finite number in [0, {limit:g}] ({scale})", value)
        if self.std_end is not None and self.schedule_steps < 1:
            raise BlockError("noise std_end needs schedule_steps >= 1 (the schedule's length)")


def noise_std_at(config: NoiseConfig, step: int) -> float:
    """The std in force at optimiser step `step` (0-based) under the linear schedule."""
    if config.kind == "none":
        return 0.0
    if config.std_end is None:
        return config.std
    frac = min(max(step, 0) / config.schedule_steps, 1.0)
    return config.std + (config.std_end - config.std) * frac


def context_layer_rms(context: torch.Tensor) -> torch.Tensor:
    """RMS of each context layer [n] over all tokens and channels of context [..., n, H]."""
    if context.dim() < 2:
        raise BlockError(f"context must be [..., n, H], got shape {tuple(context.shape)}")
    per_layer = context.float().transpose(0, -2).reshape(context.shape[-2], -1)  # [n, *]
    return per_layer.pow(2).mean(-1).sqrt()


def add_context_noise(
    context: torch.Tensor,
    layer_rms: torch.Tensor | None,
    config: NoiseConfig,
    generator: torch.Generator,
    step: int = 0,
) -> torch.Tensor:
    """A noised copy of context [..., n, H]; the input is never modified.

    layer_rms [n] scales the noise per layer (ignored when `config.absolute`). The noise is
    drawn in fp32 from `generator`, which must live on the context's device, and the sum is
    cast back to the context's dtype.
    """
    if not context.is_floating_point():
        raise BlockError(
            f"context must be floating point, got {context.dtype}; decode the store's uint16 "
            "bf16 bit pattern before adding noise"
        )
    if context.dim() < 2:
        raise BlockError(f"context must be [..., n, H], got shape {tuple(context.shape)}")
    std = noise_std_at(config, step)
    if std == 0.0:
        return context.clone()
    n_layers = context.shape[-2]
    if config.absolute:
        scale = torch.full((n_layers, 1), std, device=context.device)
    else:
        if layer_rms is None or layer_rms.shape != (n_layers,):
            got = None if layer_rms is None else tuple(layer_rms.shape)
            raise BlockError(f"relative noise needs layer_rms of shape ({n_layers},), got {got}")
        scale = std * layer_rms.float().to(context.device)[:, None]  # [n, 1]
    if generator.device != context.device:
        raise BlockError(
            f"noise generator is on {generator.device} but context is on {context.device}"
        )
    shape, device = context.shape, context.device
    if config.kind == "gaussian":
        unit = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    else:
        # U(-1, 1) has std 1/sqrt(3); rescale so `std` means the same for both kinds.
        unit = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
        unit = (unit * 2.0 - 1.0) * math.sqrt(3.0)
    return (context.float() + unit * scale).to(context.dtype)
