"""dflash's own shard coder against zarr-python's: same objects read back, same chunk bytes."""

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

from dflash_train.store_schema.layout import context_compressors
from dflash_train.store_schema.shards import ShardCodec, ShardDamage

SHARD, INNER, LAYERS, HIDDEN = 64, 16, 3, 40


def hidden_bits(tokens: int, seed: int = 0) -> np.ndarray:
    """uint16 bit patterns of bf16-like values: a smooth drift, so blosc has work to do."""
    rng = np.random.default_rng(seed)
    x = np.cumsum(rng.standard_normal((tokens, LAYERS, HIDDEN)), axis=0).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def context_array(path, dtype="uint16", typesize=2, **kw) -> zarr.Array:
    kw.setdefault("shards", (SHARD, LAYERS, HIDDEN))
    kw.setdefault("compressors", context_compressors("bfloat16" if typesize == 2 else "float32"))
    return zarr.create_array(str(path), shape=(0, LAYERS, HIDDEN), dtype=dtype,
                             chunks=(INNER, 1, HIDDEN), **kw)


def chunk_bytes(obj: bytes, chunks: int) -> list[bytes]:
    """Each inner chunk's stored bytes, found through the shard's own index (spec layout)."""
    index = np.frombuffer(obj[-(16 * chunks + 4):-4], dtype="<u8").reshape(chunks, 2)
    return [obj[int(o):int(o) + int(n)] for o, n in index]


def test_zarr_python_reads_back_what_dflash_coded(tmp_path):
    data = hidden_bits(3 * SHARD)
    arr = context_array(tmp_path / "a.zarr")
    arr.resize(data.shape)
    codec = ShardCodec.of(arr)
    codec.write(0, data)
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "a.zarr"))[:], data)


def test_each_chunk_is_coded_exactly_as_zarr_python_codes_it(tmp_path):
    data = hidden_bits(2 * SHARD, seed=1)
    ours, theirs = context_array(tmp_path / "ours.zarr"), context_array(tmp_path / "z.zarr")
    for a in (ours, theirs):
        a.resize(data.shape)
    ShardCodec.of(ours).write(0, data)
    theirs[:] = data
    chunks = (SHARD // INNER) * LAYERS
    for s in range(2):
        mine = (tmp_path / "ours.zarr" / "c" / str(s) / "0" / "0").read_bytes()
        ref = (tmp_path / "z.zarr" / "c" / str(s) / "0" / "0").read_bytes()
        assert len(mine) == len(ref)  # same chunks, maybe in another order: same total
        assert sorted(chunk_bytes(mine, chunks)) == sorted(chunk_bytes(ref, chunks))
        # and chunk by chunk in C order of their coordinates
        assert chunk_bytes(mine, chunks) == chunk_bytes(ref, chunks)


def test_writing_shards_from_the_middle_leaves_earlier_ones_alone(tmp_path):
    data = hidden_bits(3 * SHARD, seed=2)
    arr = context_array(tmp_path / "m.zarr")
    arr.resize(data.shape)
    arr[:SHARD] = data[:SHARD]
    ShardCodec.of(arr).write(1, data[SHARD:])
    np.testing.assert_array_equal(arr[:], data)


def test_a_partial_shard_is_refused(tmp_path):
    arr = context_array(tmp_path / "p.zarr")
    arr.resize((SHARD + 8, LAYERS, HIDDEN))
    with pytest.raises(ValueError, match="whole shards"):
        ShardCodec.of(arr).write(0, hidden_bits(SHARD + 8))


def test_other_codec_chains_take_zarrs_path(tmp_path):
    plain = context_array(tmp_path / "zstd.zarr", compressors=[ZstdCodec(level=1)])
    unsharded = zarr.create_array(str(tmp_path / "u.zarr"), shape=(0, LAYERS, HIDDEN),
                                  dtype="uint16", chunks=(INNER, 1, HIDDEN),
                                  compressors=context_compressors("bfloat16"))
    assert ShardCodec.of(plain) is None
    assert ShardCodec.of(unsharded) is None
    assert ShardCodec.of(context_array(tmp_path / "f.zarr", dtype="float32", typesize=4))


@pytest.mark.parametrize("start,stop", [(0, 3 * SHARD), (5, 6), (INNER - 1, 2 * SHARD + 3),
                                        (SHARD, 2 * SHARD), (3 * SHARD - 7, 3 * SHARD)])
def test_dflash_reads_any_token_range_of_what_zarr_python_wrote(tmp_path, start, stop):
    data = hidden_bits(3 * SHARD, seed=3)
    arr = context_array(tmp_path / "r.zarr")
    arr.resize(data.shape)
    arr[:] = data
    np.testing.assert_array_equal(ShardCodec.of(arr).read(start, stop), data[start:stop])


def test_a_partial_last_shard_and_empty_chunks_read_as_zarr_reads_them(tmp_path):
    data = hidden_bits(SHARD + 20, seed=4)
    data[:INNER] = 0  # a chunk of fill values: zarr-python leaves it out of the index
    arr = context_array(tmp_path / "e.zarr")
    arr.resize(data.shape)
    arr[:] = data
    np.testing.assert_array_equal(ShardCodec.of(arr).read(0, SHARD + 20), data)


def test_damage_is_named_not_decoded_into_garbage(tmp_path):
    data = hidden_bits(2 * SHARD, seed=5)
    arr = context_array(tmp_path / "d.zarr")
    arr.resize(data.shape)
    ShardCodec.of(arr).write(0, data)
    shard = tmp_path / "d.zarr" / "c" / "1" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF  # inside the first chunk of shard 1
    shard.write_bytes(bytes(raw))
    codec = ShardCodec.of(arr)
    np.testing.assert_array_equal(codec.read(0, SHARD), data[:SHARD])  # shard 0 is intact
    with pytest.raises(ShardDamage, match="c/1/0/0.*checksum|checksum.*c/1/0/0"):
        codec.read(SHARD, SHARD + 1)
    raw[-2] ^= 0xFF  # the index's own checksum
    shard.write_bytes(bytes(raw))
    with pytest.raises(ShardDamage, match="index"):
        codec.read(SHARD, SHARD + 1)
    shard.unlink()
    with pytest.raises(ShardDamage, match="missing"):
        codec.read(2 * SHARD - 1, 2 * SHARD)


def test_an_immutable_array_reads_each_shard_index_once(tmp_path):
    data = hidden_bits(2 * SHARD, seed=6)
    arr = context_array(tmp_path / "i.zarr")
    arr.resize(data.shape)
    arr[:] = data
    kept, fresh = ShardCodec.of(arr, immutable=True), ShardCodec.of(arr)
    np.testing.assert_array_equal(kept.read(0, 2 * SHARD), data)
    shard = tmp_path / "i.zarr" / "c" / "1" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[-2] ^= 0xFF  # the index's checksum: only a reader that reads the index again sees it
    shard.write_bytes(bytes(raw))
    np.testing.assert_array_equal(kept.read(SHARD, 2 * SHARD), data[SHARD:])
    with pytest.raises(ShardDamage, match="index"):
        fresh.read(SHARD, 2 * SHARD)


def test_many_spans_read_at_once_into_given_buffers(tmp_path):
    data = hidden_bits(3 * SHARD, seed=7)
    arr = context_array(tmp_path / "s.zarr")
    arr.resize(data.shape)
    arr[:] = data
    spans = [(0, 10), (10, 70), (69, 3 * SHARD), (5, 5)]  # adjacent, overlapping, empty
    outs = [np.full((b - a, LAYERS, HIDDEN), 7, np.uint16) for a, b in spans]
    got = ShardCodec.of(arr).read_many(spans, outs)
    for (a, b), out, value in zip(spans, outs, got, strict=True):
        assert value is out
        np.testing.assert_array_equal(out, data[a:b])


def test_a_buffer_of_another_shape_dtype_or_layout_is_refused_before_reading(tmp_path):
    data = hidden_bits(SHARD, seed=8)
    arr = context_array(tmp_path / "b.zarr")
    arr.resize(data.shape)
    arr[:] = data
    codec = ShardCodec.of(arr)
    right = np.zeros((10, LAYERS, HIDDEN), np.uint16)
    assert codec.read(3, 13, right) is right
    np.testing.assert_array_equal(right, data[3:13])
    for wrong in (np.zeros((9, LAYERS, HIDDEN), np.uint16), np.zeros(right.shape, np.int32),
                  np.zeros((10, HIDDEN, LAYERS), np.uint16).transpose(0, 2, 1)):
        with pytest.raises(ValueError, match="C-contiguous"):
            codec.read(3, 13, wrong)


def test_pieces_are_coded_exactly_as_their_concatenation(tmp_path):
    data = hidden_bits(3 * SHARD, seed=9)
    arr = context_array(tmp_path / "c.zarr")
    codec = ShardCodec.of(arr)
    cuts = [0, 5, 6, INNER + 3, SHARD, 2 * SHARD - 1, 3 * SHARD]  # across chunks and shards
    pieces = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert codec.encode(pieces) == codec.encode(data)
    with pytest.raises(ValueError, match="whole shards"):
        codec.encode(pieces[:-1])
    with pytest.raises(ValueError, match="whole shards"):
        codec.encode([p[:, :, :-1] for p in pieces])
    with pytest.raises(ValueError, match="dtypes"):  # blosc would code other bytes
        codec.encode([p.astype(np.int32) if i == 2 else p for i, p in enumerate(pieces)])
