"""Deterministic plans: which rows form each part, which rank owns it, how rows are batched.

Owns only arithmetic on row counts and lengths. Plans depend on the input alone (never on
where a previous run stopped), so a resumed or sharded run batches every sample exactly as an
uninterrupted single process would, and its stored numbers are bit-identical.
"""

import math
from dataclasses import dataclass

from dflash_train.batching import padded_batches


@dataclass(frozen=True)
class PartPlan:
    """Part `index` holds source rows [row_start, row_stop)."""

    index: int
    row_start: int
    row_stop: int


def plan_parts(num_rows: int, rows_per_part: int) -> list[PartPlan]:
    """Contiguous slices of `rows_per_part` rows (the last may be shorter)."""
    count = max(1, math.ceil(num_rows / rows_per_part))
    return [PartPlan(p, p * rows_per_part, min(num_rows, (p + 1) * rows_per_part))
            for p in range(count)]


def parts_of_rank(parts: list[PartPlan], rank: int, world_size: int) -> list[PartPlan]:
    """Rank r of W claims parts r, r + W, r + 2W, ..."""
    return parts[rank::world_size]


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive item indices per batch, padded size (count * longest) <= batch_tokens.

    Consecutive, not length-sorted: a part's samples must be appended in row order so that
    resume can continue from the last committed row.
    """
    return list(padded_batches(range(len(lengths)), lengths.__getitem__, batch_tokens))


def bytes_per_token(num_layers: int, hidden_size: int, hidden_bytes: int, top_k: int) -> int:
    """Uncompressed store bytes per token: context, ids, mask, top-k ids + logits, lse."""
    return num_layers * hidden_size * hidden_bytes + 4 + 1 + top_k * (4 + 4) + 4
