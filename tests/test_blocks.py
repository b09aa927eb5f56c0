"""Block geometry: anchors, positions, labels, replay order."""

import pytest
import torch

from dflash_train.blocks import (
    BLOCK_SIZE,
    IGNORE_LABEL,
    BlockError,
    anchor_generator,
    block_input_ids,
    block_label_mask,
    block_labels,
    block_position_ids,
    draft_topk,
    eligible_anchors,
    first_anchor,
    next_anchor,
    replay_anchors,
    sample_anchors,
    valid_anchor_mask,
    verifier_rows,
)


def _random_mask(length: int, gen: torch.Generator, p: float = 0.7) -> torch.Tensor:
    return torch.rand(length, generator=gen) < p


def _naive_valid_anchors(mask: list[bool]) -> list[int]:
    n = len(mask)
    return [a for a in range(n) if a >= 1 and a + 1 < n and mask[a] and mask[a + 1]]


def test_valid_anchors_need_context_and_two_assistant_tokens():
    gen = torch.Generator().manual_seed(0)
    for length in [0, 1, 2, 3, 5, 17, 64]:
        mask = _random_mask(length, gen)
        expect = _naive_valid_anchors(mask.tolist())
        assert eligible_anchors(mask).tolist() == expect
        assert valid_anchor_mask(mask).nonzero().flatten().tolist() == expect


def test_position_zero_never_anchors_even_when_trained():
    mask = torch.ones(8, dtype=torch.bool)
    assert 0 not in eligible_anchors(mask).tolist()
    assert eligible_anchors(mask).tolist() == list(range(1, 7))


def test_sample_anchors_is_a_sorted_subset_without_replacement():
    gen = torch.Generator().manual_seed(1)
    mask = _random_mask(300, gen)
    valid = set(_naive_valid_anchors(mask.tolist()))
    for cap in [0, 1, 7, 50, 10_000]:
        got = sample_anchors(mask, cap, torch.Generator().manual_seed(cap)).tolist()
        assert len(got) == min(cap, len(valid))
        assert len(set(got)) == len(got)
        assert set(got) <= valid
        assert got == sorted(got)


def test_sample_anchors_is_uniform_over_valid_positions():
    mask = torch.tensor([False] + [True] * 21)  # valid anchors 1..20
    counts = torch.zeros(22)
    draws = 4000
    gen = torch.Generator().manual_seed(2)
    for _ in range(draws):
        counts[sample_anchors(mask, 5, gen)] += 1
    expected = draws * 5 / 20  # 1000 each; binomial sd ~ 27
    assert counts[0] == 0 and counts[21] == 0
    assert (counts[1:21] - expected).abs().max() < 150


def test_anchor_generator_reproduces_per_epoch_and_sample_and_differs_across_them():
    mask = torch.ones(400, dtype=torch.bool)

    def draw(seed, epoch, sample):
        return sample_anchors(mask, 32, anchor_generator(seed, epoch, sample)).tolist()

    assert draw(0, 3, 7) == draw(0, 3, 7)
    assert draw(0, 3, 7) != draw(0, 4, 7)
    assert draw(0, 3, 7) != draw(0, 3, 8)
    assert draw(0, 3, 7) != draw(1, 3, 7)


def test_block_positions_start_at_the_anchor_not_after_it():
    anchors = torch.tensor([1, 5, 40])
    pos = block_position_ids(anchors)
    assert pos.shape == (3, BLOCK_SIZE)
    for n, a in enumerate(anchors.tolist()):
        assert pos[n].tolist() == list(range(a, a + BLOCK_SIZE))


def test_block_input_is_anchor_token_then_masks():
    input_ids = torch.arange(100, 130)
    ids = block_input_ids(input_ids, torch.tensor([3, 10]), mask_token_id=7, block_size=4)
    assert ids.tolist() == [[103, 7, 7, 7], [110, 7, 7, 7]]


def test_hand_computed_block_labels():
    # positions:       0      1      2     3     4     5
    mask = torch.tensor([False, False, True, True, True, False])
    argmax = torch.tensor([50, 51, 52, 53, 54, 55])
    topk = torch.stack([argmax, argmax + 1000], dim=1)  # [L, 2], argmax first
    labels, valid = block_labels(topk, mask, torch.tensor([2]), block_size=5)
    # slot 1 -> position 3 (label = argmax at 2), slot 2 -> position 4 (argmax at 3);
    # slot 3 -> position 5 is a prompt token, slot 4 -> position 6 is past the end.
    assert valid.tolist() == [[False, True, True, False, False]]
    assert labels.tolist() == [[IGNORE_LABEL, 52, 53, IGNORE_LABEL, IGNORE_LABEL]]


def _naive_block_labels(argmax, mask, anchors, block):
    labels, valid = [], []
    for a in anchors:
        row_l, row_v = [], []
        for k in range(block):
            ok = k >= 1 and a + k < len(mask) and mask[a + k]
            row_v.append(ok)
            row_l.append(argmax[a + k - 1] if ok else IGNORE_LABEL)
        labels.append(row_l)
        valid.append(row_v)
    return labels, valid


def test_block_labels_match_a_naive_loop_on_random_samples():
    gen = torch.Generator().manual_seed(3)
    for length in [2, 3, 10, 33, 100]:
        mask = _random_mask(length, gen)
        topk = torch.randint(0, 1000, (length, 4), generator=gen)
        anchors = torch.randint(1, length, (9,), generator=gen)
        labels, valid = block_labels(topk, mask, anchors)
        exp_l, exp_v = _naive_block_labels(
            topk[:, 0].tolist(), mask.tolist(), anchors.tolist(), BLOCK_SIZE
        )
        assert labels.tolist() == exp_l
        assert valid.tolist() == exp_v
        assert torch.equal(block_label_mask(mask, anchors), valid)


def test_labels_are_the_verifier_argmax_not_the_stored_text():
    length = 40
    input_ids = torch.arange(length)  # stored text
    topk = torch.stack([torch.arange(length) + 500, torch.arange(length) + 900], 1)
    mask = torch.ones(length, dtype=torch.bool)
    labels, valid = block_labels(topk, mask, torch.tensor([4]))
    slot_labels = labels[0, 1:][valid[0, 1:]]
    assert torch.equal(slot_labels, torch.arange(4, 4 + BLOCK_SIZE - 1) + 500)
    assert not set(slot_labels.tolist()) & set(input_ids.tolist())


def test_block_labels_refuse_one_dimensional_ids():
    with pytest.raises(BlockError, match="verifier_topk_ids"):
        block_labels(torch.arange(10), torch.ones(10, dtype=torch.bool), torch.tensor([2]))


def test_anchors_outside_the_sample_are_refused():
    mask = torch.ones(10, dtype=torch.bool)
    topk = torch.zeros(10, 2, dtype=torch.long)
    for bad in [0, 10, -1]:
        with pytest.raises(BlockError, match="anchors"):
            block_labels(topk, mask, torch.tensor([3, bad]))


def test_verifier_rows_line_up_with_labels():
    gen = torch.Generator().manual_seed(4)
    length = 50
    mask = _random_mask(length, gen)
    topk = torch.randint(0, 1000, (length, 3), generator=gen)
    lse = torch.randn(length, generator=gen)
    anchors = torch.tensor([1, 20, 45, 49])
    labels, valid = block_labels(topk, mask, anchors)
    rows = verifier_rows(topk, anchors)  # [N, B, 3]
    assert torch.equal(rows[..., 0][valid], labels[valid])
    lse_rows = verifier_rows(lse, anchors)
    for n, a in enumerate(anchors.tolist()):
        for k in range(1, BLOCK_SIZE):
            if a + k < length:
                assert lse_rows[n, k] == lse[a + k - 1]


def test_draft_topk_matches_full_log_softmax_in_any_chunking():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, BLOCK_SIZE, 8, generator=gen)
    weight = torch.randn(37, 8, generator=gen)
    full = torch.log_softmax(hidden @ weight.T, dim=-1).topk(5, dim=-1)
    for chunk in [1, 7, 1000]:
        values, ids = draft_topk(hidden, weight, 5, chunk_rows=chunk)
        assert values.shape == ids.shape == (3, BLOCK_SIZE, 5)
        assert values.dtype == torch.float32
        torch.testing.assert_close(values, full.values)
        assert torch.equal(ids, full.indices)
    values, ids = draft_topk(hidden, weight, 500)
    assert ids.shape[-1] == 37  # k capped at the vocab


def test_first_anchor_is_the_first_response_token_with_context():
    assert first_anchor(torch.tensor([False, False, True, True])) == 2
    assert first_anchor(torch.tensor([True, True, True])) == 1
    assert first_anchor(torch.tensor([False, False])) is None
    assert first_anchor(torch.tensor([False, True, False, True]), after=1) == 3


def test_next_anchor_is_the_bonus_position():
    assert next_anchor(10, 1) == 11
    assert next_anchor(10, 16) == 26
    with pytest.raises(BlockError):
        next_anchor(10, 0)


def _naive_replay(mask: list[bool], tau_at) -> list[int]:
    """Independent restatement: decode each assistant segment like a live turn."""
    out = []
    n = len(mask)
    segments, p = [], 0
    while p < n:
        if mask[p]:
            q = p
            while q < n and mask[q]:
                q += 1
            segments.append((max(p, 1), q))  # tokens p..q-1; anchors need context
            p = q
        else:
            p += 1
    for start, end in segments:
        a = start
        while a + 1 < end:  # the anchor must have a next assistant token to predict
            out.append(a)
            a += tau_at(a)
    return out


def test_replay_visits_anchors_like_live_decoding_across_turns():
    gen = torch.Generator().manual_seed(6)
    for trial in range(30):
        length = int(torch.randint(2, 120, (1,), generator=gen))
        mask = _random_mask(length, gen, p=0.8)
        taus = torch.randint(1, BLOCK_SIZE + 1, (length,), generator=gen).tolist()

        def tau_at(a, taus=taus, mask=mask):
            # a real tau never runs past the labels: cap at the segment's remaining tokens
            end = a
            while end + 1 < len(mask) and mask[end + 1]:
                end += 1
            return min(taus[a], end - a + 1)

        assert list(replay_anchors(mask, tau_at)) == _naive_replay(mask.tolist(), tau_at), trial


def test_replay_hand_example_two_turns():
    #            0  1  2  3  4  5  6  7  8  9
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 1, 1]).bool()
    taus = {2: 2, 4: 3, 8: 5}
    calls = []

    def tau_at(a):
        calls.append(a)
        return taus[a]

    # turn 1: anchor 2 (tau 2) -> 4 (tau 3) -> 7 is a prompt token: turn over;
    # turn 2 starts at 8 (tau 5) -> 13 is past the end.
    assert list(replay_anchors(mask, tau_at)) == [2, 4, 8]
    assert calls == [2, 4, 8]
