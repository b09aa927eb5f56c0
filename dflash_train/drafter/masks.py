"""Who sees whom: block positions and the attention masks of the drafter forward.

The key sequence of one forward is `[context 0..T-1 | block_0 | ... | block_K-1]`; the
queries are the blocks only (context tokens are never queries). Block k is
`[anchor, MASK x (B-1)]` at positions a_k .. a_k+B-1 and sees:

- context positions j < a_k (and j < the sequence's valid length): strictly before its
  anchor, whose own target hidden state does not exist at serve time;
- its own block: every slot in a bidirectional layer, slots <= its own in a causal one;
- in a windowed (sliding) layer, only keys with |query pos - key pos| < window
  (query pos - key pos for causal layers), as z-lab and vLLM window them;
- never another block.

One predicate, `_visible`, states these rules; the dense mask (SDPA, the reference), the
split masks (context keys and own-block keys scored apart, CPU training) and the
flex-attention mask (CUDA training) all evaluate it, so they cannot drift apart. This
module never touches weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from dflash_train.blocks import block_position_ids
from dflash_train.drafter.errors import DrafterError


@dataclass
class BlockLayout:
    """Index bookkeeping of one forward: which query / key is which block, slot, position."""

    anchors: torch.Tensor
    """[N, K] int64: anchor position of every block."""
    context_lengths: torch.Tensor
    """[N] int64: valid context positions per sequence (the rest is padding)."""
    context_len: int
    """T: context positions in the key sequence (padded length)."""
    block_size: int
    """B: tokens per block."""

    @classmethod
    def build(
        cls, anchors: torch.Tensor, context_lengths: torch.Tensor, context_len: int,
        block_size: int,
    ) -> BlockLayout:
        if anchors.dim() != 2:
            raise DrafterError(f"anchors must be [batch, blocks], got shape {tuple(anchors.shape)}")
        if context_lengths.shape != anchors.shape[:1]:
            raise DrafterError(
                f"context_lengths shape {tuple(context_lengths.shape)} does not match "
                f"{anchors.shape[0]} sequences"
            )
        if anchors.numel() and int(anchors.min()) < 0:
            raise DrafterError(f"negative anchor {int(anchors.min())}")
        return cls(anchors.long(), context_lengths.long(), context_len, block_size)

    @property
    def num_queries(self) -> int:
        return self.anchors.shape[1] * self.block_size

    @property
    def num_keys(self) -> int:
        return self.context_len + self.num_queries

    def query_positions(self) -> torch.Tensor:
        """[N, K*B] absolute position of every query (block slot)."""
        return block_position_ids(self.anchors, self.block_size).flatten(1)

    def query_anchors(self) -> torch.Tensor:
        """[N, K*B] anchor of the block each query belongs to."""
        return self.anchors.repeat_interleave(self.block_size, dim=1)

    def key_positions(self) -> torch.Tensor:
        """[N, T + K*B] absolute position of every key: context j at j, then the blocks."""
        n = self.anchors.shape[0]
        ctx = torch.arange(self.context_len, device=self.anchors.device).expand(n, -1)
        return torch.cat([ctx, self.query_positions()], dim=1)


def _visible(
    q_block: torch.Tensor,
    q_pos: torch.Tensor,
    q_anchor: torch.Tensor,
    kv_is_ctx: torch.Tensor,
    kv_block: torch.Tensor,
    kv_pos: torch.Tensor,
    ctx_len: torch.Tensor,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """The visibility rule of the module docstring, elementwise over broadcast indices."""
    from_context = kv_is_ctx & (kv_pos < q_anchor) & (kv_pos < ctx_len)
    from_block = ~kv_is_ctx & (kv_block == q_block)
    if causal:
        from_block = from_block & (kv_pos <= q_pos)
    visible = from_context | from_block
    if window is not None:
        visible = visible & (q_pos - kv_pos < window)
        if not causal:
            visible = visible & (kv_pos - q_pos < window)
    return visible


def dense_mask(layout: BlockLayout, causal: bool, window: int | None) -> torch.Tensor:
    """[N, 1, K*B, T+K*B] bool mask for SDPA (True = may attend)."""
    device = layout.anchors.device
    t, b = layout.context_len, layout.block_size
    q_idx = torch.arange(layout.num_queries, device=device)
    kv_idx = torch.arange(layout.num_keys, device=device)
    visible = _visible(
        q_block=(q_idx // b)[None, :, None],
        q_pos=layout.query_positions()[:, :, None],
        q_anchor=layout.query_anchors()[:, :, None],
        kv_is_ctx=(kv_idx < t)[None, None, :],
        kv_block=((kv_idx - t) // b)[None, None, :],
        kv_pos=layout.key_positions()[:, None, :],
        ctx_len=layout.context_lengths[:, None, None],
        causal=causal,
        window=window,
    )
    return visible.unsqueeze(1)


def context_span(layout: BlockLayout, window: int | None) -> tuple[int, int]:
    """[start, stop): the context positions some query of `layout` may see. Every key
    outside is masked for every query, so a split forward scores only these (a host sync)."""
    if not layout.anchors.numel():
        return 0, 0
    seen = torch.minimum(layout.anchors, layout.context_lengths[:, None])
    stop = min(layout.context_len, int(seen.max()))
    start = 0 if window is None else max(0, int(layout.anchors.min()) - window + 1)
    return min(start, stop), stop


def context_mask(layout: BlockLayout, causal: bool, window: int | None,
                 span: tuple[int, int]) -> torch.Tensor:
    """[N, K, B, stop-start] bool: which context keys start..stop-1 each block slot sees."""
    n, k = layout.anchors.shape
    kv_pos = torch.arange(*span, device=layout.anchors.device)
    zero = torch.zeros((), dtype=torch.long, device=kv_pos.device)
    visible = _visible(
        q_block=zero,
        q_pos=layout.query_positions()[:, :, None],
        q_anchor=layout.query_anchors()[:, :, None],
        kv_is_ctx=torch.ones((), dtype=torch.bool, device=kv_pos.device),
        kv_block=zero,
        kv_pos=kv_pos[None, None, :],
        ctx_len=layout.context_lengths[:, None, None],
        causal=causal,
        window=window,
    )
    return visible.view(n, k, layout.block_size, span[1] - span[0])


def own_block_mask(layout: BlockLayout, causal: bool, window: int | None) -> torch.Tensor:
    """[N, K, B, B] bool: which slots of its own block each block slot sees."""
    positions = block_position_ids(layout.anchors, layout.block_size)  # [N, K, B]
    block = torch.zeros((), dtype=torch.long, device=positions.device)
    return _visible(
        q_block=block,
        q_pos=positions[..., :, None],
        q_anchor=layout.anchors[..., None, None],
        kv_is_ctx=torch.zeros((), dtype=torch.bool, device=positions.device),
        kv_block=block,
        kv_pos=positions[..., None, :],
        ctx_len=layout.context_lengths[:, None, None, None],
        causal=causal,
        window=window,
    ).expand(*positions.shape, positions.shape[-1])  # q_pos is unused by full layers


def flex_block_mask(layout: BlockLayout, causal: bool, window: int | None,
                    compiled: bool | None = None) -> BlockMask:
    """The same rule as `dense_mask`, as a flex-attention BlockMask.

    `compiled` builds it with torch.compile (default: on CUDA, where the eager build would
    materialise the full [Q, KV] mask).
    """
    device = layout.anchors.device
    t, b = layout.context_len, layout.block_size
    q_pos, q_anchor = layout.query_positions(), layout.query_anchors()
    kv_pos, ctx_len = layout.key_positions(), layout.context_lengths

    def mask_mod(batch, head, q_idx, kv_idx):
        return _visible(
            q_block=q_idx // b,
            q_pos=q_pos[batch, q_idx],
            q_anchor=q_anchor[batch, q_idx],
            kv_is_ctx=kv_idx < t,
            kv_block=(kv_idx - t) // b,
            kv_pos=kv_pos[batch, kv_idx],
            ctx_len=ctx_len[batch],
            causal=causal,
            window=window,
        )

    if compiled is None:
        compiled = device.type == "cuda"
    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(
        mask_mod,
        B=layout.anchors.shape[0],
        H=None,
        Q_LEN=layout.num_queries,
        KV_LEN=layout.num_keys,
        device=device,
    )


@functools.cache
def _compiled_create_block_mask():
    # What create_block_mask(_compile=True) did before torch deprecated that flag (2.13).
    return torch.compile(create_block_mask)
