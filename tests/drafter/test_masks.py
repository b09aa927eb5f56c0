"""Block positions and the attention masks, checked against the rules written out longhand."""

import itertools

import pytest
import torch

from dflash_train.blocks import block_position_ids
from dflash_train.drafter import BlockLayout, dense_mask, flex_block_mask
from dflash_train.drafter.masks import context_mask, context_span, own_block_mask

B = 4
RULES = list(itertools.product([False, True], [None, 3, 6]))  # (causal, window)


def _layout(seed: int) -> BlockLayout:
    gen = torch.Generator().manual_seed(seed)
    t, k = 10, 3
    lengths = torch.tensor([10, 7])
    anchors = torch.stack([torch.randperm(int(n) + 1, generator=gen)[:k] for n in lengths])
    return BlockLayout.build(anchors, lengths, t, B)


def _expected_mask(layout: BlockLayout, causal: bool, window: int | None) -> torch.Tensor:
    """The visibility rule, one (query, key) pair at a time."""
    n, k = layout.anchors.shape
    t = layout.context_len
    out = torch.zeros(n, k * B, t + k * B, dtype=torch.bool)
    for s, blk, slot in itertools.product(range(n), range(k), range(B)):
        a = int(layout.anchors[s, blk])
        q_pos = a + slot
        for j in range(t):  # context keys: strictly before the anchor, inside the valid length
            ok = j < a and j < int(layout.context_lengths[s])
            if window is not None:
                ok = ok and q_pos - j < window
            out[s, blk * B + slot, j] = ok
        for other in range(B):  # own block only; other blocks never
            k_pos = a + other
            ok = not causal or other <= slot
            if window is not None:
                ok = ok and abs(q_pos - k_pos) < window
            out[s, blk * B + slot, t + blk * B + other] = ok
    return out


def test_block_positions_are_anchor_to_anchor_plus_b_minus_1():
    anchors = torch.tensor([[0, 7, 31], [5, 2, 100]])
    got = block_position_ids(anchors, 16)
    for s, blk in itertools.product(range(2), range(3)):
        a = int(anchors[s, blk])
        assert got[s, blk].tolist() == list(range(a, a + 16))


def test_layout_query_and_key_positions_follow_the_key_order():
    layout = BlockLayout.build(torch.tensor([[3, 8]]), torch.tensor([10]), 10, B)
    assert layout.query_positions().tolist() == [[3, 4, 5, 6, 8, 9, 10, 11]]
    assert layout.key_positions().tolist() == [list(range(10)) + [3, 4, 5, 6, 8, 9, 10, 11]]


@pytest.mark.parametrize("causal, window", RULES)
def test_dense_mask_matches_the_rule_written_out(causal, window):
    for seed in range(3):
        layout = _layout(seed)
        got = dense_mask(layout, causal, window)
        assert got.shape == (2, 1, 3 * B, 10 + 3 * B)
        assert torch.equal(got[:, 0], _expected_mask(layout, causal, window))


@pytest.mark.parametrize("causal, window", RULES)
def test_flex_mask_mod_matches_dense_mask(causal, window):
    layout = _layout(seed=1)
    block_mask = flex_block_mask(layout, causal, window)
    n, q, kv = 2, layout.num_queries, layout.num_keys
    got = block_mask.mask_mod(
        torch.arange(n)[:, None, None], torch.zeros(()), torch.arange(q)[None, :, None],
        torch.arange(kv)[None, None, :],
    )
    assert torch.equal(got, dense_mask(layout, causal, window)[:, 0])


def test_block_never_sees_its_anchor_position_but_sees_the_one_before():
    layout = BlockLayout.build(torch.tensor([[5, 9]]), torch.tensor([12]), 12, B)
    mask = dense_mask(layout, causal=False, window=None)[0, 0]
    for blk, a in enumerate((5, 9)):
        rows = mask[blk * B:(blk + 1) * B]
        assert not rows[:, a:12].any(), "context at or after the anchor leaked"
        assert rows[:, :a].all(), "context before the anchor hidden"


def test_every_query_sees_at_least_itself():
    # A fully masked row would make softmax NaN; the block's own slot is always visible.
    for causal, window in RULES:
        layout = BlockLayout.build(torch.tensor([[0, 0]]), torch.tensor([0]), 3, B)
        mask = dense_mask(layout, causal, window)[0, 0]
        assert mask[torch.arange(2 * B), 3 + torch.arange(2 * B)].all()


def _tiles(mask: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, Q/tile, KV/tile] (any visible, all visible) per tile of a dense [N, Q, KV] mask."""
    n, q, kv = mask.shape
    padded = torch.zeros(n, -(-q // tile) * tile, -(-kv // tile) * tile, dtype=torch.int32)
    padded[:, :q, :kv] = mask
    counts = padded.unflatten(1, (-1, tile)).unflatten(3, (-1, tile)).sum((2, 4))
    return counts > 0, counts == tile * tile


@pytest.mark.parametrize("compiled", [False, True])
def test_flex_block_mask_skips_and_fuses_the_right_tiles(compiled):
    # Long enough that queries and keys span several 128-tiles, some fully visible.
    gen = torch.Generator().manual_seed(3)
    t, k, b = 300, 20, 16
    lengths = torch.tensor([300, 170])
    anchors = torch.stack([torch.randperm(int(n) + 1, generator=gen)[:k] for n in lengths])
    # late anchors first, so the first query tile sees whole context tiles
    layout = BlockLayout.build(anchors.sort(dim=1, descending=True).values, lengths, t, b)
    dense = dense_mask(layout, causal=False, window=None)[:, 0]
    any_visible, all_visible = _tiles(dense, 128)
    assert all_visible.any() and (any_visible & ~all_visible).any() and not any_visible.all()
    block_mask = flex_block_mask(layout, causal=False, window=None, compiled=compiled)
    partial, full = torch.zeros_like(any_visible), torch.zeros_like(any_visible)
    for s, qt in itertools.product(range(2), range(any_visible.shape[1])):
        for num, idx, out in ((block_mask.kv_num_blocks, block_mask.kv_indices, partial),
                              (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, full)):
            out[s, qt, idx[s, 0, qt, :num[s, 0, qt]]] = True
    assert torch.equal(full, all_visible)
    assert torch.equal(partial, any_visible & ~all_visible)


def _split_as_dense(layout: BlockLayout, causal: bool, window: int | None) -> torch.Tensor:
    """The split masks scattered back to the dense [N, K*B, T + K*B] key order."""
    n, k = layout.anchors.shape
    t = layout.context_len
    start, stop = context_span(layout, window)
    out = torch.zeros(n, k * B, t + k * B, dtype=torch.bool)
    out[:, :, start:stop] = context_mask(layout, causal, window, (start, stop)).flatten(1, 2)
    own = own_block_mask(layout, causal, window)  # [N, K, B, B]
    for blk in range(k):
        out[:, blk * B:(blk + 1) * B, t + blk * B:t + (blk + 1) * B] = own[:, blk]
    return out


@pytest.mark.parametrize("causal, window", RULES)
def test_split_masks_are_the_dense_mask_without_its_always_hidden_keys(causal, window):
    for seed in range(3):
        layout = _layout(seed)
        assert torch.equal(_split_as_dense(layout, causal, window),
                           dense_mask(layout, causal, window)[:, 0])


@pytest.mark.parametrize("window", [None, 3, 6])
def test_context_span_covers_every_context_key_any_query_sees(window):
    for seed in range(3):
        layout = _layout(seed)
        start, stop = context_span(layout, window)
        seen = dense_mask(layout, False, window)[:, 0, :, :layout.context_len].any(1).any(0)
        visible = seen.nonzero().flatten()
        assert not seen[:start].any() and not seen[stop:].any()
        # it ends right after the last key seen; a window may start it before the first one
        assert visible.numel() == 0 or (start <= int(visible[0]) and stop == int(visible[-1]) + 1)


def test_context_span_is_empty_when_every_block_is_anchored_at_0():
    layout = BlockLayout.build(torch.tensor([[0, 0]]), torch.tensor([5]), 5, B)
    assert context_span(layout, None) == (0, 0)
    assert context_mask(layout, False, None, (0, 0)).shape == (1, 2, B, 0)
