"""Damage to a real store is found, named (part and sample, or part and metadata), and refused
by train and eval unless --skip-corrupt, which skips exactly the damaged samples and lists them.

Every case damages a copy of one small synthetic store (two complete parts, 24 samples): bytes
flipped in a context chunk, a truncated context shard, a truncated token chunk, a deleted
shard, and torn zarr.json files of a part group and of two arrays.
"""

import itertools
import json
import re

import pytest
import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.store_schema import check_before_reading, open_store, validate
from dflash_train.train.config import load_train_config
from dflash_train.train.data import StoreLoader
from dflash_train.train.loader_config import LoaderConfig
from dflash_train.train.loop import train
from tests.reliability.corrupt_store import (
    ALL_CASES,
    METADATA_CASES,
    SAMPLE_CASES,
    apply,
    copy_store,
    flip_context_bytes,
    make_store,
    offsets,
)

TOTAL_SAMPLES = 24
PART0_SAMPLES = 12
TRAIN_ARGS = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "4",
              "--epochs", "1", "--no-progress", "--set", "loader.prefetch_batches=0"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def clean_store(tmp_path_factory) -> str:
    return make_store(str(tmp_path_factory.mktemp("clean") / "hs.zarr"))


@pytest.fixture(scope="module")
def checkpoint(clean_store, tmp_path_factory) -> str:
    """A one-step drafter trained on the clean store (eval needs one that fits the store)."""
    out = tmp_path_factory.mktemp("ckpt")
    cfg = load_train_config(None, {"stores": [clean_store], "run.out_dir": str(out),
                                   "model.num_hidden_layers": 1, "optim.max_steps": 1,
                                   "loader.batch_tokens": 256, "run.anchors_per_seq": 4,
                                   "run.progress": False, "loader.prefetch_batches": 0})
    return str(train(cfg).checkpoint)


def _damaged(clean_store, tmp_path, case):
    url = copy_store(clean_store, tmp_path / "hs.zarr")
    return url, apply(case, url)


def _named_samples(text: str, part: int = 0) -> set[int]:
    return {int(m) for m in re.findall(rf"part {part} sample (\d+)\b", text)}


def _error_line(output: str) -> str:
    """The CLI's error: exactly one line, the last one, and no traceback."""
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    assert output.rstrip().splitlines()[-1] == errors[0], output
    return errors[0]


def _blames(text: str, url: str, blamed: set[int] | None) -> None:
    """The text names the store's part 0 and a damaged sample (or its metadata), nothing else."""
    assert url in text and "part 0" in text, text
    assert "part 1" not in text, text
    if blamed is None:
        assert "metadata" in text, text
    else:
        named = _named_samples(text)
        assert named and named <= blamed, (named, blamed, text)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_validate_exits_nonzero_naming_part_and_sample(clean_store, tmp_path, case):
    url, blamed = _damaged(clean_store, tmp_path, case)
    result = CliRunner().invoke(main, ["store", "validate", url])
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("part ")]
    assert problems and all(line.startswith("part 0") for line in problems), result.output
    if blamed is None:
        assert all(": [" in line and "metadata" in line for line in problems), result.output
    else:
        assert _named_samples(result.output) == blamed


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_train_refuses_a_damaged_store_in_one_line(clean_store, tmp_path, case):
    url, blamed = _damaged(clean_store, tmp_path, case)
    result = CliRunner().invoke(main, ["train", "--store", url, "--out", str(tmp_path / "run"),
                                       "--noise", "none", *TRAIN_ARGS])
    assert result.exit_code == 1, result.output
    error = _error_line(result.output)
    _blames(error, url, blamed)
    assert "--skip-corrupt" in error
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_noise_statistics_refuse_damaged_context_naming_it(clean_store, tmp_path):
    url = copy_store(clean_store, tmp_path / "hs.zarr")
    blamed = flip_context_bytes(url)
    result = CliRunner().invoke(main, ["train", "--store", url, "--out", str(tmp_path / "run"),
                                       *TRAIN_ARGS])  # default noise: statistics read first
    assert result.exit_code == 1, result.output
    error = _error_line(result.output)
    assert url in error and "part 0" in error and "part 1" not in error
    first, last = map(int, re.search(r"samples (\d+)\.\.(\d+)", error).groups())
    assert set(range(first, last + 1)) == blamed


def _skipped_file(run) -> set[tuple[int, int | None]]:
    lines = (run / "skipped.jsonl").read_text().splitlines()
    return {(d["part"], d["sample"]) for d in map(json.loads, lines)}


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_train_skip_corrupt_skips_exactly_the_damaged_samples(clean_store, tmp_path, case):
    url, blamed = _damaged(clean_store, tmp_path, case)
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--store", url, "--out", str(run),
                                       "--skip-corrupt", *TRAIN_ARGS])
    assert result.exit_code == 0, result.output
    expected = {(0, None)} if blamed is None else {(0, s) for s in blamed}
    assert _skipped_file(run) == expected
    assert f"skipped {len(expected)} damaged" in result.output
    log = [json.loads(line) for line in (run / "log.jsonl").open()]
    # One epoch: every sample is met once; a damaged part is never planned at all.
    assert sum(r["skipped"] for r in log) == (0 if blamed is None else len(blamed))
    trained = sum(r["samples"] for r in log)
    assert trained == TOTAL_SAMPLES - (PART0_SAMPLES if blamed is None else len(blamed))


def _batches(url, world, skip):
    cfg = LoaderConfig(batch_tokens=128, prefetch_batches=0, skip_corrupt=skip)
    return [list(StoreLoader([url], cfg, rank=r, world=world).epoch(0)) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2])
def test_a_skipped_sample_leaves_every_other_sample_in_its_batch_rank_and_step(
        clean_store, tmp_path, world):
    url = copy_store(clean_store, tmp_path / "hs.zarr")
    blamed = flip_context_bytes(url)
    clean, damaged = _batches(clean_store, world, False), _batches(url, world, True)
    seen_skipped = set()
    for rank in range(world):
        assert len(clean[rank]) == len(damaged[rank])
        for a, b in zip(clean[rank], damaged[rank], strict=True):
            if a is None:  # a global batch with no sample for this rank, either way
                assert b is None
                continue
            kept = [r for r in a.refs if not (r.part == 0 and r.index in blamed)]
            assert b.refs == kept
            seen_skipped |= {d.sample for d in b.skipped}
            assert all(d.part == 0 for d in b.skipped)
            for row, ref in enumerate(b.refs):  # the data read is that of the clean store
                n = ref.length
                i = a.refs.index(ref)
                assert torch.equal(b.input_ids[row, :n], a.input_ids[i, :n])
                assert torch.equal(b.context[row, :n], a.context[i, :n])
    assert seen_skipped == blamed


def test_structural_check_reads_no_chunk_data(clean_store, tmp_path):
    url = copy_store(clean_store, tmp_path / "hs.zarr")
    tokens = ("input_ids", "loss_mask", "context", "verifier_topk_ids",
              "verifier_topk_logits", "verifier_lse")
    for part, name in itertools.product((0, 1), tokens):  # all token data damaged, none missing
        for chunk in (tmp_path / "hs.zarr" / "parts" / f"{part:05d}" / name).glob("c/**/*"):
            if chunk.is_file():
                data = bytearray(chunk.read_bytes())
                data[len(data) // 2] ^= 0xFF
                chunk.write_bytes(bytes(data))
    store = open_store(url)
    assert check_before_reading(store, [0, 1]) == []  # it never read a chunk
    assert {f.part for f in validate(url)} == {0, 1}  # reading them finds every part damaged
    assert len(offsets(url)) == PART0_SAMPLES + 1  # what it reads: offsets, still sound


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_eval_refuses_a_damaged_store_in_one_line(clean_store, checkpoint, tmp_path, case):
    url, blamed = _damaged(clean_store, tmp_path, case)
    result = CliRunner().invoke(main, ["eval", checkpoint, "--store", url, "--no-progress"])
    assert result.exit_code == 1, result.output
    error = _error_line(result.output)
    _blames(error, url, blamed)
    assert "--skip-corrupt" in error


@pytest.mark.parametrize("case", [SAMPLE_CASES[0], SAMPLE_CASES[3], METADATA_CASES[1]],
                         ids=lambda c: c.name)
def test_eval_skip_corrupt_reports_the_skipped_samples(clean_store, checkpoint, tmp_path, case):
    url, blamed = _damaged(clean_store, tmp_path, case)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["eval", checkpoint, "--store", url, "--no-progress",
                                       "--skip-corrupt", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "SKIPPED as damaged" in result.output
    report = json.loads((out / "report.json").read_text())
    listed = {(d["part"], d["sample"]) for d in report["skipped"]["skipped"]}
    if blamed is None:
        assert listed == {(0, None)} and report["skipped"]["parts"] == 1
        assert report["samples"] == TOTAL_SAMPLES - PART0_SAMPLES
    else:
        assert listed == {(0, s) for s in blamed}
        assert report["skipped"]["samples"] == len(blamed)
        assert report["samples"] == TOTAL_SAMPLES - len(blamed)
