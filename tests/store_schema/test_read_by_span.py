"""read_by_span / sample_spans: the span-then-sample fallback train and eval share when they
read a part (store_schema/integrity.py)."""

from dflash_train.store_schema.integrity import read_by_span
from dflash_train.store_schema.part import sample_spans


def test_spans_hold_at_least_the_span_tokens_and_cover_every_sample_once():
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    spans = sample_spans(lengths, 6)
    assert spans == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert all(sum(lengths[a:b]) >= 6 for a, b in spans[:-1])
    assert sample_spans([], 6) == []


def test_a_failing_span_is_read_sample_by_sample_and_only_the_damaged_one_is_named():
    bad, span_reads, one_reads = {4}, [], []

    def read_span(a, b):
        span_reads.append((a, b))
        if any(s in bad for s in range(a, b)):
            raise ValueError("crc32c mismatch")
        return [f"s{s}" for s in range(a, b)]

    def read_one(s):
        one_reads.append(s)
        if s in bad:
            raise ValueError("crc32c mismatch")
        return f"s{s}"

    out = list(read_by_span("mem://x", 7, [(0, 3), (3, 6), (6, 8)], read_span, read_one))
    assert [(s, v) for s, v, d in out if d is None] == [
        (0, "s0"), (1, "s1"), (2, "s2"), (3, "s3"), (5, "s5"), (6, "s6"), (7, "s7")]
    (damaged,) = [d for _, _, d in out if d is not None]
    assert (damaged.store, damaged.part, damaged.sample) == ("mem://x", 7, 4)
    assert "ValueError: crc32c mismatch" in damaged.reason
    assert span_reads == [(0, 3), (3, 6), (6, 8)] and one_reads == [3, 4, 5]


def test_spans_are_read_only_as_the_caller_reaches_them():
    reads = []
    out = read_by_span("mem://x", 0, [(0, 2), (2, 4)],
                       lambda a, b: reads.append((a, b)) or list(range(a, b)), lambda s: s)
    assert next(out) == (0, 0, None) and reads == [(0, 2)]
