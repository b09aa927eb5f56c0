"""The drafter's training loss: position-decayed hard cross-entropy over block slots.

loss = sum_{n,k} w_k * valid[n,k] * CE(q[n,k], label[n,k]) / sum_{n,k} w_k * valid[n,k],
with w_0 = 0 and w_k = exp(-(k-1)/gamma) for k >= 1 (docs/reference.md §5). Labels: the stored
verifier argmax (dflash_train.blocks.block_labels). An alternative soft target, `kl-topk`, uses
the stored verifier top-k logits + lse instead; it is never the default.

This module owns the formula and the memory-safe way to apply the frozen lm_head (row
chunks, recomputed in backward). It must never build labels from anything but the verifier
targets it is given, and never touch the noise or the optimiser.

D-PACE weighting (arXiv 2605.18810) is deliberately absent: its exact formula could not be
confirmed from public material available here, and a guessed version would be mislabelled.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_train.blocks import BLOCK_SIZE, BlockError

DEFAULT_GAMMA = 10.0
"""Decay length of w_k = exp(-(k-1)/gamma). docs/reference.md §5: the paper uses 7 for B = 16; this
project defaults to 10 because it tunes for DDTree, which reaches deep slots more often."""

DEFAULT_CHUNK_ROWS = 2048
"""Block slots per lm_head chunk: 2048 x 248K fp32 logits is ~2 GB, recomputed in backward."""


@dataclass
class LossConfig:
    """Which loss the trainer minimises and how it applies the lm_head."""

    kind: Literal["ce", "kl-topk"] = "ce"
    """`ce`: hard CE on the verifier argmax (default). `kl-topk`: KL to the stored top-k
    verifier probabilities (mass outside the stored top-k is ignored)."""
    gamma: float = DEFAULT_GAMMA
    """Position decay length; w_k = exp(-(k-1)/gamma) for slot k >= 1."""
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    """Rows (block slots) per lm_head chunk when the loss is given hidden states."""

    def __post_init__(self) -> None:
        if self.kind not in ("ce", "kl-topk"):
            raise BlockError(f"loss kind must be 'ce' or 'kl-topk', got {self.kind!r}")
        if not self.gamma > 0:
            raise BlockError(f"loss gamma must be > 0, got {self.gamma}")
        if self.chunk_rows < 1:
            raise BlockError(f"loss chunk_rows must be >= 1, got {self.chunk_rows}")


def decay_weights(block_size: int = BLOCK_SIZE, gamma: float = DEFAULT_GAMMA) -> torch.Tensor:
    """Per-slot weights [B]: w_0 = 0 (the anchor has no label), w_k = exp(-(k-1)/gamma)."""
    if not gamma > 0:
        raise BlockError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def slot_weights(valid: torch.Tensor, gamma: float = DEFAULT_GAMMA) -> torch.Tensor:
    """Loss weight of every slot [N, B]: decay weight where the label is valid, else 0."""
    if valid.dim() != 2:
        raise BlockError(f"valid must be [N, B], got shape {tuple(valid.shape)}")
    w = decay_weights(valid.shape[1], gamma).to(valid.device)
    return w * valid.float()


def block_ce_loss(
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    gamma: float = DEFAULT_GAMMA,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Decay-weighted hard CE, from logits [N, B, V] or hidden [N, B, H] + lm_head [V, H].

    `denominator` replaces the local weight sum (e.g. the all-reduced sum under DDP so every
    rank's slot counts the same). With no valid slot the loss is an exact 0 still attached to
    the graph, so DDP sees every parameter.
    """
    _check_labels(labels, valid)
    rows, w = _weighted_rows(valid, gamma)
    targets = (labels.reshape(-1)[rows].long(),)
    return _weighted_loss(
        _ce_rows, targets, rows, w, logits, hidden, lm_head_weight, chunk_rows, denominator
    )


def topk_target_probs(topk_logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Verifier probabilities of its stored top-k tokens: p_i = exp(logit_i - lse), fp32."""
    return torch.exp(topk_logits.float() - lse.float().unsqueeze(-1))


def block_kl_topk_loss(
    target_ids: torch.Tensor,
    target_logits: torch.Tensor,
    target_lse: torch.Tensor,
    valid: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    gamma: float = DEFAULT_GAMMA,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Decay-weighted truncated KL(p || q) over the verifier's stored top-k (an option).

    target_ids / target_logits: [N, B, k], target_lse: [N, B], already regrouped per slot
    with dflash_train.blocks.verifier_rows. Per slot: sum_i p_i (log p_i - log q(id_i)), summed
    over the stored top-k only; the verifier mass outside it (1 - sum_i p_i) is ignored, not
    renormalised. It is 0 when the drafter reproduces the verifier's distribution.
    """
    if target_ids.shape != target_logits.shape or target_ids.shape[:2] != valid.shape:
        raise BlockError(
            f"target_ids {tuple(target_ids.shape)} / target_logits "
            f"{tuple(target_logits.shape)} must both be [N, B, k] with [N, B] = "
            f"{tuple(valid.shape)}"
        )
    if target_lse.shape != valid.shape:
        raise BlockError(
            f"target_lse must be [N, B] = {tuple(valid.shape)}, got {tuple(target_lse.shape)}"
        )
    rows, w = _weighted_rows(valid, gamma)
    k = target_ids.shape[-1]
    probs = topk_target_probs(target_logits, target_lse).reshape(-1, k)[rows]
    targets = (target_ids.reshape(-1, k)[rows].long(), probs)
    return _weighted_loss(
        _kl_topk_rows, targets, rows, w, logits, hidden, lm_head_weight, chunk_rows, denominator
    )


def _ce_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row hard CE [M] from logits [M, V], computed in fp32 or wider."""
    return F.cross_entropy(_at_least_fp32(logits), labels, reduction="none")


def _kl_topk_rows(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per-row truncated KL [M] from logits [M, V], target ids / probs [M, k]."""
    logq = torch.log_softmax(_at_least_fp32(logits), dim=-1).gather(-1, ids)  # [M, k]
    return (torch.xlogy(probs, probs) - probs * logq).sum(-1)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 logits up-cast to fp32 (a 248K-way softmax in bf16 is too coarse)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_labels(labels: torch.Tensor, valid: torch.Tensor) -> None:
    if labels.shape != valid.shape or labels.dim() != 2:
        raise BlockError(
            f"labels {tuple(labels.shape)} and valid {tuple(valid.shape)} must both be [N, B]"
        )


def _weighted_rows(valid: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of slots with weight > 0, and their weights [M]."""
    w = slot_weights(valid, gamma).reshape(-1)
    rows = (w > 0).nonzero().flatten()
    return rows, w[rows]


def _chunk_weighted_sum(
    row_loss: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    w: torch.Tensor,
    *targets: torch.Tensor,
) -> torch.Tensor:
    """sum_i w_i * row_loss(hidden_i @ weight^T, targets_i) for one chunk of rows."""
    return (row_loss(F.linear(hidden, weight), *targets) * w).sum()


def _weighted_loss(
    row_loss: Callable[..., torch.Tensor],
    targets: tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    w: torch.Tensor,
    logits: torch.Tensor | None,
    hidden: torch.Tensor | None,
    lm_head_weight: torch.Tensor | None,
    chunk_rows: int,
    denominator: float | torch.Tensor | None,
) -> torch.Tensor:
    """Weighted sum of per-row losses over the selected rows, divided by the weight sum."""
    if (logits is None) == (hidden is None):
        raise BlockError("pass exactly one of logits= or hidden= (with lm_head_weight=)")
    if hidden is not None and lm_head_weight is None:
        raise BlockError("hidden= needs lm_head_weight= (the target's frozen [V, H] lm_head)")
    source = logits if logits is not None else hidden
    w = w.to(source.device)
    rows = rows.to(source.device)
    targets = tuple(t.to(source.device) for t in targets)
    flat = source.reshape(-1, source.shape[-1])[rows]  # [M, V] or [M, H]
    if logits is not None:
        total = (row_loss(flat, *targets) * w).sum()
    else:
        fn = partial(_chunk_weighted_sum, row_loss)
        total = source.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            # Recompute the chunk's logits in backward instead of keeping [M, V] alive: with
            # V ~ 248K the saved logits of a batch would dwarf the drafter itself.
            total = total + checkpoint(
                fn,
                flat[part],
                lm_head_weight,
                w[part],
                *(t[part] for t in targets),
                use_reentrant=False,
            )
    if rows.numel() == 0:
        return source.sum() * 0.0
    return total / (w.sum() if denominator is None else denominator)
