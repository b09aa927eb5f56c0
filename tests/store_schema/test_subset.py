"""copy_store: a new store with exactly the kept samples, in their parts and rows, bit for bit."""

import torch

from dflash_train.store_schema import create_store, open_store, validate
from dflash_train.store_schema.subset import copy_store
from tests.store_schema.conftest import VOCAB, assert_same_sample, make_meta, random_sample


def _source(tmp_path, gen) -> tuple[str, list[list]]:
    store = create_store(str(tmp_path / "src.zarr"), make_meta(num_parts=2), shard_tokens=32)
    parts = [[random_sample(n, row, gen) for row, n in zip(range(0, 5), (20, 45, 7, 33, 12),
                                                          strict=True)],
             [random_sample(n, row, gen) for row, n in zip(range(5, 8), (50, 9, 30),
                                                          strict=True)]]
    for index, samples in enumerate(parts):
        writer = store.part_writer(index, samples[0].source_row, samples[-1].source_row + 1)
        for s in samples:
            writer.append(s)
        writer.finish()
    embed = torch.randn(VOCAB, 16, generator=gen).to(torch.bfloat16)
    store.write_target_rows(embed, embed.clone(), torch.ones(16, dtype=torch.bfloat16))
    store.write_files("target", {"config.json": b"{}"})
    store.write_files("tokenizer", {"tokenizer.json": b"{}"})
    return store.url, parts


def test_copy_keeps_exactly_the_accepted_samples_in_their_parts(tmp_path, gen):
    url, parts = _source(tmp_path, gen)
    odd_rows = lambda s: s.source_row % 2 == 1  # noqa: E731
    kept, seen = copy_store(url, str(tmp_path / "odd.zarr"), keep=odd_rows)
    assert (kept, seen) == (4, 8)
    copy = open_store(str(tmp_path / "odd.zarr"))
    for index, samples in enumerate(parts):
        want = [s for s in samples if odd_rows(s)]
        got = list(copy.part(index).iter_samples())
        assert len(got) == len(want)
        for a, b in zip(want, got, strict=True):
            assert_same_sample(a, b)
    assert validate(copy.url) == []
    assert torch.equal(copy.target_rows()["embed_tokens"],
                       open_store(url).target_rows()["embed_tokens"])
    assert copy.read_files("tokenizer") == {"tokenizer.json": b"{}"}


def test_copy_without_a_filter_is_the_whole_store_and_a_part_may_end_empty(tmp_path, gen):
    url, parts = _source(tmp_path, gen)
    assert copy_store(url, str(tmp_path / "all.zarr")) == (8, 8)
    assert copy_store(url, str(tmp_path / "first.zarr"), keep=lambda s: s.source_row < 5) == (5, 8)
    empty = open_store(str(tmp_path / "first.zarr")).part(1)
    assert empty.complete and empty.num_samples == 0
