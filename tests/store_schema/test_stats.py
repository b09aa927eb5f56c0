"""Store statistics equal a direct computation over every sample, and are cached."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.store_schema import StoreError, create_store, open_store
from dflash_train.store_schema.layout import part_path
from dflash_train.store_schema.stats import STATS_KEY, compute_stats, store_stats
from tests.store_schema.conftest import make_meta, random_sample


@pytest.fixture
def store(tmp_path, gen):
    s = create_store(str(tmp_path / "hs.zarr"), make_meta(num_parts=2), shard_tokens=64)
    for p in range(2):
        w = s.part_writer(p, p * 10, p * 10 + 10)
        for row in range(p * 10, p * 10 + 6):
            sample = random_sample(30 + 17 * (row % 5), row, gen)
            sample.context[:, 1, 7] *= 50  # an outlier channel in layer 1
            w.append(sample)
        w.finish()
    return s


def test_stats_match_a_direct_computation_over_all_samples(store):
    x = torch.cat([s.context for p in store.parts() for s in p.iter_samples()]).double()
    stats = store_stats(store)
    assert stats.tokens == x.shape[0] == store.num_tokens
    for i, layer in enumerate(stats.layers):
        v = x[:, i]
        assert layer.layer_id == store.meta.context_layer_ids[i]
        assert layer.mean == pytest.approx(v.mean().item(), rel=1e-9)
        assert layer.rms == pytest.approx(v.pow(2).mean().sqrt().item(), rel=1e-9)
        assert layer.absmax == pytest.approx(v.abs().max().item())
        channel_rms = v.pow(2).mean(0).sqrt().numpy()
        assert layer.outlier_channels[0] == int(np.argmax(channel_rms))
    assert stats.layers[1].outlier_channels[0] == 7


def test_bounded_stats_read_only_the_first_and_last_shard_when_two_fit(store):
    parts = store.parts()
    first, last = parts[0], parts[-1]
    last_start = (last.num_tokens - 1) // 64 * 64  # shard_tokens is 64
    tokens = [torch.cat([s.context for s in p.iter_samples()]).double() for p in (first, last)]
    x = torch.cat([tokens[0][:64], tokens[1][last_start:]])
    stats = compute_stats(store, max_tokens=128)
    assert stats.tokens == x.shape[0] < store.num_tokens
    for i, layer in enumerate(stats.layers):
        assert layer.rms == pytest.approx(x[:, i].pow(2).mean().sqrt().item(), rel=1e-9)
    assert compute_stats(store, max_tokens=10**9) == compute_stats(store)


def test_bounded_stats_are_not_cached_as_the_whole_store(store):
    store_stats(store, max_tokens=64)
    assert STATS_KEY not in dict(store.root.attrs)


def test_stats_are_cached_and_recomputed_when_the_token_count_changes(store):
    first = store_stats(store)
    cached = dict(store.root.attrs)[STATS_KEY]
    cached["layers"][0]["rms"] = 123.0  # a marker only a cache read can return
    store.root.attrs[STATS_KEY] = cached
    assert store_stats(open_store(store.url)).layers[0].rms == 123.0
    cached["tokens"] += 1  # as if the store had grown since
    store.root.attrs[STATS_KEY] = cached
    assert store_stats(open_store(store.url, mode="r+")) == first


def test_stats_command_prints_each_layer(store):
    result = CliRunner().invoke(main, ["store", "stats", store.url, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [layer["layer_id"] for layer in doc["layers"]] == store.meta.context_layer_ids
    assert doc["tokens"] == store.num_tokens


def _lose_second_context_shard_of_part_0(store):
    (Path(store.url) / part_path(0) / "context" / "c" / "1" / "0" / "0").unlink()


def test_stats_refuse_a_store_missing_a_context_shard_and_cache_nothing(store):
    _lose_second_context_shard_of_part_0(store)
    with pytest.raises(StoreError) as e:
        store_stats(store)
    assert "part 0" in str(e.value) and "context" in str(e.value) and "missing" in str(e.value)
    assert STATS_KEY not in dict(open_store(store.url).root.attrs)


def test_stats_skipping_damage_leave_the_damaged_part_out_and_cache_nothing(store):
    _lose_second_context_shard_of_part_0(store)
    sound = store.part(1)
    x = torch.cat([s.context for s in sound.iter_samples()]).double()
    stats = store_stats(store, skip_damaged=True)
    assert stats.tokens == sound.num_tokens == x.shape[0]
    for i, layer in enumerate(stats.layers):
        assert layer.rms == pytest.approx(x[:, i].pow(2).mean().sqrt().item(), rel=1e-9)
        assert layer.mean == pytest.approx(x[:, i].mean().item(), rel=1e-9)
    assert any("part 0" in what for what in stats.left_out)
    assert STATS_KEY not in dict(open_store(store.url).root.attrs)


def test_stats_command_on_a_damaged_store_fails_naming_part_and_array(store):
    _lose_second_context_shard_of_part_0(store)
    result = CliRunner().invoke(main, ["store", "stats", store.url])
    assert result.exit_code == 1
    assert "part 0" in result.output and "context" in result.output
    assert "Traceback" not in result.output
    skipped = CliRunner().invoke(main, ["store", "stats", store.url, "--skip-corrupt", "--json"])
    assert skipped.exit_code == 0, skipped.output
    doc = json.loads(skipped.output)
    assert doc["tokens"] == store.part(1).num_tokens and doc["left_out"]
    assert STATS_KEY not in dict(open_store(store.url).root.attrs)
