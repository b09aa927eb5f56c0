"""Acceptance metrics against hand-computed blocks and a naive per-block restatement."""

import math
import statistics

import pytest
import torch

from dflash_train.blocks import IGNORE_LABEL, BlockError
from dflash_train.evaluate.metrics import (
    AcceptanceStats,
    PositionBins,
    TauHistogram,
    acceptance_lengths,
    agreement_counts,
    streak_lengths,
)

B = 5  # small blocks keep hand examples readable


def _t(rows):
    return torch.tensor(rows)


def test_hand_computed_streaks():
    labels = _t([[IGNORE_LABEL, 1, 2, 3, 4]] * 5)
    valid = _t([[False, True, True, True, True]] * 5)
    draft = _t(
        [
            [9, 1, 2, 3, 4],  # all match; slot 0 is never compared -> 4
            [0, 1, 2, 7, 4],  # mismatch at slot 3 -> 2, later match does not count
            [0, 8, 2, 3, 4],  # mismatch at slot 1 -> 0
            [0, 1, 2, 3, 9],  # -> 3
            [0, 1, 9, 9, 9],  # -> 1
        ]
    )
    assert streak_lengths(draft, labels, valid).tolist() == [4, 2, 0, 3, 1]
    assert acceptance_lengths(draft, labels, valid).tolist() == [5, 3, 1, 4, 2]


def test_an_invalid_label_ends_the_streak_even_if_the_draft_matches():
    labels = _t([[IGNORE_LABEL, 1, 2, IGNORE_LABEL, IGNORE_LABEL]])
    valid = _t([[False, True, True, False, False]])
    draft = _t([[0, 1, 2, IGNORE_LABEL, IGNORE_LABEL]])  # equal values past the end
    assert streak_lengths(draft, labels, valid).tolist() == [2]


def _random_blocks(seed: int, n: int, block: int = B, k: int = 4, vocab: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, block, k), generator=gen)
    labels = torch.randint(0, vocab, (n, block), generator=gen)
    valid = torch.rand(n, block, generator=gen) < 0.9
    valid[:, 0] = False
    labels[~valid] = IGNORE_LABEL
    return ids, labels, valid


def _naive_streak(draft, labels, valid):
    s = 0
    for k in range(1, len(labels)):
        if not valid[k] or draft[k] != labels[k]:
            break
        s += 1
    return s


def test_streaks_match_a_naive_loop():
    ids, labels, valid = _random_blocks(0, 300)
    got = streak_lengths(ids[..., 0], labels, valid).tolist()
    for n in range(300):
        assert got[n] == _naive_streak(ids[n, :, 0].tolist(), labels[n].tolist(), valid[n].tolist())


def _naive_summary(ids, labels, valid, recall_at):
    n, block, _ = ids.shape
    streaks = [
        _naive_streak(ids[i, :, 0].tolist(), labels[i].tolist(), valid[i].tolist())
        for i in range(n)
    ]
    taus = [s + 1 for s in streaks]
    out = {"taus": taus, "cond": [], "acc": [], "recall": {r: [] for r in recall_at}}
    for k in range(1, block):
        reached = [i for i in range(n) if streaks[i] >= k - 1 and valid[i, k]]
        accepted = [i for i in reached if ids[i, k, 0] == labels[i, k]]
        out["cond"].append(len(accepted) / len(reached) if reached else None)
        vs = [i for i in range(n) if valid[i, k]]
        correct = [i for i in vs if ids[i, k, 0] == labels[i, k]]
        out["acc"].append(len(correct) / len(vs) if vs else None)
        for r in recall_at:
            hit = [i for i in vs if labels[i, k] in ids[i, k, :r].tolist()]
            out["recall"][r].append(len(hit) / len(vs) if vs else None)
    return out


def _close_lists(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None and y is None) or x == pytest.approx(y)


def test_streaming_summary_matches_a_naive_computation():
    ids, labels, valid = _random_blocks(1, 257)
    stats = AcceptanceStats(block_size=B, recall_at=(1, 2, 4))
    for start in range(0, 257, 50):  # uneven batches
        stats.update(ids[start : start + 50], labels[start : start + 50], valid[start : start + 50])
    got = stats.summary()
    exp = _naive_summary(ids, labels, valid, (1, 2, 4))

    assert got["n_blocks"] == 257
    assert got["mean_tau"] == pytest.approx(statistics.fmean(exp["taus"]))
    assert got["mean_streak"] == pytest.approx(statistics.fmean(exp["taus"]) - 1)
    half = 1.959963984540054 * statistics.stdev(exp["taus"]) / math.sqrt(257)
    assert got["tau_ci95"] == pytest.approx([got["mean_tau"] - half, got["mean_tau"] + half])
    assert got["streak_hist"] == [sum(t == s + 1 for t in exp["taus"]) for s in range(B)]
    _close_lists(got["cond_accept"], exp["cond"])
    _close_lists(got["slot_accuracy"], exp["acc"])
    for r in (1, 2, 4):
        _close_lists(got["topk_recall"][str(r)], exp["recall"][r])
    assert got["topk_recall"]["1"] == got["slot_accuracy"]


def test_hand_computed_summary():
    labels = _t([[IGNORE_LABEL, 1, 2, 3, 4], [IGNORE_LABEL, 1, 2, 3, IGNORE_LABEL]])
    valid = labels != IGNORE_LABEL
    draft = _t([[0, 1, 5, 3, 4], [0, 1, 2, 3, 0]])
    stats = AcceptanceStats(block_size=B, recall_at=(1,))
    taus = stats.update(draft, labels, valid)
    s = stats.summary()
    assert taus.tolist() == [2, 4]
    assert s["mean_tau"] == 3.0
    assert s["streak_hist"] == [0, 1, 0, 1, 0]
    # slot 1: both reached, both accepted; slot 2: both reached, one accepted;
    # slot 3: only block 2 reached (accepted); slot 4: block 2 has no label, block 1 not reached
    assert s["cond_accept"] == [1.0, 0.5, 1.0, None]
    assert s["slot_accuracy"] == [1.0, 0.5, 1.0, 1.0]
    assert s["slot_valid"] == [2, 2, 2, 1]


def test_a_block_the_text_ends_in_commits_no_bonus():
    # Block 1: the text ends after slot 3 (3 tokens left) and all 3 drafts match: 3 tokens
    # committed, nothing after them to be the bonus -> tau 3 (not streak + 1 = 4).
    # Block 2: 4 tokens left, streak 1 (slot 2 wrong): the target's token at slot 2 is the
    # bonus -> tau 2. Block 3: whole block accepted, a token after it -> tau 5.
    labels = _t([[IGNORE_LABEL, 1, 2, 3, IGNORE_LABEL], [IGNORE_LABEL, 1, 2, 3, 4],
                 [IGNORE_LABEL, 1, 2, 3, 4]])
    valid = labels != IGNORE_LABEL
    draft = _t([[0, 1, 2, 3, 4], [0, 1, 9, 3, 4], [0, 1, 2, 3, 4]])
    left = _t([3, 4, 5])
    assert acceptance_lengths(draft, labels, valid, left).tolist() == [3, 2, 5]
    assert acceptance_lengths(draft, labels, valid).tolist() == [4, 2, 5]  # text goes on
    stats = AcceptanceStats(block_size=B, recall_at=(1,))
    assert stats.update(draft, labels, valid, left).tolist() == [3, 2, 5]
    s = stats.summary()
    assert s["mean_tau"] == pytest.approx(10 / 3)  # tokens committed per block
    assert s["mean_streak"] == pytest.approx(8 / 3)  # accepted drafts 3, 1, 4
    assert s["streak_hist"] == [0, 1, 0, 1, 1]
    # Per slot, acceptance is of the drafts alone, with or without a bonus after them.
    assert s["cond_accept"] == [1.0, 2 / 3, 1.0, 1.0]


def test_merged_accumulators_equal_one_accumulator():
    ids, labels, valid = _random_blocks(2, 120)
    left = torch.randint(1, B + 1, (120,), generator=torch.Generator().manual_seed(4))
    whole = AcceptanceStats(block_size=B, recall_at=(1, 3))
    whole.update(ids, labels, valid, left)
    a = AcceptanceStats(block_size=B, recall_at=(1, 3))
    b = AcceptanceStats(block_size=B, recall_at=(1, 3))
    a.update(ids[:70], labels[:70], valid[:70], left[:70])
    b.update(ids[70:], labels[70:], valid[70:], left[70:])
    a.merge(b)
    assert a.summary() == whole.summary()


def test_too_few_draft_ids_for_the_requested_recall_are_refused():
    ids, labels, valid = _random_blocks(3, 4, k=2)
    with pytest.raises(BlockError, match="recall"):
        AcceptanceStats(block_size=B, recall_at=(1, 4)).update(ids, labels, valid)


def test_tau_histogram_mean_ci_and_bounds():
    hist = TauHistogram(max_tau=4)
    assert hist.summary()["mean_tau"] is None
    hist.update(torch.tensor([3]))
    assert hist.summary()["tau_ci95"] is None  # one sample has no spread estimate
    hist.update(torch.tensor([1, 4, 4]))
    s = hist.summary()
    assert s["n"] == 4 and s["mean_tau"] == 3.0 and s["tau_hist"] == [1, 0, 1, 2]
    half = 1.959963984540054 * statistics.stdev([3, 1, 4, 4]) / 2
    assert s["tau_ci95"] == pytest.approx([3.0 - half, 3.0 + half])
    with pytest.raises(BlockError):
        hist.update(torch.tensor([0]))
    with pytest.raises(BlockError):
        hist.update(torch.tensor([5]))


def test_position_bins_group_blocks_by_anchor_floor_divided_by_the_width():
    bins = PositionBins(width=10, max_tau=4)
    # anchors 0 and 9 share bin 0, 10 opens bin 1, nothing lands in 20..29, 35 is bin 3
    bins.update(_t([9, 0, 10, 35, 12, 19]), _t([1, 3, 4, 2, 2, 3]))
    s = bins.summary()
    assert s["bin_tokens"] == 10
    assert [b["start"] for b in s["bins"]] == [0, 10, 30]  # only bins holding blocks
    assert [b["n_blocks"] for b in s["bins"]] == [2, 3, 1]
    assert [b["mean_tau"] for b in s["bins"]] == [2.0, 3.0, 2.0]
    half = 1.959963984540054 * statistics.stdev([4, 2, 3]) / math.sqrt(3)
    assert s["bins"][1]["tau_ci95"] == pytest.approx([3.0 - half, 3.0 + half])
    assert s["bins"][2]["tau_ci95"] is None  # one block has no spread estimate


def test_position_bins_merged_from_any_split_equal_one_accumulator():
    gen = torch.Generator().manual_seed(5)
    anchors = torch.randint(0, 3000, (400,), generator=gen)
    taus = torch.randint(1, B + 1, (400,), generator=gen)
    whole = PositionBins(256, B)
    whole.update(anchors, taus)
    for cut in (0, 1, 173, 400):
        a, b = PositionBins(256, B), PositionBins(256, B)
        a.update(anchors[:cut], taus[:cut])
        b.update(anchors[cut:], taus[cut:])
        a.merge(b)
        assert a.summary() == whole.summary()
    assert len(whole.summary()["bins"]) == 12  # 0..2999 in bins of 256


def test_position_bins_refuse_bad_widths_anchors_and_merges():
    with pytest.raises(BlockError, match=">= 1 token"):
        PositionBins(0)
    bins = PositionBins(4, max_tau=4)
    with pytest.raises(BlockError, match="3 anchors for 2 taus"):
        bins.update(_t([1, 2, 3]), _t([1, 2]))
    with pytest.raises(BlockError, match=">= 0"):
        bins.update(_t([-1]), _t([1]))
    with pytest.raises(BlockError, match="tau must lie"):
        bins.update(_t([1, 9]), _t([1, 5]))
    assert bins.summary()["bins"] == []  # a refused batch counts nothing, in no bin
    with pytest.raises(BlockError, match="cannot merge"):
        bins.merge(PositionBins(8, max_tau=4))


def test_agreement_counts_compare_next_stored_token_with_verifier_argmax():
    input_ids = _t([10, 11, 12, 13, 14, 15])
    top1 = _t([11, 99, 13, 99, 15, 77])  # top1[t] predicts input_ids[t+1]
    mask = _t([False, False, True, True, True, True])
    # counted positions t = 1..4 (token t+1 is assistant): matches at t = 2, 4
    assert agreement_counts(input_ids, top1, mask) == (2, 4)
