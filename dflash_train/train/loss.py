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

A DFlash 2 drafter adds `selector_weight` x the selector term (`selector_loss`): per slot a
K-way CE over its top-K unary candidates, scored with the teacher-forced predecessor (the
anchor, then the previous slot's label), weighed by the same position weights w as the unary
term (decay, or D-PACE from the unary CE), the out-of-top-K rule LossConfig's.

Every loss takes a `Head` (the hidden states and the frozen rows they are scored against),
the `SlotTargets` and the whole LossConfig, and gives back a `BlockLoss`: the loss and the
slot weights it used. The config's rules are checked once, where it is built.

This module owns the formulas and the memory-safe way to apply the frozen lm_head (row
chunks whose logits never outlive their chunk: hard CE builds each row's input gradient in
the forward, head_cross_entropy; the KL, or a trainable head, recomputes them in backward).
It must never build labels from anything but the verifier targets it is given, and never
touch the noise or the optimiser.
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
    """Rows (block slots) per lm_head chunk: only one chunk's logits exist at a time."""
    selector_weight: float = 1.0
    """DFlash 2 drafters only: the loss is unary + selector_weight x the selector term (a
    K-way CE over each slot's top-K candidates, see `selector_loss`); 0 trains the
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
        if not (math.isfinite(self.dpace_alpha) and 0 <= self.dpace_alpha <= 1):
            raise BlockError(f"loss dpace_alpha must be a finite number in [0, 1], got "
                             f"{self.dpace_alpha}")
        if self.chunk_rows < 1:
            raise BlockError(f"loss chunk_rows must be >= 1, got {self.chunk_rows}")
        if not (math.isfinite(self.selector_weight) and self.selector_weight >= 0):
            raise BlockError(f"loss selector_weight must be a finite number >= 0, got "
                             f"{self.selector_weight}")
        if self.selector_out_of_top_k not in ("strict", "inject", "drop"):
            raise BlockError(f"loss selector_out_of_top_k must be 'strict', 'inject' or "
                             f"'drop', got {self.selector_out_of_top_k!r}")


@dataclass
class Head:
    """The drafter's last hidden states and the frozen target matrices the loss scores them
    with: logits = hidden @ weight.T, never built whole."""

    hidden: torch.Tensor
    """[N, B, H]: the final hidden state of each of the B slots of N blocks."""
    weight: torch.Tensor
    """[V, H]: the lm_head rows the drafter drafts over (the target's, or its draft
    vocabulary's). Frozen, hard CE takes one fused pass (head_cross_entropy); a weight that
    requires grad has each chunk's logits recomputed in backward instead."""
    embed: torch.Tensor | None = None
    """The target's token embedding [V, H], which factorised DFlash 2 selector codebooks are
    read through (None: free codebooks, or no selector)."""


@dataclass
class SlotTargets:
    """What the B slots of N blocks are trained toward, in the head's ids."""

    labels: torch.Tensor
    """long [N, B]: the verifier's argmax (blocks.block_labels), IGNORE_LABEL where none."""
    valid: torch.Tensor
    """bool [N, B]: the slots with a label (slot 0, the anchor, never counts)."""
    anchor_ids: torch.Tensor | None = None
    """long [N]: each block's anchor token, slot 1's predecessor in the selector term."""
    topk_ids: torch.Tensor | None = None
    """long [N, B, k], kind kl-topk: the verifier's stored top-k ids of each slot
    (blocks.verifier_rows)."""
    topk_logits: torch.Tensor | None = None
    """float [N, B, k]: their logits."""
    lse: torch.Tensor | None = None
    """float [N, B]: the log-sum-exp of the verifier's logits at each slot."""

    def __post_init__(self) -> None:
        if self.labels.shape != self.valid.shape or self.labels.dim() != 2:
            raise BlockError(f"labels {tuple(self.labels.shape)} and valid "
                             f"{tuple(self.valid.shape)} must both be [N, B]")
        if self.topk_ids is None:
            return
        ids, logits, lse = self.topk_ids, self.topk_logits, self.lse
        if ids.shape != logits.shape or ids.shape[:2] != self.valid.shape:
            raise BlockError(f"topk_ids {tuple(ids.shape)} / topk_logits "
                             f"{tuple(logits.shape)} must both be [N, B, k] with [N, B] = "
                             f"{tuple(self.valid.shape)}")
        if lse.shape != self.valid.shape:
            raise BlockError(f"lse must be [N, B] = {tuple(self.valid.shape)}, got "
                             f"{tuple(lse.shape)}")


@dataclass
class BlockLoss:
    """A loss over block slots, and how it weighed them."""

    loss: torch.Tensor
    """The scalar minimised, attached to the graph (an exact 0 when no slot counts)."""
    slot_weights: torch.Tensor
    """[N, B], detached: each slot's position weight in the unary term, 0 where it does not
    count; the selector term weighs its slots by the same."""


def decay_weights(block_size: int = BLOCK_SIZE, gamma: float = DEFAULT_GAMMA) -> torch.Tensor:
    """Per-slot weights [B]: w_0 = 0 (the anchor has no label), w_k = exp(-(k-1)/gamma)."""
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
    supervised = _supervised(valid)
    confidence = torch.exp(-_at_least_fp32(ce.detach()))
    smoothed = torch.where(supervised, (1 - alpha) * confidence + alpha, 1.0)
    reach = torch.cumprod(smoothed, dim=-1) * supervised  # P_m where slot m counts, else 0
    return reach.flip(-1).cumsum(-1).flip(-1) * supervised  # sum_{m>=j} P_m valid_m


def drafter_loss(head: Head, targets: SlotTargets, cfg: LossConfig, selector=None,
                 global_sum: GlobalSum | None = None) -> BlockLoss:
    """The loss a drafter trains on: the unary term (`unary_loss`), plus, for a DFlash 2
    `selector` and a positive selector_weight, selector_weight x the selector term weighed
    by the unary term's slot weights."""
    unary = unary_loss(head, targets, cfg, global_sum)
    if selector is None or cfg.selector_weight == 0:
        return unary
    term = selector_loss(head, targets, selector, unary.slot_weights, cfg, global_sum)
    return BlockLoss(unary.loss + cfg.selector_weight * term, unary.slot_weights)


def unary_loss(head: Head, targets: SlotTargets, cfg: LossConfig,
               global_sum: GlobalSum | None = None) -> BlockLoss:
    """sum_i w_i loss_i / sum_i w_i over the supervised slots: loss_i the hard CE of the
    label (kind ce) or the truncated KL to the verifier's top-k (kl-topk), w_i its position
    weight (decay, or D-PACE from the detached CE).

    `global_sum` sums the weight sum over ranks (under DDP, so every rank's slot counts the
    same); every rank must then call this, with or without valid slots. With no valid slot
    the loss is an exact 0 still attached to the graph, so DDP sees every parameter."""
    valid = targets.valid
    if head.hidden.shape[:-1] != valid.shape:
        raise BlockError(f"hidden {tuple(head.hidden.shape)} must be [N, B, H] with [N, B] "
                         f"= {tuple(valid.shape)}")
    rows = _supervised(valid).reshape(-1).nonzero().flatten()
    per_row = _row_losses(head, targets, rows, cfg)
    w = _row_weights(per_row.detach(), valid, rows, cfg)
    kept = w.new_zeros(valid.numel())
    kept[rows.to(w.device)] = w.detach()
    w = w.to(per_row.dtype)
    denominator = w.sum()
    if global_sum is not None:  # every rank calls it, even one without a valid slot
        denominator = global_sum(denominator)
    if rows.numel() == 0:
        return BlockLoss(head.hidden.sum() * 0.0, kept.view(valid.shape))
    loss = (per_row * w).sum() / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)
    return BlockLoss(loss, kept.view(valid.shape))


def _row_losses(head: Head, targets: SlotTargets, rows: torch.Tensor,
                cfg: LossConfig) -> torch.Tensor:
    """The unary loss [M] of each selected slot (rows index the flattened [N * B])."""
    device = head.hidden.device
    flat = head.hidden.reshape(-1, head.hidden.shape[-1])[rows.to(device)]  # [M, H]
    if cfg.kind == "kl-topk":
        if targets.topk_ids is None:
            raise BlockError("loss kind kl-topk needs the verifier's top-k of every slot "
                             "(SlotTargets.topk_ids, topk_logits and lse)")
        k = targets.topk_ids.shape[-1]
        probs = topk_target_probs(targets.topk_logits, targets.lse).reshape(-1, k)[rows]
        ids = targets.topk_ids.reshape(-1, k)[rows].long()
        return _in_chunks(partial(_head_rows, _kl_topk_rows, head.weight), cfg.chunk_rows,
                          flat, ids.to(device), probs.to(device))
    labels = targets.labels.reshape(-1)[rows].long().to(device)
    if head.weight.requires_grad:
        return recomputed_cross_entropy(flat, head.weight, labels, cfg.chunk_rows)
    return head_cross_entropy(flat, head.weight, labels, cfg.chunk_rows)


def _row_weights(row_loss: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
                 cfg: LossConfig) -> torch.Tensor:
    """The position weights [M] of the selected slots; D-PACE's from their detached losses."""
    if cfg.position_weights == "decay":
        return slot_weights(valid, cfg.gamma).reshape(-1)[rows].to(row_loss.device)
    ce = row_loss.new_zeros(valid.numel())
    ce[rows.to(ce.device)] = row_loss
    w = dpace_weights(ce.view(valid.shape), valid.to(ce.device), cfg.dpace_alpha)
    return w.reshape(-1)[rows.to(ce.device)]


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


def selector_loss(head: Head, targets: SlotTargets, selector, weights: torch.Tensor,
                  cfg: LossConfig, global_sum: GlobalSum | None = None) -> torch.Tensor:
    """DFlash 2's selector term over blocks, the slots weighed by `weights` [N, B] (the
    unary term's, detached).

    For every supervised slot with a predecessor (selector_predecessors): its candidates are
    the top-K of its own unary logits (as the walk takes them at inference; the ids carry no
    gradient, their unary scores do), its scores unary + <A[pred] * P h, B[cand]>, and its
    term the K-way CE of the label's candidate. cfg.selector_out_of_top_k: the rule for a
    label outside them. Returns sum w * CE / sum w (over every rank with `global_sum`); an
    attached 0 when no slot counts.
    """
    if targets.anchor_ids is None:
        raise BlockError("the selector term needs each block's anchor token "
                         "(SlotTargets.anchor_ids)")
    hidden, device = head.hidden, head.hidden.device
    pred, known = selector_predecessors(targets.labels, targets.valid, targets.anchor_ids)
    counted = _supervised(targets.valid) & known
    rows = counted.reshape(-1).nonzero().flatten().to(device)
    h = hidden.reshape(-1, hidden.shape[-1])[rows]
    y = targets.labels.reshape(-1).to(device)[rows].long()
    w = _at_least_fp32(weights.reshape(-1).to(device)[rows].detach())
    candidates, kept = _selector_candidates(h, y, head.weight, selector.top_k, cfg)
    flat_pred = pred.reshape(-1).to(device)[rows]
    target = (candidates == y[:, None]).long().argmax(-1)
    # Recompute each chunk in backward: its gathered lm_head rows (and, factorised, embedding
    # rows) are [m, K, H], K times the hidden states; kept for every slot they would dwarf
    # the step (61k slots x 16 x 5120 fp32 is 20 GB).
    ce = _in_chunks(partial(_selector_ce_rows, selector, head.weight, head.embed),
                    cfg.chunk_rows, h, flat_pred, candidates, target)
    numerator = (torch.where(kept, ce, 0.0) * w).sum()
    denominator = (w * kept).sum() if cfg.selector_out_of_top_k == "drop" else w.sum()
    if global_sum is not None:  # every rank calls it, even one without a counted slot
        denominator = global_sum(denominator)
    attached = hidden.sum() * 0.0 + sum(p.sum() for p in selector.parameters()) * 0.0
    if rows.numel() == 0:
        return attached
    return attached + numerator / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)


def _selector_candidates(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, top_k: int,
                         cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the candidates [m, K] each slot's selector scores, whether its label [m] counts in
    the term): the top-K of its unary logits, the label put in as the K-th under `inject`."""
    with torch.no_grad():
        candidates = torch.cat([
            F.linear(h[s:s + cfg.chunk_rows], weight).topk(top_k, dim=-1).indices
            for s in range(0, h.shape[0], cfg.chunk_rows)]) if h.shape[0] else \
            y.new_zeros(0, top_k)
    in_top = (candidates == y[:, None]).any(-1)
    if cfg.selector_out_of_top_k == "inject":
        injected = torch.cat([candidates[:, :-1], y[:, None]], dim=1)
        return torch.where(in_top[:, None], candidates, injected), torch.ones_like(in_top)
    return candidates, in_top


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


def _supervised(valid: torch.Tensor) -> torch.Tensor:
    """The slots that carry a label [N, B]: valid ones past the anchor (slot 0 predicts
    nothing, whatever `valid` says)."""
    if valid.dim() != 2:
        raise BlockError(f"valid must be [N, B], got shape {tuple(valid.shape)}")
    out = valid.bool().clone()
    out[:, 0] = False
    return out


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


def recomputed_cross_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                             labels: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
                             ) -> torch.Tensor:
    """head_cross_entropy's per-row hard CE, each chunk's logits recomputed in backward
    instead of its input gradient built in the forward: three lm_head matmuls per row, but
    the lm_head may take a gradient."""
    return _in_chunks(partial(_head_rows, _ce_rows, lm_head_weight), chunk_rows, hidden, labels)


def _head_rows(row_loss: Callable[..., torch.Tensor], weight: torch.Tensor,
               hidden: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
    """row_loss(hidden_i @ weight^T, targets_i) for one chunk of rows [m]."""
    return row_loss(F.linear(hidden, weight), *targets)


def _in_chunks(rows_fn: Callable[..., torch.Tensor], chunk_rows: int,
               *rows: torch.Tensor) -> torch.Tensor:
    """rows_fn over `chunk_rows` rows of every tensor in `rows` at a time, concatenated [M].
    Each chunk is recomputed in backward instead of keeping what it made alive: with V ~ 248K
    a batch's saved logits would dwarf the drafter itself. Only the per-row losses stay,
    which D-PACE needs whole before it can weigh any row."""
    first = rows[0]
    parts = [checkpoint(rows_fn, *(t[s:s + chunk_rows] for t in rows), use_reentrant=False)
             for s in range(0, first.shape[0], chunk_rows)]
    return torch.cat(parts) if parts else first.new_zeros(0, dtype=torch.float32)
