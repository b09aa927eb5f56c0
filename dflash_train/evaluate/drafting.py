"""Draft blocks at any anchors of many sequences at once, over a context cache built once.

The drafter's own `forward` re-projects the whole context on every call and its live
`draft_block` anchors every row at the cache's end. Replay needs neither: it drafts blocks
at different anchors in different sequences, step after step over the same context. So the
context keys/values of every sequence are computed once (`DFlashDrafter.extend_context`)
and each step runs only the blocks, through `DFlashDrafter.decode_blocks` over that cache:
the layer pass training runs too, under the drafter's own mask rule. Offline replay and the
online loop both draft through `BlockDrafter.draft`; a test proves it equals
`DFlashDrafter.forward` and `draft_block`. A DFlash 2 drafter's draft is its selector walk
(the tokens it proposes), not its unary argmax, wherever a draft is scored.

This module never reads the store, never computes labels or metrics.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_train.drafter import ContextCache, DFlashDrafter, build_block_ids
from dflash_train.drafter.model import PROPOSE_CHUNK_BLOCKS
from dflash_train.evaluate.tree import Candidates, selector_candidates, unary_candidates


class BlockDrafter:
    """A drafter with the target head attached and its context layers picked from the store's."""

    def __init__(self, model: DFlashDrafter, layer_index: list[int] | None = None):
        self.model = model
        self.config = model.config
        self.block_size = model.config.block_size
        self.layer_index = layer_index
        """Indices of the drafter's layers among the store's context layers (None: all)."""

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def _features(self, features: torch.Tensor) -> torch.Tensor:
        if self.layer_index is not None:
            features = features[:, :, self.layer_index]
        return features.to(self.device)

    @torch.no_grad()
    def context_cache(self, features: torch.Tensor) -> ContextCache:
        """Keys/values of whole contexts [N, T, n_store, H] (padding rows are never seen)."""
        cache = ContextCache()
        self.model.extend_context(cache, self._features(features))
        return cache

    @torch.no_grad()
    def extend(self, cache: ContextCache, features: torch.Tensor) -> None:
        """Append the next committed positions' features [N, t, n_store, H] (live decoding)."""
        self.model.extend_context(cache, self._features(features))

    @torch.no_grad()
    def hidden(
        self, cache: ContextCache, anchors: torch.Tensor, anchor_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Final-norm hidden states [N, K, B, H] of blocks at anchors [N, K] (< cache.length).

        Dense attention, as the live `draft_block` uses (the reference path).
        """
        ids = build_block_ids(anchor_tokens.to(self.device).long(), self.config.mask_token_id,
                              self.block_size)
        return self.model.decode_blocks(cache, None, ids, anchors.to(self.device).long(), "dense")

    @property
    def walks(self) -> bool:
        """Whether the drafts are a DFlash 2 selector walk rather than each slot's argmax."""
        return self.model.candidate_selector is not None

    @torch.no_grad()
    def draft(
        self, cache: ContextCache, anchors: torch.Tensor, anchor_tokens: torch.Tensor, top_k: int,
        transitions: bool = False,
    ) -> "Draft":
        """Blocks at anchors [N, K] (tokens anchor_tokens [N, K]): per-slot fp32 log-prob
        top-k, both [N, K, B, k'] on the CPU; rank 0 is the draft: each slot's argmax, or for
        DFlash 2 the token its selector walk chose (then the other top logits, in order), so
        every metric scores what is proposed. Slot 0 (the anchor) is never drafted: its
        entries are 0 / id -1. `transitions`: also the selector's per-predecessor log-probs
        a DFlash 2 draft tree grows from (None for DFlash, whose tree needs only the top-k).
        """
        hidden = self.hidden(cache, anchors, anchor_tokens)
        slots = hidden[:, :, 1:]
        moves = None
        if self.walks:
            selector = self.model.candidate_selector
            logp, ids = self.model.draft_topk(slots, max(top_k, selector.top_k))
            walk, walk_logp, moves = self._walk(slots, anchor_tokens.to(self.device).long(),
                                                transitions)
            logp, ids = walk_first(logp, ids, walk, walk_logp, top_k)
        else:
            logp, ids = self.model.draft_topk(slots, top_k)
        pad = (0, 0, 1, 0)  # one slot in front along the slot axis
        return Draft(F.pad(logp, pad).cpu(), F.pad(ids, pad, value=-1).cpu(), moves)

    def _walk(self, slots: torch.Tensor, anchor_tokens: torch.Tensor, transitions: bool,
              chunk: int = PROPOSE_CHUNK_BLOCKS):
        """The selector walk [N, K, S] of blocks' slots [N, K, S, H], each chosen token's fp32
        log-prob under its slot's logits, and (if asked) the selector's transitions (log-probs
        [N, K, S, C, C], candidates [N, K, S, C]); `chunk` blocks of [S, V] logits at a time."""
        flat, anchors = slots.flatten(0, 1), anchor_tokens.flatten()
        selector, embed = self.model.candidate_selector, self.model.target_embed_tokens
        walks, logps, moves, candidates = [], [], [], []
        for start in range(0, flat.shape[0], chunk):
            h, a = flat[start:start + chunk], anchors[start:start + chunk]
            logits = self.model.logits(h)
            walk = selector.walk(h, logits, a, embed)
            walks.append(walk)
            logps.append(torch.log_softmax(logits.float(), -1).gather(-1, walk[..., None])[..., 0])
            if transitions:
                move, cand = selector.transitions(h, logits, a, embed)
                moves.append(move.cpu())
                candidates.append(cand.cpu())
        shape = slots.shape[:-1]
        out = torch.cat(walks).view(shape), torch.cat(logps).view(shape)
        if not transitions:
            return *out, None
        return *out, (torch.cat(moves).view(*shape, *moves[0].shape[-2:]),
                      torch.cat(candidates).view(*shape, candidates[0].shape[-1]))


@dataclass
class Draft:
    """What the drafter proposes for blocks [N, K] (drafter.draft), on the CPU."""

    logp: torch.Tensor
    """[N, K, B, k]: each slot's top-k fp32 log-probs, rank 0 the draft; slot 0 is 0."""
    ids: torch.Tensor
    """[N, K, B, k]: their token ids; slot 0 is -1."""
    transitions: tuple[torch.Tensor, torch.Tensor] | None = None
    """DFlash 2, when asked: the selector's log-probs per predecessor [N, K, S, C, C] and its
    candidates [N, K, S, C] for slots 1..S."""

    def __getitem__(self, index) -> "Draft":
        """The blocks `index` picks along the leading (block) axes, e.g. [j, :n] or [:, 0]."""
        moves = None if self.transitions is None else tuple(t[index] for t in self.transitions)
        return Draft(self.logp[index], self.ids[index], moves)

    def tree_candidates(self, *index: int) -> Candidates:
        """What the draft tree of block `index` grows from (evaluate/tree.py)."""
        block = self[index]
        if block.transitions is None:
            return unary_candidates(block.logp[1:], block.ids[1:])
        return selector_candidates(*block.transitions)


def cat_drafts(drafts: list[Draft], block_size: int, top_k: int) -> Draft:
    """Blocks of several drafts [M_i, B, k] as one [sum M_i, B, k] (none: zero blocks)."""
    if not drafts:
        return Draft(torch.zeros(0, block_size, top_k),
                     torch.zeros(0, block_size, top_k, dtype=torch.long))
    moves = None
    if drafts[0].transitions is not None:
        moves = tuple(torch.cat([d.transitions[i] for d in drafts]) for i in range(2))
    return Draft(torch.cat([d.logp for d in drafts]), torch.cat([d.ids for d in drafts]), moves)


def walk_first(logp: torch.Tensor, ids: torch.Tensor, walk: torch.Tensor,
               walk_logp: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k lists [..., k] (logp, ids) led by the walk's token [...] (its log-prob
    walk_logp), then the other ids in their order, cut to top_k."""
    other = ids != walk[..., None]
    order = torch.argsort((~other).long(), dim=-1, stable=True)  # the walk's id moves last
    rest = top_k - 1
    ids = torch.cat([walk[..., None], ids.gather(-1, order)[..., :rest]], dim=-1)
    logp = torch.cat([walk_logp[..., None], logp.gather(-1, order)[..., :rest]], dim=-1)
    return logp, ids


def select_rows(cache: ContextCache, rows: torch.Tensor) -> ContextCache:
    """The cache of a subset of its sequences (rows index the batch axis)."""
    if rows.numel() == cache.keys[0].shape[0]:
        return cache
    rows = rows.to(cache.keys[0].device)
    return ContextCache(keys=[k.index_select(0, rows) for k in cache.keys],
                        values=[v.index_select(0, rows) for v in cache.values],
                        length=cache.length)
