"""SIGKILL at any point, re-run the same command: the store equals an uninterrupted run's."""

import json
import shutil
from pathlib import Path

import pytest
import zarr
from conftest import assert_same_samples, cli_args, run_cli, run_extract_cfg, store_samples

from dflash_train.extract.writer import KILL_AFTER_ENV
from dflash_train.store_schema import StoreError, open_store, validate


def _complete(out: str) -> bool:
    try:
        return open_store(out).complete
    except StoreError:  # a part whose creation the kill tore: incomplete, resumable
        return False


@pytest.fixture(scope="module")
def reference(qwen3_5_dir, chats_jsonl, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref") / "hs.zarr")
    run_extract_cfg(qwen3_5_dir, chats_jsonl, out)
    return store_samples(out)


@pytest.mark.parametrize("kills", [(1,), (7,), (3, 9)], ids=lambda k: "kill-after-" + "-".join(
    map(str, k)))
def test_rerun_after_sigkill_equals_an_uninterrupted_run(kills, reference, qwen3_5_dir,
                                                         chats_jsonl, tmp_path):
    out = str(tmp_path / "hs.zarr")
    args = cli_args(qwen3_5_dir, chats_jsonl, out)
    for n in kills:
        killed = run_cli(args, **{KILL_AFTER_ENV: str(n)})
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert not _complete(out)
    run_extract_cfg(qwen3_5_dir, chats_jsonl, out)  # the same settings, in-process
    assert open_store(out).complete and validate(out) == []
    assert_same_samples(store_samples(out), reference)


def test_rerun_of_a_finished_store_changes_nothing(reference, qwen3_5_dir, chats_jsonl,
                                                   tmp_path):
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_5_dir, chats_jsonl, out)
    summary = run_extract_cfg(qwen3_5_dir, chats_jsonl, out)
    assert summary.parts_done == [] and summary.parts_already_complete == [0, 1, 2]
    assert_same_samples(store_samples(out), reference)


def test_the_same_model_spelled_another_way_resumes(qwen3_dir, chats_jsonl, tmp_path,
                                                    monkeypatch):
    from pathlib import Path

    out = str(tmp_path / "hs.zarr")
    model = Path(qwen3_dir)
    monkeypatch.chdir(model.parent)
    run_extract_cfg(model.name, chats_jsonl, out, rows_per_part=20)  # relative path
    store = open_store(out)
    assert store.meta.target.name_or_path == str(model.resolve())
    monkeypatch.chdir(tmp_path)
    again = run_extract_cfg(str(model.resolve()), chats_jsonl, out, rows_per_part=20)
    assert again.parts_already_complete == [0]


def test_the_same_data_moved_resumes_and_other_data_is_refused(qwen3_dir, chats_jsonl,
                                                               tmp_path):
    """The data is known by its sha256, not its path: a run moved with its data (a new
    directory, a new mount) continues; other bytes at the old path do not mix in."""
    from dflash_train.extract.errors import ExtractError

    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, chats_jsonl, out, rows_per_part=20)
    moved = tmp_path / "moved" / "chats.jsonl"
    moved.parent.mkdir()
    shutil.copy(chats_jsonl, moved)
    again = run_extract_cfg(qwen3_dir, str(moved), out, rows_per_part=20)
    assert again.parts_already_complete == [0]
    rows = [json.loads(line) for line in Path(chats_jsonl).read_text().splitlines()]
    rows[0]["messages"][0]["content"] += " edited"
    moved.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ExtractError, match="(?s)made differently.*source.sha256"):
        run_extract_cfg(qwen3_dir, str(moved), out, rows_per_part=20)


def test_a_store_from_before_the_frozen_record_missing_a_tokenizer_file_is_made_whole(
        qwen3_5_dir, chats_jsonl, tmp_path):
    """What an older extract left when a kill fell among the tokenizer files and the resume
    took the tokenizer for written: the next run writes the frozen unit again, with its
    record, and the file is back."""
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_5_dir, chats_jsonl, out)
    want = open_store(out).read_files("tokenizer")
    assert "tokenizer_config.json" in want
    del zarr.open_group(out, mode="r+").attrs["dflash_frozen"]
    shutil.rmtree(Path(out) / "files" / "tokenizer" / "tokenizer_config.json")
    assert open_store(out).frozen_record().state == "unrecorded" and validate(out) == []

    summary = run_extract_cfg(qwen3_5_dir, chats_jsonl, out)
    assert summary.parts_already_complete == [0, 1, 2]
    again = open_store(out)
    assert again.frozen_record().state == "whole" and validate(out) == []
    assert again.read_files("tokenizer") == want
