"""padded_batches: the grouping rule extract, train and eval share (dflash_train/batching.py)."""

from dflash_train.batching import padded_batches


def _batches(lengths: list[int], budget: int) -> list[list[int]]:
    return [[lengths[i] for i in b]
            for b in padded_batches(range(len(lengths)), lengths.__getitem__, budget)]


def test_each_batch_fits_count_times_longest_in_the_budget():
    lengths = [3, 5, 2, 8, 1, 1, 7, 4, 4, 6]
    for budget in range(8, 40):
        batches = _batches(lengths, budget)
        assert [n for b in batches for n in b] == lengths  # consecutive, nothing lost
        assert all(len(b) * max(b) <= budget for b in batches)


def test_a_batch_closes_only_when_the_next_item_would_not_fit():
    assert _batches([4, 4, 4, 2], 12) == [[4, 4, 4], [2]]
    assert _batches([2, 2, 5], 10) == [[2, 2], [5]]  # 3 x 5 > 10: the longer item moves on
    assert _batches([5, 2, 2], 10) == [[5, 2], [2]]


def test_an_item_longer_than_the_budget_gets_a_batch_of_its_own():
    assert _batches([2, 50, 2], 10) == [[2], [50], [2]]


def test_a_stream_is_consumed_lazily():
    seen = []

    def stream():
        for n in [3, 3, 3, 3]:
            seen.append(n)
            yield n

    first = next(padded_batches(stream(), int, 6))
    assert first == [3, 3] and len(seen) == 3  # the third item closed the first batch


def test_nothing_in_nothing_out():
    assert _batches([], 10) == []
