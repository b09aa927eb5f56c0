"""The store loader: each sample once per epoch, disjoint across ranks, resumable, bounded."""

import platform
import sys
import threading
import time

import pytest
import torch

from dflash_train.store_schema import create_store
from dflash_train.train.batch import pin_mmap_threshold
from dflash_train.train.data import StoreLoader
from dflash_train.train.loader_config import LoaderConfig
from dflash_train.train.prefetch import PREFETCH_JOIN_S, prefetch
from tests.store_schema.conftest import make_meta, random_sample


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("loader") / "hs.zarr")
    store = create_store(url, make_meta(num_parts=3), shard_tokens=64)
    gen = torch.Generator().manual_seed(1)
    for p in range(3):
        w = store.part_writer(p, p * 100, p * 100 + 100)
        for row in range(p * 100, p * 100 + 40):
            w.append(random_sample(1 + (row * 13) % 90, row, gen))
        if p < 2:
            w.finish()  # part 2 stays unfinished: the loader must not read it
    return url


def _keys(batches):
    return [(r.part, r.index) for b in batches for r in b]


GROUPINGS = pytest.mark.parametrize("grouping", ["random", "by_length"])


def _cfg(**kw):
    base = dict(batch_tokens=256, shuffle_buffer_tokens=300, part_window=2, seed=7,
                prefetch_batches=0)
    base.update(kw)
    return LoaderConfig(**base)


@GROUPINGS
def test_every_committed_sample_of_complete_parts_comes_once_per_epoch(store_url, grouping):
    loader = StoreLoader([store_url], _cfg(grouping=grouping))
    keys = _keys(loader.plan(0))
    assert sorted(keys) == [(p, i) for p in (0, 1) for i in range(40)]


@GROUPINGS
def test_ranks_read_disjoint_samples_that_cover_the_epoch(store_url, grouping):
    plans = [_keys(StoreLoader([store_url], _cfg(grouping=grouping), rank=r, world=2).plan(3))
             for r in (0, 1)]
    assert plans[0] and plans[1]
    assert not set(plans[0]) & set(plans[1])
    assert sorted(plans[0] + plans[1]) == [(p, i) for p in (0, 1) for i in range(40)]


@GROUPINGS
def test_order_is_fixed_by_seed_and_epoch_and_changes_between_epochs(store_url, grouping):
    loader = StoreLoader([store_url], _cfg(grouping=grouping))
    again = StoreLoader([store_url], _cfg(grouping=grouping))
    assert _keys(loader.plan(1)) == _keys(again.plan(1))
    assert _keys(loader.plan(1)) != _keys(loader.plan(2))
    assert _keys(loader.plan(1)) != sorted(_keys(loader.plan(1)))  # actually shuffled


@GROUPINGS
def test_batches_keep_the_padded_token_budget(store_url, grouping):
    for batch in StoreLoader([store_url], _cfg(batch_tokens=200, grouping=grouping)).plan(0):
        longest = max(r.length for r in batch)
        assert len(batch) == 1 or longest * len(batch) <= 200


def test_batches_hold_the_stored_samples_padded_with_no_loss(store_url):
    loader = StoreLoader([store_url], _cfg(prefetch_batches=2))
    part = {p.index: p for _, p in loader.parts}
    seen = 0
    for batch in loader.epoch(0):
        for row, ref in enumerate(batch.refs):
            n = ref.length
            stored = part[ref.part].sample(ref.index)
            assert int(batch.lengths[row]) == n == len(stored)
            assert torch.equal(batch.input_ids[row, :n], stored.input_ids.long())
            assert torch.equal(batch.context[row, :n], stored.context)
            assert torch.equal(batch.topk_ids[row, :n], stored.topk_ids.long())
            assert not batch.loss_mask[row, n:].any()
            assert not batch.context[row, n:].any(), "padding context must be zeros"
            seen += 1
    assert seen == 80


def _padded_share(batches) -> float:
    real = sum(r.length for b in batches for r in b)
    return real / sum(max(r.length for r in b) * len(b) for b in batches)


def test_by_length_batches_rows_of_similar_length_in_a_random_order(store_url):
    whole = _cfg(shuffle_buffer_tokens=10**6, batch_tokens=400,  # one buffer holds the store
                 grouping="by_length")
    grouped = list(StoreLoader([store_url], whole).plan(0))
    spans = sorted((min(r.length for r in b), max(r.length for r in b)) for b in grouped)
    # sorted then cut: the batches' length ranges only touch, never interleave
    assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(spans, spans[1:], strict=False))
    firsts = [min(r.length for r in b) for b in grouped]
    assert firsts != sorted(firsts), "the batches themselves must come in a random order"
    random = list(StoreLoader([store_url], _cfg(shuffle_buffer_tokens=10**6, batch_tokens=400,
                                                grouping="random")).plan(0))
    assert _padded_share(grouped) > 0.85 and _padded_share(random) < 0.7
    assert len(grouped) < len(random)  # the same samples in fewer padded batches


@GROUPINGS
def test_resume_skips_batches_without_changing_what_follows(store_url, grouping):
    loader = StoreLoader([store_url], _cfg(grouping=grouping))
    full = [b.refs for b in loader.epoch(4)]
    resumed = [b.refs for b in loader.epoch(4, skip_batches=5)]
    assert len(full) > 5 and resumed == full[5:]


def test_max_length_truncates_samples(store_url):
    loader = StoreLoader([store_url], _cfg(max_length=10))
    stored = {p.index: p for _, p in loader.parts}
    for batch in loader.epoch(0):
        assert batch.input_ids.shape[1] <= 10
        ref = batch.refs[0]
        full = stored[ref.part].sample(ref.index)
        expect = full.input_ids[:10].long()
        assert torch.equal(batch.input_ids[0, : len(expect)], expect)


def test_store_weights_repeat_or_subsample_each_store(store_url, tmp_path):
    other = str(tmp_path / "other.zarr")
    store = create_store(other, make_meta(num_parts=1), shard_tokens=64)
    w = store.part_writer(0, 0, 200)
    gen = torch.Generator().manual_seed(5)
    for row in range(200):
        w.append(random_sample(10, row, gen))
    w.finish()
    loader = StoreLoader([store_url, other], _cfg(store_weights=[2.0, 0.5]))
    counts: dict = {}
    for batch in loader.plan(0):
        for r in batch:
            counts[(r.store, r.part, r.index)] = counts.get((r.store, r.part, r.index), 0) + 1
    first = [c for (s, _, _), c in counts.items() if s == 0]
    second = [c for (s, _, _), c in counts.items() if s == 1]
    assert len(first) == 80 and set(first) == {2}  # every sample of store 0, twice
    assert set(second) == {1} and 40 <= len(second) <= 160  # about half of store 1's units
    loaded = sum(len(b.refs) for b in loader.epoch(0) if b is not None)
    assert loaded == sum(counts.values())


def test_worker_processes_yield_the_same_batches_in_the_same_order(store_url):
    def refs(batches):
        return [[(r.part, r.index) for r in b.refs] for b in batches]

    inline = list(StoreLoader([store_url], _cfg()).epoch(2, skip_batches=1))
    workers = list(StoreLoader([store_url], _cfg(workers=2)).epoch(2, skip_batches=1))
    assert refs(workers) == refs(inline) and len(inline) > 3
    for a, b in zip(inline, workers, strict=True):
        assert torch.equal(a.context, b.context) and torch.equal(a.topk_ids, b.topk_ids)


def test_read_units_leave_the_cache_once_all_their_samples_are_served(store_url):
    from dflash_train.train.data import _UnitReader

    loader = StoreLoader([store_url], _cfg(unit_cache_tokens=10**9))  # a bound never reached
    reader = _UnitReader({(i, p.index): p for i, p in loader.parts}, loader.cfg)
    plan = list(loader.plan(0))
    units = {(r.store, r.part, r.unit) for refs in plan for r in refs}
    held = []
    for refs in plan:
        batch = reader.load(refs)
        assert batch.num_tokens > 0
        held.append(len(reader.cache))
    assert len(units) > 4 and max(held) < len(units)  # never every unit at once
    assert not reader.cache and reader.cached_tokens == 0  # and none after the epoch


def test_glibc_mmap_threshold_is_pinned_unless_the_user_set_it(monkeypatch):
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert pin_mmap_threshold() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert pin_mmap_threshold() is True


def test_a_loader_closed_mid_epoch_leaves_no_prefetch_thread_working(store_url):
    """A run that stops at max_steps closes the loader while its thread builds the next
    batch; a thread left inside torch at interpreter exit can abort the finished process."""
    before = set(threading.enumerate())
    batches = StoreLoader([store_url], _cfg(prefetch_batches=2)).epoch(0)
    next(batches)
    started = set(threading.enumerate()) - before
    assert started, "the loader prefetches in a thread of its own"
    batches.close()
    assert not any(t.is_alive() for t in started)


def test_closing_the_prefetch_after_its_source_ended_does_not_wait_out_the_join():
    """The source ends while the queue is full (a run stopping at max_steps near an epoch's
    end): the thread must not block on putting its end marker while the consumer closes."""
    batches = prefetch(iter(range(2)), depth=1)
    assert next(batches) == 0
    time.sleep(0.5)  # the thread has put item 1 and waits to put its end marker
    start = time.monotonic()
    batches.close()
    assert time.monotonic() - start < PREFETCH_JOIN_S / 10
