"""Draft blocks at any anchors of many sequences at once, over a context cache built once.

The drafter's own `forward` re-projects the whole context on every call and its live
`draft_block` anchors every row at the cache's end. Replay needs neither: it drafts blocks
at different anchors in different sequences, step after step over the same context. So the
context keys/values of every sequence are computed once (`DFlashDrafter.extend_context`)
and each step runs only the block queries, under the drafter's own mask rule
(dflash_train.drafter.masks: a block at a sees context < a and itself). Offline replay and the
online loop both draft through `BlockDrafter.draft`, so they share one numerical path; a
test proves it equals `DFlashDrafter.forward` and `draft_block`.

This module never reads the store, never computes labels or metrics.
"""

import torch
import torch.nn.functional as F

from dflash_train.blocks import draft_topk
from dflash_train.drafter import (
    BlockLayout,
    ContextCache,
    DFlashDrafter,
    build_block_ids,
    dense_attend,
)


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

        Mirrors DFlashDrafter.draft_block with one anchor per block instead of the cache end.
        """
        m, cfg, b = self.model, self.config, self.block_size
        anchors = anchors.to(self.device).long()
        n, k = anchors.shape
        lengths = anchors.max(dim=1).values  # keys at >= a are masked by the rule anyway
        layout = BlockLayout.build(anchors, lengths, cache.length, b)
        ids = build_block_ids(anchor_tokens.to(self.device).long(), cfg.mask_token_id, b)
        rope = m._rope(layout.query_positions(), m.fc.weight.dtype)
        x = m._embed(ids).flatten(1, 2)  # [N, K*B, H]
        attends = {}
        for i, layer in enumerate(m.layers):
            rule = (cfg.layer_is_causal(i), cfg.layer_window(i))
            if rule not in attends:
                attends[rule] = dense_attend(layout, *rule)
            x = layer(x, (cache.keys[i], cache.values[i]), rope, attends[rule])
        return m.norm(x).view(n, k, b, -1)

    @torch.no_grad()
    def draft(
        self, cache: ContextCache, anchors: torch.Tensor, anchor_tokens: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot fp32 log-prob top-k (logprobs, ids), both [N, K, B, k'] on the CPU.

        Slot 0 (the anchor) is never drafted: its entries are 0 / id -1.
        """
        hidden = self.hidden(cache, anchors, anchor_tokens)
        logp, ids = draft_topk(hidden[:, :, 1:], self.model.target_lm_head, top_k)
        pad = (0, 0, 1, 0)  # one slot in front along the slot axis
        return F.pad(logp, pad).cpu(), F.pad(ids, pad, value=-1).cpu()


def select_rows(cache: ContextCache, rows: torch.Tensor) -> ContextCache:
    """The cache of a subset of its sequences (rows index the batch axis)."""
    if rows.numel() == cache.keys[0].shape[0]:
        return cache
    rows = rows.to(cache.keys[0].device)
    return ContextCache(keys=[k.index_select(0, rows) for k in cache.keys],
                        values=[v.index_select(0, rows) for v in cache.values],
                        length=cache.length)
