"""fp8 context: what is read back is the E4M3 quantization a longhand quantizer computes, per
(token, layer) row; damaged scales are named; default stores are v1 as before."""

import json

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

from dflash_train.store_schema import StoreError, create_store, open_store, validate
from dflash_train.store_schema import store as store_module
from dflash_train.store_schema.command import store as store_cli
from dflash_train.store_schema.fp8 import MIN_SCALE
from dflash_train.store_schema.layout import FP8_CONTEXT, PLAIN_SCHEMA_VERSION, part_path
from dflash_train.train.data import StoreLoader
from dflash_train.train.loader_config import LoaderConfig
from tests.store_schema.conftest import HIDDEN, LAYERS, VOCAB, flip_bytes, make_meta, random_sample


def _e4m3_grid() -> np.ndarray:
    """Every non-negative finite float8_e4m3fn value, by code: bias 7, 3 mantissa bits,
    subnormals at exponent 0, no Inf, code 0x7F is NaN (so 0x7E = 448 is the largest)."""
    values = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        values.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(values)


def longhand_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dequantized float32 values, float32 scales [T, n]) of x [T, n, H], written from the
    format's definition: scale = row absmax / 448 (float32), each value / scale rounded to the
    nearest grid value, ties to the even code."""
    grid = _e4m3_grid()
    x = x.astype(np.float32)
    scale = np.maximum(np.abs(x).max(-1) / np.float32(448), np.float32(MIN_SCALE))
    v = (x / scale[..., None]).astype(np.float64)
    a = np.abs(v)
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)  # grid[hi-1] <= a <= grid[hi]
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    q = np.sign(v) * grid[code]
    return (q.astype(np.float32) * scale[..., None]).astype(np.float32), scale


def _fp8_store(url, samples, shard_tokens=64, hidden_dtype="bfloat16"):
    store = create_store(url, make_meta(num_parts=1, hidden_dtype=hidden_dtype,
                                        context_dtype=FP8_CONTEXT), shard_tokens=shard_tokens)
    writer = store.part_writer(0, 0, len(samples))
    for s in samples:
        writer.append(s)
    writer.finish()
    return store


def _bf16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x).to(torch.bfloat16)


def test_read_back_is_the_longhand_e4m3_quantization_within_its_error_bound(tmp_path, gen):
    samples = [random_sample(n, row, gen) for row, n in enumerate([7, 1, 130, 64, 65, 3])]
    url = str(tmp_path / "fp8.zarr")
    _fp8_store(url, samples)
    part = open_store(url).part(0)
    stored = part.group["context_scale"][:]
    start = 0
    for i, s in enumerate(samples):
        x = s.context.float().numpy()
        want, scale = longhand_fp8(x)
        got = part.sample(i).context
        assert got.dtype == torch.bfloat16  # read as the hidden dtype
        assert torch.equal(got, _bf16(want)), i
        np.testing.assert_array_equal(stored[start:start + len(s)], scale)
        # E4M3 rounds to within half a step (2^-4 relative; subnormal step 2^-9 * scale),
        # then bf16 rounds once more (2^-9 relative)
        bound = 2.0**-4 * np.abs(x) + 2.0**-10 * scale[..., None]
        assert (np.abs(got.float().numpy() - x) <= bound * (1 + 2.0**-8) + 2.0**-9
                * np.abs(x)).all(), i
        start += len(s)
    for s, r in zip(samples, part.iter_samples(), strict=True):
        assert torch.equal(r.context, part.sample(s.source_row).context)


def test_each_token_and_layer_has_its_own_scale(tmp_path, gen):
    s = random_sample(9, 0, gen)
    context = torch.randn(9, LAYERS, HIDDEN, generator=gen)
    context[3, 0, 5] = 1e6  # one huge outlier in one layer of one token
    s.context = context.to(torch.bfloat16)
    url = str(tmp_path / "fp8.zarr")
    _fp8_store(url, [s])
    part = open_store(url).part(0)
    got = part.sample(0).context.float()
    x = s.context.float()
    err = (got - x).abs().amax(-1) / x.abs().amax(-1)  # per (token, layer), of its own absmax
    spared = torch.ones(9, LAYERS, dtype=torch.bool)
    spared[3, 0] = False
    # every other row keeps E4M3's precision relative to its OWN size: it is not crushed
    assert (err[spared] <= 2.0**-4 + 2.0**-8).all()
    scales = part.group["context_scale"][:]
    np.testing.assert_allclose(scales, x.abs().amax(-1).numpy() / 448, rtol=1e-6)
    # the outlier's scale, shared, would round most of row (4, 1) to zero (below half the
    # smallest E4M3 subnormal, 2^-9); its own keeps nearly every value
    assert (x[4, 1] / scales[3, 0]).abs().lt(2.0**-10).float().mean() > 0.5
    assert (got[4, 1] != 0).float().mean() > 0.9


def test_all_zero_rows_read_back_as_zeros_with_a_positive_scale(tmp_path, gen):
    s = random_sample(5, 0, gen)
    s.context[2] = 0
    s.context[4, 1] = 0
    url = str(tmp_path / "fp8.zarr")
    _fp8_store(url, [s])
    part = open_store(url).part(0)
    got = part.sample(0).context
    assert (got[2] == 0).all() and (got[4, 1] == 0).all() and got[0].abs().sum() > 0
    scales = part.group["context_scale"][:]
    assert scales[2].tolist() == [MIN_SCALE] * LAYERS and scales[4, 1] == MIN_SCALE
    assert validate(url) == []


def test_nonfinite_context_is_refused_naming_the_sample(tmp_path, gen):
    store = create_store(str(tmp_path / "fp8.zarr"),
                         make_meta(num_parts=1, context_dtype=FP8_CONTEXT), shard_tokens=64)
    writer = store.part_writer(0, 0, 10)
    writer.append(random_sample(5, 0, gen))
    bad = random_sample(5, 3, gen)
    bad.context[1, 2, 0] = float("inf")
    with pytest.raises(StoreError, match=r"part 0 sample 1 \(source row 3\): context holds NaN"):
        writer.append(bad)


@pytest.fixture
def fp8_path(tmp_path, gen):
    """An fp8 part of 12 samples of 20 tokens over shards of 64 tokens (one scale chunk)."""
    url = tmp_path / "fp8.zarr"
    _fp8_store(str(url), [random_sample(20, row, gen) for row in range(12)])
    assert validate(str(url)) == []
    return url


def _scales(url) -> zarr.Array:
    # stored even when all zeros (zarr would otherwise delete a chunk equal to its fill value)
    return zarr.open_array(str(url / part_path(0) / "context_scale"), mode="r+").with_config(
        {"write_empty_chunks": True})


@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf"), -1.0])
def test_validate_names_a_damaged_scale_by_sample_and_token_span(fp8_path, value):
    scales = _scales(fp8_path)
    rows = scales[45:62]
    rows[:, 1] = value  # a rewrite the checksum cannot see: tokens 45..61, samples 2 and 3
    scales[45:62] = rows
    findings = validate(str(fp8_path))
    assert [(f.part, f.sample, f.kind) for f in findings] == [(0, 2, "scale"), (0, 3, "scale")]
    assert "tokens [45, 60)" in findings[0].message and "layers [3]" in findings[0].message
    assert "tokens [60, 62)" in findings[1].message


def test_a_zeroed_scale_chunk_is_damage_to_every_sample_and_the_loader_names_it(fp8_path):
    scales = _scales(fp8_path)
    scales[:] = np.zeros(scales.shape, np.float32)
    findings = validate(str(fp8_path))
    assert [(f.sample, f.kind) for f in findings] == [(s, "scale") for s in range(12)]
    loader = StoreLoader([str(fp8_path)], LoaderConfig(batch_tokens=64, prefetch_batches=0))
    with pytest.raises(StoreError, match=r"part 0 sample \d+: cannot be read.*context_scale"):
        list(loader.epoch(0))
    skipping = StoreLoader([str(fp8_path)], LoaderConfig(batch_tokens=64, prefetch_batches=0,
                                                         skip_corrupt=True))
    assert sum(len(b.skipped) for b in skipping.epoch(0) if b is not None) == 12


def test_a_corrupted_scale_chunk_fails_its_checksum_naming_the_samples(fp8_path):
    (chunk,) = [p for p in (fp8_path / part_path(0) / "context_scale").rglob("*")
                if p.is_file() and p.name != "zarr.json"]
    flip_bytes(chunk)
    findings = validate(str(fp8_path))
    assert findings and {f.kind for f in findings} == {"checksum"}
    assert {f.sample for f in findings} == set(range(12))
    assert all("context_scale cannot be read" in f.message for f in findings)


def test_a_missing_scale_chunk_is_named_like_any_missing_chunk(fp8_path):
    (chunk,) = [p for p in (fp8_path / part_path(0) / "context_scale").rglob("*")
                if p.is_file() and p.name != "zarr.json"]
    chunk.unlink()
    findings = validate(str(fp8_path), check_data=False)
    assert {f.kind for f in findings} == {"missing"} and {f.sample for f in findings} == \
        set(range(12))
    assert "context_scale chunk" in findings[0].message


def test_an_fp8_store_is_v2_and_a_v1_reader_refuses_it(fp8_path, monkeypatch):
    doc = json.loads((fp8_path / "zarr.json").read_text())["attributes"]["dflash"]
    assert doc["context_dtype"] == FP8_CONTEXT and doc["schema_version"] == 2
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", PLAIN_SCHEMA_VERSION)  # an old reader
    with pytest.raises(StoreError, match="schema version 2.*Upgrade"):
        open_store(str(fp8_path))


def test_a_default_store_is_written_as_before_v1_without_fp8_arrays(tmp_path, gen):
    url = tmp_path / "plain.zarr"
    store = create_store(str(url), make_meta(num_parts=1), shard_tokens=64)
    writer = store.part_writer(0, 0, 1)
    writer.append(random_sample(9, 0, gen))
    writer.finish()
    doc = json.loads((url / "zarr.json").read_text())["attributes"]["dflash"]
    assert doc["schema_version"] == PLAIN_SCHEMA_VERSION and "context_dtype" not in doc
    assert not (url / part_path(0) / "context_scale").exists()
    assert open_store(str(url)).part(0).group["context"].dtype == np.uint16


def test_a_v1_store_claiming_fp8_context_is_refused(fp8_path):
    meta_file = fp8_path / "zarr.json"
    doc = json.loads(meta_file.read_text())
    doc["attributes"]["dflash"]["schema_version"] = 1
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="schema version 1 cannot hold float8_e4m3"):
        open_store(str(fp8_path))


def test_info_shows_the_context_dtype_and_its_bytes_per_token(fp8_path, tmp_path, gen):
    text = CliRunner().invoke(store_cli, ["info", str(fp8_path)])
    assert text.exit_code == 0, text.output
    assert "schema v2" in text.output
    assert "context dtype  float8_e4m3 (one float32 scale per token and layer), read as " \
           "bfloat16" in text.output
    info = json.loads(CliRunner().invoke(store_cli, ["info", "--json", str(fp8_path)]).output)
    context = sum(f.stat().st_size for name in ("context", "context_scale")
                  for f in (fp8_path / part_path(0) / name).rglob("*") if f.is_file())
    assert info["context_bytes_per_token"] == pytest.approx(context / 240)
    assert f"(context {context / 240:,.1f})" in text.output


def test_convert_re_encodes_a_store_as_fp8_with_the_same_tokens(tmp_path, gen):
    src = tmp_path / "src.zarr"
    store = create_store(str(src), make_meta(num_parts=1, hidden_dtype="float32"),
                         shard_tokens=64)
    samples = [random_sample(n, row, gen, torch.float32) for row, n in enumerate([30, 70, 5])]
    writer = store.part_writer(0, 0, 3)
    for s in samples:
        writer.append(s)
    writer.finish()
    store.write_target_rows(torch.randn(VOCAB, HIDDEN, generator=gen),
                            torch.randn(VOCAB, HIDDEN, generator=gen), torch.ones(HIDDEN))
    store.write_files("target", {"config.json": b"{}"})
    store.write_files("tokenizer", {"tokenizer.json": b"{}"})
    dst = tmp_path / "fp8.zarr"
    done = CliRunner().invoke(store_cli, ["convert", str(src), str(dst), "--context-dtype",
                                          FP8_CONTEXT, "--hidden-dtype", "bfloat16",
                                          "--no-progress"])
    assert done.exit_code == 0, done.output
    assert validate(str(dst)) == []
    part = open_store(str(dst)).part(0)
    assert part.store.meta.fp8 and part.store.meta.hidden_dtype == "bfloat16"
    for i, s in enumerate(samples):  # quantized from the bf16 values, as extract in bf16 would
        got = part.sample(i)
        assert torch.equal(got.input_ids, s.input_ids) and got.source_row == s.source_row
        want, _ = longhand_fp8(s.context.to(torch.bfloat16).float().numpy())
        assert torch.equal(got.context, _bf16(want))
    again = CliRunner().invoke(store_cli, ["convert", str(src), str(dst)])
    assert again.exit_code != 0 and "already exists" in again.output


def test_a_resumed_fp8_writer_stores_what_one_uninterrupted_writer_stores(tmp_path, gen):
    samples = [random_sample(n, row, gen) for row, n in enumerate([40, 50, 30, 70, 20])]
    whole = str(tmp_path / "whole.zarr")
    _fp8_store(whole, samples)
    cut = create_store(str(tmp_path / "cut.zarr"),
                       make_meta(num_parts=1, context_dtype=FP8_CONTEXT), shard_tokens=64)
    first = cut.part_writer(0, 0, 5)
    for s in samples[:3]:  # 120 tokens: one shard committed, the next one partly filled
        first.append(s)
    first._flush(final=False)
    del first  # a crash: what is buffered beyond the commit is lost
    resumed = open_store(cut.url, mode="r+").part_writer(0, 0, 5)
    assert resumed.committed_samples == 1 and resumed.next_row == 1
    for s in samples[1:]:
        resumed.append(s)
    resumed.finish()
    a, b = open_store(whole).part(0), open_store(cut.url).part(0)
    assert a.num_tokens == b.num_tokens == 210
    for name, value in a.read_stored(0, 210).items():  # codes and scales, bit for bit
        np.testing.assert_array_equal(value, b.read_stored(0, 210)[name], err_msg=name)
