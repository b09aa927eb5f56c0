"""`dflash eval` refuses what cannot work before it evaluates anything, in one line each:
unusable stores, unfinished parts, output paths, options without their mode, devices."""

import json
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

import dflash_train.evaluate.pipeline as pipeline
from dflash_train.evaluate.command import eval_command
from dflash_train.store_schema import create_store, open_store
from tests.evaluate.conftest import synthetic_meta, synthetic_sample

SHARD = 64


def _run(*args):
    return CliRunner().invoke(eval_command, [*map(str, args), "--no-progress"],
                              catch_exceptions=False)


def _samples(rows, length, gen, *, anchors=True):
    """Samples whose second half is response; anchors=False: isolated response tokens only,
    so no position a has a response token at a+1 (no block can be drafted)."""
    out = []
    for row in rows:
        ids = torch.randint(10, 300, (length,), generator=gen).tolist()
        mask = [i >= length // 2 if anchors else i % 2 == 1 for i in range(length)]
        out.append(synthetic_sample(ids, mask, ids[1:] + [ids[0]], row, gen))
    return out


def _store(url, parts: list[tuple[list, bool]]):
    """A float32 store with one part per (samples, finished); part p holds rows [100p, 100p+100).

    An unfinished part keeps the samples its writer committed (whole shards of SHARD
    tokens), as extraction cut short or still running leaves it."""
    meta = replace(synthetic_meta(regenerated=True), num_parts=len(parts))
    store = create_store(url, meta, shard_tokens=SHARD)
    gen = torch.Generator().manual_seed(7)
    store.write_target_rows(torch.randn(344, 64, generator=gen),
                            torch.randn(344, 64, generator=gen), torch.ones(64))
    for p, (samples, finished) in enumerate(parts):
        writer = store.part_writer(p, 100 * p, 100 * p + 100)
        for s in samples:
            writer.append(s)
        if finished:
            writer.finish()
    return url


@pytest.fixture
def no_evaluation(monkeypatch):
    """Fails the test if a drafter forward is reached."""
    def reached(*args, **kwargs):
        raise AssertionError("evaluation ran before the refusal")

    monkeypatch.setattr(pipeline, "evaluate_offline", reached)


def test_unfinished_parts_are_named_and_left_out_like_train(tmp_path, random_drafter_dir):
    gen = torch.Generator().manual_seed(0)
    done = _samples([0, 1, 2], 32, gen)
    url = _store(str(tmp_path / "s.zarr"), [(done, True), (_samples([100, 101, 102, 103], 32,
                                                                     gen), False)])
    parts = open_store(url).parts()
    assert [p.complete for p in parts] == [True, False] and parts[1].num_samples >= 2
    out = tmp_path / "out"
    result = _run("--store", url, "--json", "--out", out, random_drafter_dir)
    assert result.exit_code == 0, result.output
    assert "leaving out unfinished parts [1]" in result.stderr
    report = json.loads(result.stdout)
    assert report["samples"] == len(done)
    rows = pq.read_table(out / "blocks.parquet").to_pydict()
    assert set(rows["part"]) == {0}
    assert set(rows["sample"]) == set(range(len(done)))


@pytest.mark.parametrize("case, words", [
    ("only_unfinished", "no sample to evaluate (parts [0] are unfinished"),
    ("no_samples", "no sample to evaluate (it holds no committed sample)"),
    ("no_response", "none of the 2 samples has a response token"),
])
def test_a_store_with_no_usable_sample_exits_1(tmp_path, random_drafter_dir, case, words):
    gen = torch.Generator().manual_seed(1)
    parts = {"only_unfinished": [(_samples([0, 1, 2], 32, gen), False)],
             "no_samples": [([], True)],
             "no_response": [(_samples([0, 1], 32, gen, anchors=False), True)]}[case]
    url = _store(str(tmp_path / "s.zarr"), parts)
    result = _run("--store", url, random_drafter_dir)
    assert result.exit_code == 1
    assert words in result.output
    assert "tau" not in result.stdout and "Traceback" not in result.output


def test_output_paths_are_refused_before_evaluating(tmp_path, regen_store, random_drafter_dir,
                                                    no_evaluation):
    existing = tmp_path / "report.txt"
    existing.write_text("keep me")
    cases = [
        (["--out", existing], f"--out {existing}: exists and is not a directory"),
        (["--out", existing / "sub"], f"{existing} is a file, not a directory"),
        (["--plot", tmp_path / "nodir" / "x.png"], f"directory {tmp_path / 'nodir'} does "
                                                   "not exist"),
        (["--plot", tmp_path], "is a directory"),
        (["--plot", tmp_path / "x.notaformat"], "cannot write .notaformat files"),
    ]
    for args, words in cases:
        result = _run("--store", regen_store, *args, random_drafter_dir)
        assert result.exit_code == 1, result.output
        assert words in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert existing.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.txt"]


def test_a_checkpoint_path_that_does_not_exist_is_named(tmp_path, regen_store):
    missing = tmp_path / "nope"
    result = _run("--store", regen_store, missing)
    assert result.exit_code == 1
    assert f"{missing}: does not exist" in result.output
    assert "config.json" not in result.output


@pytest.mark.parametrize("args", [["--model", "some/target"], ["--max-new-tokens", "8"]])
def test_online_options_without_online_are_refused(regen_store, random_drafter_dir,
                                                   no_evaluation, args):
    result = _run("--store", regen_store, *args, random_drafter_dir)
    assert result.exit_code == 1
    assert f"{args[0]} only applies to --online or --served" in result.output


def test_cuda_without_cuda_is_a_one_line_error(monkeypatch, regen_store, random_drafter_dir,
                                               no_evaluation):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, words in (("cuda", "sees no CUDA device on this machine; pass --device cpu"),
                          ("cuda:1", "sees no CUDA device"),
                          ("tpu", "not a device")):
        result = _run("--store", regen_store, "--device", device, random_drafter_dir)
        assert result.exit_code == 1, result.output
        assert words in result.output and "Traceback" not in result.output


def test_auto_device_falls_back_to_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pipeline.resolve_device("auto", pipeline.EvalError) == torch.device("cpu")


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_store_left_empty_by_damage_points_to_validate_not_to_extraction(tmp_path,
                                                                          random_drafter_dir):
    gen = torch.Generator().manual_seed(2)
    url = _store(str(tmp_path / "s.zarr"), [(_samples([0, 1], 32, gen), True)])
    _flip(tmp_path / "s.zarr" / "parts" / "00000" / "sample_offsets" / "c" / "0")
    result = _run("--store", url, "--skip-corrupt", random_drafter_dir)
    assert result.exit_code == 1
    assert "parts [0] are damaged" in result.output
    assert f"dflash store validate {url}" in result.output
    assert "finish extraction" not in result.output


def test_a_damaged_store_tokenizer_is_named_not_silently_dropped(tmp_path, random_drafter_dir):
    gen = torch.Generator().manual_seed(3)
    url = _store(str(tmp_path / "s.zarr"), [(_samples([0, 1], 32, gen), True)])
    store = open_store(url, mode="r+")
    store.write_files("tokenizer", {"tokenizer.json": b'{"version": "1.0", "pad": "' +
                                    b"x" * 300 + b'"}'})
    chunk = next(p for p in (tmp_path / "s.zarr" / "files" / "tokenizer" / "tokenizer.json"
                             / "c").rglob("*") if p.is_file())
    _flip(chunk)
    result = _run("--store", url, "--show", "1", random_drafter_dir)
    assert result.exit_code == 1
    assert "files/tokenizer/tokenizer.json" in result.output
    assert "Traceback" not in result.output
