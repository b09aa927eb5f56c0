"""The drafter's training loss: position-weighted hard cross-entropy over block slots.

loss = sum_{n,k} w[n,k] * valid[n,k] * CE(q[n,k], label[n,k]) / sum_{n,k} w[n,k] * valid[n,k],
summed over every rank's slots, with w[n,0] = 0 (the anchor has no label). Labels: the stored
verifier argmax (dflash_train.blocks.block_labels). An alternative soft target, `kl-topk`, uses
the stored verifier top-k logits + lse instead; it is never the default.

Position weights w (LossConfig.position_weights; this module is their only home):
  decay (default)  w_k = exp(-(k-1)/gamma) for k >= 1 (docs/reference.md §5).
  dpace            D-PACE (arXiv 2605.18810), per block over its supervised slots: with
                   q_i = exp(-CE_i) detached and s_i = (1 - a) q_i + a (s_i = 1 where slot i
                   has no label), P_j = prod_{i<=j} s_i and w_j = sum_{m>=j} P_m valid_m: the
                   weight of slot j is the smoothed expected number of accepted slots that
                   depend on it, so slots the drafter already reaches count most.
Either way the loss divides by the sum of the weights it used (a weighted mean CE in nats,
comparable across the two and with ln V), as SpecForge does for D-PACE. speculators divides
D-PACE's weighted sum by the count of supervised slots instead, so its loss and gradient scale
follow the drafter's confidence: at a = 0.5 and B = 16 the mean weight per slot goes from
~0.13 (every q near 0) to 8 (every q = 1), a 60x drift that grad clipping and the LR schedule
would then see. The weights are fixed once the forward has run, so the choice only rescales
each step as a whole.

A DFlash 2 drafter adds `selector_weight` x the selector term (`selector_ce_loss`): per slot a
K-way CE over its top-K unary candidates, scored with the teacher-forced predecessor (the
anchor, then the previous slot's label), weighed by the same position weights w as the unary
term (decay, or D-PACE from the unary CE), the out-of-top-K rule LossConfig's.

This module owns the formulas and the memory-safe way to apply the frozen lm_head (row
chunks whose logits never outlive their chunk: hard CE builds each row's input gradient in
the forward, head_cross_entropy; the KL, or a trainable head, recomputes them in backward).
It must never build labels from anything but the verifier
targets it is given, and never touch the noise or the optimiser.
"""

import math
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

DEFAULT_DPACE_ALPHA = 0.5
"""D-PACE's smoothing a in s_i = (1 - a) q_i + a: speculators' and SpecForge's default. It keeps
the prefix products from collapsing to 0 behind one unconfident slot early in training."""

DEFAULT_CHUNK_ROWS = 2048
"""Block slots per lm_head chunk: 2048 x 248K fp32 logits is ~2 GB, alive one chunk at a time."""

PositionWeights = Literal["decay", "dpace"]
OutOfTopK = Literal["strict", "inject", "drop"]
GlobalSum = Callable[[torch.Tensor], torch.Tensor]
"""Turns this process's weight sum into the sum over every rank (an all-reduce)."""


@dataclass
class LossConfig:
    """Which loss the trainer minimises, how it weighs block slots and applies the lm_head."""

    kind: Literal["ce", "kl-topk"] = "ce"
    """`ce`: hard CE on the verifier argmax (default). `kl-topk`: KL to the stored top-k
    verifier probabilities (mass outside the stored top-k is ignored)."""
    position_weights: PositionWeights = "decay"
    """How slots of a block are weighed. `decay` (default): w_k = exp(-(k-1)/gamma), fixed.
    `dpace`: D-PACE, from the drafter's own detached confidence on each slot (kind `ce`
    only: its q_i = exp(-CE_i) is the probability of the verifier's token)."""
    gamma: float = DEFAULT_GAMMA
    """Position decay length of `decay`; w_k = exp(-(k-1)/gamma) for slot k >= 1."""
    dpace_alpha: float = DEFAULT_DPACE_ALPHA
    """Smoothing a of `dpace`, in [0, 1]: s_i = (1 - a) q_i + a. 1 weighs slot j by the
    number of supervised slots from j on (no confidence); 0 is unsmoothed."""
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    """Rows (block slots) per lm_head chunk when the loss is given hidden states."""
    selector_weight: float = 1.0
    """DFlash 2 drafters only: the loss is unary + selector_weight x the selector term (a
    K-way CE over each slot's top-K candidates, see `selector_ce_loss`); 0 trains the
    selector not at all. Finite, >= 0."""
    selector_out_of_top_k: OutOfTopK = "strict"
    """DFlash 2: a slot whose label is not among its top-K candidates. `strict` (default):
    the candidates are exactly inference's, so the slot adds 0 to the selector term but keeps
    its weight in the denominator (the term is a mean over every slot the selector scores,
    in the unary loss's units, and shrinks with the top-K's coverage; the unary CE alone pulls
    such a label in). `drop`: the slot leaves the term, numerator and denominator (SpecForge,
    NeMo, TorchSpec). `inject`: the label replaces the K-th candidate there (speculators).
    log.jsonl's selector_recall is the fraction of slots whose label is in the top-K."""

    def __post_init__(self) -> None:
        if self.kind not in ("ce", "kl-topk"):
            raise BlockError(f"loss kind must be 'ce' or 'kl-topk', got {self.kind!r}")
        if self.position_weights not in ("decay", "dpace"):
            raise BlockError(f"loss position_weights must be 'decay' or 'dpace', got "
                             f"{self.position_weights!r}")
        if self.position_weights == "dpace" and self.kind != "ce":
            raise BlockError(f"loss position_weights 'dpace' needs kind 'ce' (its confidence "
                             f"is the probability of the verifier's token), got {self.kind!r}")
        if not self.gamma > 0:
            raise BlockError(f"loss gamma must be > 0, got {self.gamma}")
        _check_alpha(self.dpace_alpha)
        if self.chunk_rows < 1:
            raise BlockError(f"loss chunk_rows must be >= 1, got {self.chunk_rows}")
        if not (math.isfinite(self.selector_weight) and self.selector_weight >= 0):
            raise BlockError(f"loss selector_weight must be a finite number >= 0, got "
                             f"{self.selector_weight}")
        if self.selector_out_of_top_k not in ("strict", "inject", "drop"):
            raise BlockError(f"loss selector_out_of_top_k must be 'strict', 'inject' or "
                             f"'drop', got {self.selector_out_of_top_k!r}")


def decay_weights(block_size: int = BLOCK_SIZE, gamma: float = DEFAULT_GAMMA) -> torch.Tensor:
    """Per-slot weights [B]: w_0 = 0 (the anchor has no label), w_k = exp(-(k-1)/gamma)."""
    if not gamma > 0:
        raise BlockError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def slot_weights(valid: torch.Tensor, gamma: float = DEFAULT_GAMMA) -> torch.Tensor:
    """Decay weight of every slot [N, B] where the label is valid, else 0."""
    if valid.dim() != 2:
        raise BlockError(f"valid must be [N, B], got shape {tuple(valid.shape)}")
    w = decay_weights(valid.shape[1], gamma).to(valid.device)
    return w * valid.float()


@torch.no_grad()
def dpace_weights(
    ce: torch.Tensor, valid: torch.Tensor, alpha: float = DEFAULT_DPACE_ALPHA
) -> torch.Tensor:
    """D-PACE weight of every slot [N, B] from its CE [N, B] (read only where valid), 0 where
    the label is invalid and at the anchor. No gradient flows through it."""
    if valid.dim() != 2 or ce.shape != valid.shape:
        raise BlockError(f"ce {tuple(ce.shape)} and valid {tuple(valid.shape)} must both be "
                         "[N, B]")
    _check_alpha(alpha)
    supervised = _supervised(valid)
    confidence = torch.exp(-_at_least_fp32(ce.detach()))
    smoothed = torch.where(supervised, (1 - alpha) * confidence + alpha, 1.0)
    reach = torch.cumprod(smoothed, dim=-1) * supervised  # P_m where slot m counts, else 0
    return reach.flip(-1).cumsum(-1).flip(-1) * supervised  # sum_{m>=j} P_m valid_m


def block_ce_loss(
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    position_weights: PositionWeights = "decay",
    gamma: float = DEFAULT_GAMMA,
    dpace_alpha: float = DEFAULT_DPACE_ALPHA,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    global_sum: GlobalSum | None = None,
    weights_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Position-weighted hard CE, from logits [N, B, V] or hidden [N, B, H] + lm_head [V, H].

    `global_sum` sums the weight sum over ranks (under DDP, so every rank's slot counts the
    same); every rank must then call this, with or without valid slots. With no valid slot
    the loss is an exact 0 still attached to the graph, so DDP sees every parameter.
    weights_out: a list the slot weights used, [N, B] detached (0 where unsupervised), are
    appended to, for a term that weighs its slots the same way (the DFlash 2 selector's).
    """
    _check_labels(labels, valid)
    rows = _supervised(valid).reshape(-1).nonzero().flatten()
    targets = (labels.reshape(-1)[rows].long(),)
    if position_weights == "dpace":
        weigh = partial(_dpace_row_weights, valid=valid, rows=rows, alpha=dpace_alpha)
    elif position_weights == "decay":
        weigh = partial(_decay_row_weights, slot_weights(valid, gamma).reshape(-1)[rows])
    else:
        raise BlockError(f"position_weights must be 'decay' or 'dpace', got "
                         f"{position_weights!r}")
    if weights_out is not None:
        weigh = partial(_kept_weights, weigh, rows=rows, shape=valid.shape, out=weights_out)
    return _weighted_loss(
        _ce_rows, targets, rows, weigh, logits, hidden, lm_head_weight, chunk_rows, global_sum,
        head_rows=head_cross_entropy,
    )


def _kept_weights(weigh: Callable[[torch.Tensor], torch.Tensor], row_loss: torch.Tensor, *,
                  rows: torch.Tensor, shape: torch.Size, out: list[torch.Tensor]
                  ) -> torch.Tensor:
    """weigh(row_loss), also scattered to a [N, B] tensor appended to `out`."""
    w = weigh(row_loss)
    full = w.new_zeros(shape.numel())
    full[rows.to(w.device)] = w.detach()
    out.append(full.view(shape))
    return w


def selector_predecessors(labels: torch.Tensor, valid: torch.Tensor,
                          anchor_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher-forced predecessor of every slot [N, B], whether it has one [N, B]): slot 1
    follows the anchor token, slot k >= 2 the label of slot k-1 (the target's token there,
    which a walk that was right so far has chosen); a slot after an unlabelled one has
    none. Slot 0 has none."""
    anchor = anchor_ids[:, None].to(labels)
    pred = torch.cat([anchor, anchor, labels[:, 1:-1]], dim=1)  # slot k reads column k
    first = torch.ones_like(valid[:, :1], dtype=torch.bool)
    known = torch.cat([~first, first, valid[:, 1:-1].bool()], dim=1)
    return pred.clamp(min=0).long(), known


def selector_ce_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    anchor_ids: torch.Tensor,
    lm_head_weight: torch.Tensor,
    selector,
    weights: torch.Tensor,
    *,
    out_of_top_k: OutOfTopK = "strict",
    embed: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    global_sum: GlobalSum | None = None,
) -> torch.Tensor:
    """DFlash 2's selector term over blocks: hidden [N, B, H], labels / valid [N, B], the
    anchor tokens [N], the slots' position weights [N, B] (the unary term's, detached).

    For every supervised slot with a predecessor (selector_predecessors): its candidates are
    the top-K of its own unary logits (as the walk takes them at inference; the ids carry no
    gradient, their unary scores do), its scores unary + <A[pred] * P h, B[cand]>, and its
    term the K-way CE of the label's candidate. out_of_top_k: LossConfig's rule for a label
    outside them. Returns sum w * CE / sum w (over every rank with `global_sum`); an attached
    0 when no slot counts.
    """
    _check_labels(labels, valid)
    pred, known = selector_predecessors(labels, valid, anchor_ids)
    counted = _supervised(valid) & known
    rows = counted.reshape(-1).nonzero().flatten().to(hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])[rows]
    y = labels.reshape(-1).to(hidden.device)[rows].long()
    w = _at_least_fp32(weights.reshape(-1).to(hidden.device)[rows].detach())
    with torch.no_grad():
        candidates = torch.cat([
            F.linear(h[s:s + chunk_rows], lm_head_weight).topk(selector.top_k, dim=-1).indices
            for s in range(0, h.shape[0], chunk_rows)]) if h.shape[0] else \
            y.new_zeros(0, selector.top_k)
    in_top = (candidates == y[:, None]).any(-1)
    if out_of_top_k == "inject":
        injected = torch.cat([candidates[:, :-1], y[:, None]], dim=1)
        candidates = torch.where(in_top[:, None], candidates, injected)
        kept = torch.ones_like(in_top)
    else:
        kept = in_top
    flat_pred = pred.reshape(-1).to(hidden.device)[rows]
    target = (candidates == y[:, None]).long().argmax(-1)
    score_rows = partial(_selector_ce_rows, selector, lm_head_weight, embed)
    # Recompute each chunk in backward: its gathered lm_head rows (and, factorised, embedding
    # rows) are [m, K, H], K times the hidden states; kept for every slot they would dwarf
    # the step (61k slots x 16 x 5120 fp32 is 20 GB).
    ce = torch.cat([
        checkpoint(score_rows, h[s:s + chunk_rows], flat_pred[s:s + chunk_rows],
                   candidates[s:s + chunk_rows], target[s:s + chunk_rows], use_reentrant=False)
        for s in range(0, h.shape[0], chunk_rows)]) if h.shape[0] else h.new_zeros(0)
    numerator = (torch.where(kept, ce, 0.0) * w).sum()
    denominator = (w * kept).sum() if out_of_top_k == "drop" else w.sum()
    if global_sum is not None:  # every rank calls it, even one without a counted slot
        denominator = global_sum(denominator)
    attached = hidden.sum() * 0.0 + sum(p.sum() for p in selector.parameters()) * 0.0
    if rows.numel() == 0:
        return attached
    return attached + numerator / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)


def _selector_ce_rows(selector, lm_head_weight: torch.Tensor, embed: torch.Tensor | None,
                      h: torch.Tensor, pred: torch.Tensor, candidates: torch.Tensor,
                      target: torch.Tensor) -> torch.Tensor:
    """K-way CE [m] of `target` (an index into each row's candidates [m, K]), scored
    unary + pairwise from hidden rows h [m, H] after predecessors [m]."""
    unary = torch.einsum("mkh,mh->mk", _at_least_fp32(lm_head_weight[candidates]),
                         _at_least_fp32(h))
    projected = _at_least_fp32(selector.hidden_projection(h))
    scores = _at_least_fp32(selector.scores(projected, pred, unary, candidates, embed))
    return torch.logsumexp(scores, -1) - scores.gather(-1, target[:, None])[:, 0]


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
    global_sum: GlobalSum | None = None,
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
    rows = _supervised(valid).reshape(-1).nonzero().flatten()
    k = target_ids.shape[-1]
    probs = topk_target_probs(target_logits, target_lse).reshape(-1, k)[rows]
    targets = (target_ids.reshape(-1, k)[rows].long(), probs)
    weigh = partial(_decay_row_weights, slot_weights(valid, gamma).reshape(-1)[rows])
    return _weighted_loss(
        _kl_topk_rows, targets, rows, weigh, logits, hidden, lm_head_weight, chunk_rows,
        global_sum
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


def _check_alpha(alpha: float) -> None:
    if not (math.isfinite(alpha) and 0 <= alpha <= 1):
        raise BlockError(f"loss dpace_alpha must be a finite number in [0, 1], got {alpha}")


def _supervised(valid: torch.Tensor) -> torch.Tensor:
    """The slots that carry a label [N, B]: valid ones past the anchor (slot 0 predicts
    nothing, whatever `valid` says)."""
    if valid.dim() != 2:
        raise BlockError(f"valid must be [N, B], got shape {tuple(valid.shape)}")
    out = valid.bool().clone()
    out[:, 0] = False
    return out


def _decay_row_weights(w: torch.Tensor, row_loss: torch.Tensor) -> torch.Tensor:
    """The fixed decay weights of the selected rows; the rows' losses do not change them."""
    return w.to(row_loss.device)


def _dpace_row_weights(row_loss: torch.Tensor, *, valid: torch.Tensor, rows: torch.Tensor,
                       alpha: float) -> torch.Tensor:
    """D-PACE weights of the selected rows from their (detached) per-row CE [M]."""
    ce = row_loss.new_zeros(valid.numel())
    ce[rows.to(ce.device)] = row_loss.detach()
    w = dpace_weights(ce.view(valid.shape), valid.to(ce.device), alpha)
    return w.reshape(-1)[rows.to(ce.device)]


def head_cross_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                       labels: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
                       ) -> torch.Tensor:
    """Per-row hard CE [M] of hidden rows [M, H] through a frozen lm_head [V, H], as
    `_ce_rows(hidden @ lm_head.T, labels)`, `chunk_rows` rows at a time.

    Each row's loss gradient with respect to its hidden state, (softmax - onehot) @ lm_head, is
    built in the forward while the chunk's logits exist, and only that [M, H] is kept. The
    backward is then a per-row scale: two lm_head matmuls per row where recomputing the logits
    in backward takes three, and the step's time is mostly those matmuls. The lm_head gets no
    gradient (it is the target's, frozen)."""
    return _HeadCrossEntropy.apply(hidden, lm_head_weight, labels, chunk_rows)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, lm_head_weight, labels, chunk_rows):
        losses, grads = [], []
        for s in range(0, hidden.shape[0], chunk_rows):
            logits = F.linear(hidden[s:s + chunk_rows], lm_head_weight)
            wide = _at_least_fp32(logits)
            y = labels[s:s + chunk_rows, None]
            lse = torch.logsumexp(wide, dim=-1, keepdim=True)
            losses.append((lse - wide.gather(-1, y))[:, 0])
            # softmax - onehot, in the logits' own dtype for the matmul back to [m, H]: the
            # dtype autograd would give the gradient of F.linear under the same autocast
            probs = (wide - lse).exp_()
            probs.scatter_add_(-1, y, probs.new_full(y.shape, -1.0))
            grads.append(probs.to(logits.dtype) @ lm_head_weight.to(logits.dtype))
        ctx.hidden_dtype = hidden.dtype
        empty = hidden.new_zeros(0, hidden.shape[-1])
        ctx.save_for_backward(torch.cat(grads) if grads else empty)
        return torch.cat(losses) if losses else hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_loss):
        (row_grads,) = ctx.saved_tensors
        grad = grad_loss[:, None].to(row_grads.dtype) * row_grads
        return grad.to(ctx.hidden_dtype), None, None, None


def _chunk_rows_loss(
    row_loss: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *targets: torch.Tensor,
) -> torch.Tensor:
    """row_loss(hidden_i @ weight^T, targets_i) for one chunk of rows [m]."""
    return row_loss(F.linear(hidden, weight), *targets)


def _weighted_loss(
    row_loss: Callable[..., torch.Tensor],
    targets: tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    weigh: Callable[[torch.Tensor], torch.Tensor],
    logits: torch.Tensor | None,
    hidden: torch.Tensor | None,
    lm_head_weight: torch.Tensor | None,
    chunk_rows: int,
    global_sum: GlobalSum | None,
    head_rows: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_i w_i * loss_i over the selected rows / the (global) sum of w, with w = weigh(loss)
    from the detached per-row losses. `head_rows(hidden, lm_head, *targets, chunk_rows)`, when
    given, computes row_loss through a frozen lm_head in one pass (head_cross_entropy)."""
    if (logits is None) == (hidden is None):
        raise BlockError("pass exactly one of logits= or hidden= (with lm_head_weight=)")
    if hidden is not None and lm_head_weight is None:
        raise BlockError("hidden= needs lm_head_weight= (the target's frozen [V, H] lm_head)")
    source = logits if logits is not None else hidden
    rows = rows.to(source.device)
    targets = tuple(t.to(source.device) for t in targets)
    flat = source.reshape(-1, source.shape[-1])[rows]  # [M, V] or [M, H]
    if logits is not None:
        per_row = row_loss(flat, *targets)
    elif head_rows is not None and not lm_head_weight.requires_grad:
        per_row = head_rows(flat, lm_head_weight, *targets, chunk_rows)
    else:
        fn = partial(_chunk_rows_loss, row_loss)
        # Recompute each chunk's logits in backward instead of keeping [M, V] alive: with
        # V ~ 248K the saved logits of a batch would dwarf the drafter itself. Only the
        # per-row losses [M] stay, which D-PACE needs whole before it can weigh any row.
        parts = [checkpoint(fn, flat[s:s + chunk_rows], lm_head_weight,
                            *(t[s:s + chunk_rows] for t in targets), use_reentrant=False)
                 for s in range(0, flat.shape[0], chunk_rows)]
        per_row = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    w = weigh(per_row.detach()).to(per_row.dtype)
    denominator = w.sum()
    if global_sum is not None:  # every rank calls it, even one without a valid slot
        denominator = global_sum(denominator)
    if rows.numel() == 0:
        return source.sum() * 0.0
    return (per_row * w).sum() / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)
