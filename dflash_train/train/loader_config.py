"""How the store is streamed into batches (`LoaderConfig`, the `[loader]` table), its rules
checked once when it is built, and the shortest sample worth training on. Holds settings only:
never opens a store or reads a sample (train/data.py does).
"""

import math
from dataclasses import dataclass
from typing import Literal

from dflash_train.train.options import require

MIN_TRAINABLE_LENGTH = 3
"""Shortest sample holding a block: an anchor a >= 1 (one context position before it) and
its first label at a + 1 (blocks.valid_anchor_mask)."""


@dataclass
class LoaderConfig:
    """How the store is streamed into batches."""

    batch_tokens: int = 16384
    """Padded tokens per GLOBAL batch (samples x longest sample) at most, summed over ranks;
    one longer sample still forms a batch of its own."""
    shuffle_buffer_tokens: int = 65536
    """Tokens held for shuffling samples; bounds the loader's memory with batch_tokens."""
    grouping: Literal["random", "by_length"] = "random"
    """How samples leaving the shuffle buffer form batches. random: drawn one at a time, so a
    batch pads to the longest of random lengths. by_length: each time the buffer fills, its
    samples are sorted by length, cut into batches and the batches shuffled, so a batch's
    rows are of similar length and its budget holds more samples and fewer pads: more data
    per step, fewer steps per epoch (measured on the quickstart's 6 epochs: 305 steps instead
    of 455, and held-out tau 1.23 instead of 1.30, so it is not the default)."""
    part_window: int = 8
    """Parts opened at once; their read units are shuffled together."""
    max_length: int | None = None
    """Samples longer than this are cut to their first max_length tokens."""
    prefetch_batches: int = 2
    """Batches read ahead (per worker), overlapping I/O with compute."""
    pad_to: int = 1
    """Round each batch's length up to a multiple of this (CUDA: 256, so compiled flex
    attention sees few shapes); padding never changes the loss."""
    workers: int = 0
    """DataLoader worker processes reading batches (spawned, each re-opens the stores);
    0 reads in a background thread of this process."""
    seed: int = 0
    """Seeds the order; epoch e of seed s is the same on every run and every rank."""
    store_weights: list[float] | None = None
    """Per store: passes over it per epoch (fractions draw that share of its read units
    afresh each epoch). None: every store once."""
    unit_cache_tokens: int = 1 << 20
    """Tokens of small per-token arrays (~137 B each) kept for read units still being served."""
    skip_corrupt: bool = False
    """Skip samples whose data is damaged (missing shard, failed checksum, torn part metadata)
    and report them, instead of refusing the store. Off: any damage stops the run."""

    def __post_init__(self) -> None:
        for name in ("batch_tokens", "part_window", "pad_to"):
            require(getattr(self, name) >= 1, f"loader.{name}", ">= 1", getattr(self, name))
        require(self.grouping in ("random", "by_length"), "loader.grouping",
                "random or by_length", self.grouping)
        for name in ("shuffle_buffer_tokens", "prefetch_batches", "workers", "seed",
                     "unit_cache_tokens"):
            require(getattr(self, name) >= 0, f"loader.{name}", ">= 0", getattr(self, name))
        require(self.max_length is None or self.max_length >= MIN_TRAINABLE_LENGTH,
                "loader.max_length", f">= {MIN_TRAINABLE_LENGTH} (an anchor after one context "
                "token, and its label)", self.max_length)
        weights = self.store_weights
        if weights is not None:
            require(all(math.isfinite(w) and w >= 0 for w in weights), "loader.store_weights",
                    "finite numbers >= 0", weights_text(weights))
            require(any(w > 0 for w in weights), "loader.store_weights",
                    "> 0 for at least one store (all zero leaves nothing to train on)",
                    weights_text(weights))


def weights_text(weights: list[float]) -> str:
    """Weights as they are typed after --weights: 1,0.5."""
    return ",".join(f"{w:g}" for w in weights)
