"""Block geometry shared by training and evaluation: anchors, positions, labels, replay order.

A block at anchor position `a` is `[token a, MASK x (B-1)]` at absolute positions a .. a+B-1
(docs/reference.md §3). Slot k >= 1 predicts the token at position a+k; its label is the stored
verifier's argmax at position a+k-1 (the target's own prediction of token a+k). Slot 0 has
no label.

This module owns that arithmetic and nothing else. It must never read a tensor that noise
touches (labels come from stored verifier ids only), never build attention masks (the
drafter owns those) and never touch the store's layout.
"""

from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from dflash_train.errors import DflashError

BLOCK_SIZE = 16
"""B: one anchor token + 15 masked slots per block (docs/reference.md §3, published b16)."""

ANCHORS_PER_SEQ = 512
"""Anchors sampled per sequence per epoch (docs/reference.md §4: ~512, uniform, no replacement)."""

IGNORE_LABEL = -100
"""Label of a slot that has no target; equal to torch's cross-entropy ignore_index."""


class BlockError(ValueError, DflashError):
    """Malformed block inputs: shapes, anchors, labels, loss / noise / metric settings."""


def valid_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions that may anchor a block: a >= 1, and tokens a and a+1 are assistant tokens."""
    _check_1d(loss_mask, "loss_mask")
    mask = loss_mask.bool()
    out = torch.zeros_like(mask)
    # a >= 1 so the block has at least one context position (< a) to attend to; a+1 must be a
    # trained token or the block has no valid label at all.
    out[1:-1] = mask[1:-1] & mask[2:]
    return out


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Every valid anchor position, ascending (eval `--mode all`)."""
    return valid_anchor_mask(loss_mask).nonzero().flatten()


MAX_SEED = 2**63 - 1
"""Seeds are 64-bit signed integers: what TOML holds and torch.manual_seed takes."""


def anchor_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    """A CPU generator fixed by (seed, epoch, sample): re-sampling is reproducible in any order."""
    # SeedSequence mixes the triple so neighbouring samples / epochs get unrelated streams, and
    # the result does not depend on which rank or in which order the sample is visited.
    state = np.random.SeedSequence([seed, epoch, sample_index]).generate_state(1, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0]))


def sample_anchors(
    loss_mask: torch.Tensor,
    max_anchors: int = ANCHORS_PER_SEQ,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Up to `max_anchors` valid anchors, uniform without replacement, returned ascending."""
    if max_anchors < 0:
        raise BlockError(f"max_anchors must be >= 0, got {max_anchors}")
    candidates = eligible_anchors(loss_mask)  # [C]
    if candidates.numel() <= max_anchors:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
    return candidates[pick].sort().values


def block_position_ids(anchors: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Absolute position ids of each block: a .. a+B-1 (never a+1 .. a+B); [..., K] -> [..., K, B].

    The one place this arithmetic lives: labels, masks and RoPE positions all come from it."""
    return anchors.long().unsqueeze(-1) + torch.arange(block_size, device=anchors.device)


def build_block_ids(
    anchor_tokens: torch.Tensor, mask_token_id: int, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Block token ids [..., B]: each anchor token followed by B-1 mask tokens."""
    ids = anchor_tokens.new_full((*anchor_tokens.shape, block_size), mask_token_id)
    ids[..., 0] = anchor_tokens
    return ids


def block_input_ids(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    mask_token_id: int,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Token ids fed to the drafter: [token at a, MASK x (B-1)] per anchor; [N, B]."""
    _check_anchors(anchors, input_ids.shape[0], "input_ids")
    return build_block_ids(input_ids[anchors.long()].long(), mask_token_id, block_size)


def block_label_mask(
    loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Which slots have a label: k >= 1, a+k < L and loss_mask[a+k]."""
    length = loss_mask.shape[0]
    _check_anchors(anchors, length, "loss_mask")
    pos = block_position_ids(anchors, block_size)  # [N, B] = a + k
    inside = pos < length
    valid = inside & loss_mask.bool()[pos.clamp(max=length - 1)]
    valid[:, 0] = False
    return valid


def block_labels(
    verifier_topk_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard labels [N, B] (verifier argmax at a+k-1, IGNORE_LABEL where invalid) and validity."""
    if verifier_topk_ids.dim() != 2:
        # Refusing 1-D input catches the classic wiring bug of passing input_ids (the stored
        # text) where the verifier's predictions belong.
        raise BlockError(
            "verifier_topk_ids must be the store's [L, k] verifier_topk_ids "
            f"(argmax in column 0), got shape {tuple(verifier_topk_ids.shape)}"
        )
    if verifier_topk_ids.shape[0] != loss_mask.shape[0]:
        raise BlockError(
            f"verifier_topk_ids has {verifier_topk_ids.shape[0]} rows but loss_mask has "
            f"{loss_mask.shape[0]}: they must describe the same sample"
        )
    valid = block_label_mask(loss_mask, anchors, block_size)
    argmax = verifier_rows(verifier_topk_ids[:, 0], anchors, block_size).long()  # [N, B]
    labels = torch.where(valid, argmax, torch.full_like(argmax, IGNORE_LABEL))
    return labels, valid


def verifier_rows(
    rows: torch.Tensor, anchors: torch.Tensor, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Per-token verifier data [L, ...] regrouped per slot: out[n, k] = rows[a_n + k - 1].

    Positions past the end are clamped to L-1; mask them with `block_label_mask`. Use this
    for soft targets (verifier top-k logits, lse) so they line up with `block_labels`.
    """
    length = rows.shape[0]
    _check_anchors(anchors, length, "rows")
    src = (block_position_ids(anchors, block_size) - 1).clamp(max=length - 1)  # [N, B]
    return rows[src]  # [N, B, ...]


@torch.no_grad()
def draft_topk(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    k: int,
    chunk_rows: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the fp32 log-softmax over the full vocab, computed in row chunks, no grad.

    hidden: [..., H]; lm_head_weight: [V, H]. Returns (logprobs fp32 [..., k'], ids [..., k'])
    with k' = min(k, V), sorted descending. Chunking keeps [rows, V] logits small (V ~ 248K).
    """
    if k < 1:
        raise BlockError(f"k must be >= 1, got {k}")
    vocab, width = lm_head_weight.shape
    if hidden.shape[-1] != width:
        raise BlockError(
            f"hidden width {hidden.shape[-1]} does not match lm_head_weight width {width}"
        )
    k = min(k, vocab)
    flat = hidden.reshape(-1, width)
    values, ids = [], []
    for start in range(0, flat.shape[0], chunk_rows):
        logits = F.linear(flat[start : start + chunk_rows], lm_head_weight).float()
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    if not values:
        empty = flat.new_zeros((0, k), dtype=torch.float32)
        values, ids = [empty], [empty.long()]
    shape = (*hidden.shape[:-1], k)
    return torch.cat(values).reshape(shape), torch.cat(ids).reshape(shape)


def first_anchor(loss_mask: torch.Tensor, after: int = 0) -> int | None:
    """First response token at a position > `after` (and >= 1): where live decoding starts."""
    _check_1d(loss_mask, "loss_mask")
    mask = loss_mask.bool().clone()
    mask[: max(after + 1, 1)] = False
    hits = mask.nonzero()
    return int(hits[0, 0]) if hits.numel() else None


def next_anchor(anchor: int, tau: int) -> int:
    """Where live greedy decoding anchors next: the bonus token at a + tau."""
    if tau < 1:
        raise BlockError(f"tau must be >= 1 (streak + bonus), got {tau} at anchor {anchor}")
    return anchor + tau


def replay_anchors(loss_mask: torch.Tensor, tau_at: Callable[[int], int]) -> Iterator[int]:
    """Anchors in the order live greedy decoding visits them (eval `--mode replay`).

    Starts at the first response token; after a block with acceptance length tau the next
    anchor is a + tau. When that lands past the end of an assistant segment (or on its last
    token, which has nothing left to predict), the turn is over and replay resumes at the
    first token of the next assistant segment. `tau_at(a)` is called once per yielded anchor,
    so streaks can be computed lazily.
    """
    valid = valid_anchor_mask(loss_mask).tolist()
    mask = loss_mask.bool().tolist()
    length = len(mask)
    anchor = first_anchor(loss_mask)
    while anchor is not None and anchor < length:
        if valid[anchor]:
            yield anchor
            anchor = next_anchor(anchor, int(tau_at(anchor)))
            continue
        anchor = _next_segment_start(mask, anchor)


def _next_segment_start(mask: list[bool], after: int) -> int | None:
    """First p > after where an assistant segment begins (mask[p] and not mask[p-1])."""
    for p in range(after + 1, len(mask)):
        if mask[p] and not mask[p - 1]:
            return p
    return None


def _check_1d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 1:
        raise BlockError(f"{name} must be 1-D (one sample), got shape {tuple(t.shape)}")


def _check_anchors(anchors: torch.Tensor, length: int, name: str) -> None:
    _check_1d(anchors, "anchors")
    if anchors.numel() and (int(anchors.min()) < 1 or int(anchors.max()) >= length):
        raise BlockError(
            f"anchors must lie in [1, {length}) for a {name} of length {length}; got "
            f"min {int(anchors.min())}, max {int(anchors.max())}"
        )
