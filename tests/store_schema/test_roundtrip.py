"""What goes in through the part writer comes out bit-exact, at the right offsets."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from dflash_train.store_schema import StoreError, StoreMeta, create_store, open_store, validate
from dflash_train.store_schema.layout import _SCAN_BLOCK
from tests.store_schema.conftest import (
    HIDDEN,
    LAYERS,
    VOCAB,
    assert_same_sample,
    make_meta,
    random_sample,
)


def _write(url, lengths, gen, shard_tokens=64, dtype=torch.bfloat16, hidden_dtype="bfloat16"):
    store = create_store(url, make_meta(hidden_dtype=hidden_dtype), shard_tokens=shard_tokens)
    writer = store.part_writer(0, 0, len(lengths))
    samples = [random_sample(n, row, gen, dtype) for row, n in enumerate(lengths)]
    for s in samples:
        writer.append(s)
    writer.finish()
    return store, samples


@pytest.mark.parametrize("hidden_dtype,dtype", [
    ("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)])
def test_random_hidden_states_read_back_bit_exact(tmp_path, gen, hidden_dtype, dtype):
    url = str(tmp_path / "hs.zarr")
    _, samples = _write(url, [7, 1, 130, 64, 65, 3], gen, dtype=dtype, hidden_dtype=hidden_dtype)
    part = open_store(url).part(0)
    assert part.complete and part.num_samples == len(samples)
    for i, s in enumerate(samples):
        assert_same_sample(s, part.sample(i))
    for s, r in zip(samples, part.iter_samples(), strict=True):
        assert_same_sample(s, r)


def test_ragged_lengths_1_to_4096_land_at_their_offsets(tmp_path, gen):
    lengths = [1, 2, 3, 5, 8, 17, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 1, 4096, 9]
    url = str(tmp_path / "hs.zarr")
    _, samples = _write(url, lengths, gen, shard_tokens=1024)
    part = open_store(url).part(0)
    expected = [0]
    for n in lengths:
        expected.append(expected[-1] + n)
    assert part.offsets().tolist() == expected
    assert part.sample_lengths().tolist() == lengths
    assert part.num_tokens == sum(lengths)
    # Read a few samples out of order: each one's tokens must be its own.
    for i in (13, 0, 16, 10, 6):
        assert_same_sample(samples[i], part.sample(i))
    assert validate(url) == []


def test_arrays_read_into_given_buffers_are_those_of_a_plain_read(tmp_path, gen):
    # context goes through dflash's shard coder, the token arrays through zarr-python
    url = str(tmp_path / "hs.zarr")
    _write(url, [7, 130, 64, 1], gen)
    part = open_store(url).part(0)
    plain = part.read_tokens(5, 150)
    buffers = {}
    for name, a in plain.items():
        buffers[name] = a.copy()
        buffers[name].view(np.uint8)[...] ^= 0xFF  # every byte differs from what is stored
    read = part.read_tokens(5, 150, out=buffers)
    for name, a in plain.items():
        assert read[name] is buffers[name]
        np.testing.assert_array_equal(buffers[name], a)
    for name in ("context", "input_ids"):  # the coder's path and zarr's
        with pytest.raises(ValueError, match="buffer to read into"):
            part.read_tokens(5, 150, (name,), out={name: buffers[name][:-1]})


def test_commit_spacing_changes_no_stored_byte(tmp_path, gen):
    lengths = [7, 1, 130, 64, 65, 3, 300, 2, 64, 128]  # ragged across 64-token shards
    samples = [random_sample(n, row, gen) for row, n in enumerate(lengths)]
    stores = []
    for flush_shards in (1, 3):
        url = str(tmp_path / f"f{flush_shards}.zarr")
        writer = create_store(url, make_meta(), shard_tokens=64).part_writer(
            0, 0, len(samples), flush_shards)
        for s in samples:
            writer.append(s)
        writer.finish()
        stores.append(tmp_path / f"f{flush_shards}.zarr" / "parts" / "00000" / "context")
    for s, r in zip(samples, open_store(url).part(0).iter_samples(), strict=True):
        assert_same_sample(s, r)
    shards = [sorted(p.relative_to(root) for p in root.rglob("c/**/*") if p.is_file())
              for root in stores]
    assert shards[0] == shards[1] and len(shards[0]) == -(-sum(lengths) // 64)
    for rel in shards[0]:
        assert (stores[0] / rel).read_bytes() == (stores[1] / rel).read_bytes()


def test_memory_url_works_through_the_same_api(gen):
    url = "memory://dflash-test/hs.zarr"
    _, samples = _write(url, [5, 100, 33], gen)
    store = open_store(url)
    assert [p.index for p in store.parts()] == [0]
    for s, r in zip(samples, store.part(0).iter_samples(), strict=True):
        assert_same_sample(s, r)
    assert validate(url) == []


def test_target_rows_and_files_round_trip(tmp_path, gen):
    store = create_store(str(tmp_path / "hs.zarr"), make_meta())
    embed = torch.randn(VOCAB, 16, generator=gen).to(torch.bfloat16)
    head = torch.randn(VOCAB, 16, generator=gen).to(torch.bfloat16)
    norm = torch.randn(16, generator=gen).to(torch.bfloat16)
    store.write_target_rows(embed, head, norm)
    store.write_files("tokenizer", {"tokenizer.json": b'{"a": 1}', "empty.txt": b""})
    again = open_store(store.url)
    rows = again.target_rows()
    assert torch.equal(rows["embed_tokens"], embed) and torch.equal(rows["lm_head"], head)
    assert torch.equal(rows["final_norm"], norm)
    assert again.read_files("tokenizer") == {"tokenizer.json": b'{"a": 1}', "empty.txt": b""}


def test_reopening_with_other_provenance_names_every_difference(tmp_path):
    url = str(tmp_path / "hs.zarr")
    create_store(url, make_meta())
    other = make_meta(name_or_path="Qwen/Other")
    other.context_layer_ids = [1, 2, 3]
    with pytest.raises(StoreError) as e:
        create_store(url, other)
    msg = str(e.value)
    assert "target.name_or_path: 'tiny' != 'Qwen/Other'" in msg
    assert "context_layer_ids" in msg
    # Same provenance (but another machine) reopens it for resume.
    same = make_meta()
    same.created_with.device = "cuda:3"
    assert create_store(url, same).meta.target.name_or_path == "tiny"


def test_the_target_is_its_weights_fingerprint_where_both_have_one_else_its_path():
    here, there = make_meta(weights_sha256="a" * 64), make_meta(name_or_path="/copy",
                                                                 weights_sha256="a" * 64)
    assert here.mismatches(there) == [] and here.target_mismatches(there) == []
    retrained = make_meta(weights_sha256="b" * 64)  # same path, other weights
    assert retrained.target_mismatches(here) == [
        f"target.weights_sha256: {'b' * 64!r} != {'a' * 64!r}"]
    old = StoreMeta.from_dict({**make_meta().to_dict(), "target": {
        k: v for k, v in make_meta().to_dict()["target"].items() if k != "weights_sha256"}})
    assert old.target.weights_sha256 is None  # a store from before the field still reads
    assert old.mismatches(here) == []  # the path decides, as it did
    assert old.mismatches(there) == ["target.name_or_path: 'tiny' != '/copy'"]


def test_the_data_is_its_sha256_where_both_record_one_else_its_paths():
    here = make_meta()
    assert here.source.sha256, "the factory records the data's sha256, as extract does"
    moved = replace(here, source=replace(here.source, paths=["/elsewhere/data.jsonl"]))
    assert here.mismatches(moved) == []  # the same bytes at another path: the same data
    edited = replace(here, source=replace(here.source, sha256=["f" * 64]))
    assert here.mismatches(edited) == [
        f"source.sha256: {here.source.sha256!r} != {['f' * 64]!r}"]
    unhashed = [replace(m, source=replace(m.source, sha256=[])) for m in (here, moved)]
    assert unhashed[0].mismatches(unhashed[1]) == [
        f"source.paths: {here.source.paths!r} != {['/elsewhere/data.jsonl']!r}"]


def test_a_directory_that_is_not_a_store_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a dflash store|not a readable zarr"):
        create_store(str(tmp_path), make_meta())
    with pytest.raises(StoreError, match="no such store"):
        open_store(str(tmp_path / "missing.zarr"))


def test_writer_rejects_wrong_shapes_and_out_of_order_rows(tmp_path, gen):
    store = create_store(str(tmp_path / "hs.zarr"), make_meta())
    writer = store.part_writer(0, 10, 20)
    good = random_sample(5, 12, gen)
    writer.append(good)
    with pytest.raises(StoreError, match="source row must be in"):
        writer.append(random_sample(5, 12, gen))
    bad = random_sample(5, 13, gen)
    bad.context = bad.context[:, :2]
    with pytest.raises(StoreError, match=r"part 0 sample 1 \(source row 13\): context has shape"):
        writer.append(bad)
    nan = random_sample(5, 14, gen)
    nan.context[2, 1, 3] = float("nan")
    with pytest.raises(StoreError, match="sample 1 .*NaN"):
        writer.append(nan)
    with pytest.raises(StoreError, match="part 0 holds rows"):
        store.part_writer(0, 0, 20)


@pytest.mark.parametrize("hidden_dtype,dtype", [
    ("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_value_anywhere_in_the_context_is_refused(tmp_path, gen, hidden_dtype,
                                                              dtype, bad):
    store = create_store(str(tmp_path / "hs.zarr"), make_meta(hidden_dtype=hidden_dtype))
    writer = store.part_writer(0, 0, 10)
    per_token = LAYERS * HIDDEN
    length = 2 * _SCAN_BLOCK // per_token + 1  # more than two of the writer's scan blocks
    clean = random_sample(length, 0, gen, dtype)
    writer.append(clean)
    for where in (0, _SCAN_BLOCK + 7, length * per_token - 1):  # first, middle, last entry
        sample = random_sample(length, 1, gen, dtype)
        sample.context.view(-1)[where] = bad
        with pytest.raises(StoreError, match="sample 1 .*NaN or Inf"):
            writer.append(sample)
    assert writer.pending_samples == 1  # the refused samples were not buffered


def test_empty_part_can_be_completed(tmp_path):
    store = create_store(str(tmp_path / "hs.zarr"), make_meta())
    store.part_writer(1, 500, 1000).finish()
    part = store.part(1)
    assert part.complete and part.num_samples == 0 and list(part.iter_samples()) == []
    assert validate(store.url) == []


def test_part_torn_at_creation_counts_as_not_started_and_is_recreated(tmp_path, gen):
    store = create_store(str(tmp_path / "hs.zarr"), make_meta())
    store.root.require_group("parts/00001")  # a crash right after the group was made
    assert [p.index for p in store.parts()] == [] and not store.complete
    writer = store.part_writer(1, 0, 10)
    assert writer.committed_samples == 0 and writer.next_row == 0
    writer.append(random_sample(3, 0, gen))
    writer.finish()
    assert [p.index for p in open_store(store.url).parts()] == [1]


def test_a_chunk_of_fill_values_is_stored_not_taken_for_a_lost_one(tmp_path, gen):
    # a long prompt: a whole loss_mask chunk of False (zarr's fill value), ids of 0
    url = str(tmp_path / "hs.zarr")
    store = create_store(url, make_meta(), shard_tokens=16)
    writer = store.part_writer(0, 0, 2)
    long = random_sample(300, 0, gen)
    long.loss_mask[:] = False
    long.loss_mask[-1] = True
    long.input_ids[:200] = 0
    writer.append(long)
    writer.append(random_sample(5, 1, gen))
    writer.finish()
    assert validate(url) == []
    assert_same_sample(long, open_store(url).part(0).sample(0))
