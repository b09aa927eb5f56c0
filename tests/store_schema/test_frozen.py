"""The target rows and carried files: validate checks them against the frozen unit's record,
reading a damaged one is refused, a unit cut short is refused and written again whole."""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import zarr
from click.testing import CliRunner

from dflash_train.store_schema import (
    Store,
    StoreError,
    check_before_reading,
    create_store,
    open_store,
    validate,
)
from dflash_train.store_schema.command import store as store_command
from dflash_train.store_schema.frozen import frozen_written, write_frozen
from tests.store_schema.conftest import HIDDEN, VOCAB, flip_bytes, make_meta

CONFIG = b'{"model_type": "qwen3_5", "hidden_size": 16, "note": "' + b"x" * 200 + b'"}'


@pytest.fixture
def store_path(tmp_path, gen) -> Path:
    url = tmp_path / "hs.zarr"
    store = create_store(str(url), make_meta(num_parts=1), shard_tokens=64)
    store.write_target_rows(torch.randn(VOCAB, HIDDEN, generator=gen),
                            torch.randn(VOCAB, HIDDEN, generator=gen),
                            torch.rand(HIDDEN, generator=gen) + 0.5)
    store.write_files("target", {"config.json": CONFIG})
    assert validate(str(url)) == []
    return url


@pytest.mark.parametrize("name", ["embed_tokens", "lm_head", "final_norm"])
def test_corrupt_target_row_is_found_by_validate_and_refused_by_readers(store_path, name):
    chunk = next(p for p in (store_path / "target" / name / "c").rglob("*") if p.is_file())
    flip_bytes(chunk)
    findings = validate(str(store_path))
    assert [(f.part, f.kind) for f in findings] == [(None, "checksum")]
    assert f"target/{name}" in findings[0].message
    with pytest.raises(StoreError, match=f"target/{name}"):
        open_store(str(store_path)).target_rows()


def test_corrupt_carried_file_is_found_by_validate_and_refused_by_readers(store_path):
    store = open_store(str(store_path))
    assert store.read_files("target") == {"config.json": CONFIG}
    flip_bytes(store_path / "files" / "target" / "config.json" / "c" / "0")
    findings = validate(str(store_path))
    assert [(f.part, f.kind) for f in findings] == [(None, "checksum")]
    assert "files/target/config.json" in findings[0].message
    with pytest.raises(StoreError, match="files/target/config.json"):
        store.read_files("target")


def test_missing_target_chunk_is_refused_not_read_as_zeros(store_path):
    (store_path / "target" / "final_norm" / "c" / "0").unlink()
    damage = check_before_reading(open_store(str(store_path)), [])
    assert [(d.part, d.sample) for d in damage] == [(None, None)]  # no skipping around it
    assert "target/final_norm" in damage[0].reason and "missing" in damage[0].reason
    with pytest.raises(StoreError, match="target/final_norm"):
        open_store(str(store_path)).target_rows()


def test_torn_metadata_of_a_carried_file_is_named(store_path):
    (store_path / "files" / "target" / "config.json" / "zarr.json").write_text('{"zarr_fo')
    findings = validate(str(store_path), check_data=False)
    assert [(f.part, f.kind) for f in findings] == [(None, "metadata")]
    assert "files/target/config.json" in findings[0].message
    with pytest.raises(StoreError, match="files/target/config.json"):
        open_store(str(store_path)).read_files("target")


# -- the frozen unit: committed whole, checked against its record --------------------------

TOKENIZER = {"tokenizer.json": b'{"model": {"vocab": {"a": 0}}}',
             "tokenizer_config.json": b'{"model_max_length": 4096}',
             "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
             "empty.txt": b""}


def _unit(gen) -> tuple[dict, dict]:
    rows = {"embed_tokens": torch.randn(VOCAB, HIDDEN, generator=gen),
            "lm_head": torch.randn(VOCAB, HIDDEN, generator=gen),
            "final_norm": torch.rand(HIDDEN, generator=gen) + 0.5}
    return rows, {"target": {"config.json": CONFIG}, "tokenizer": dict(TOKENIZER)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def whole(tmp_path, gen) -> Path:
    url = tmp_path / "whole.zarr"
    store = create_store(str(url), make_meta(num_parts=1), shard_tokens=64)
    write_frozen(store, *_unit(gen))
    return url


def test_the_record_holds_the_sha256_of_every_kept_file_and_target_row(whole):
    rows, _ = _unit(torch.Generator().manual_seed(0))  # the `whole` fixture's rows
    record = open_store(str(whole)).frozen_record()
    assert record.state == "whole"
    want = {f"files/tokenizer/{n}": _sha(d) for n, d in TOKENIZER.items()}
    want["files/target/config.json"] = _sha(CONFIG)
    for name, t in rows.items():  # bf16 store: the rows' stored bits
        want[f"target/{name}"] = _sha(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    assert record.sha256 == want
    assert validate(str(whole)) == []
    assert open_store(str(whole)).read_files("tokenizer") == TOKENIZER


@pytest.mark.parametrize("name", sorted(TOKENIZER))
def test_validate_and_readers_name_a_removed_tokenizer_file(whole, name):
    shutil.rmtree(whole / "files" / "tokenizer" / name)
    for check_data in (True, False):  # readers run the cheap check; it lists names
        findings = validate(str(whole), check_data=check_data)
        assert [(f.kind, f.message.split()[0]) for f in findings] == [
            ("missing", f"files/tokenizer/{name}")]
    result = CliRunner().invoke(store_command, ["validate", str(whole)])
    assert result.exit_code == 1 and f"files/tokenizer/{name} is missing" in result.output
    with pytest.raises(StoreError, match=f"files/tokenizer/{name}"):
        open_store(str(whole)).read_files("tokenizer")


def test_validate_and_readers_name_a_changed_file_whose_checksums_still_hold(whole):
    arr = zarr.open_array(str(whole / "files" / "tokenizer" / "tokenizer_config.json"),
                          mode="r+")
    arr[0] = ord("[")  # rewritten through zarr: every chunk's crc32c is valid
    findings = validate(str(whole))
    assert [(f.kind, f.message.split()[0]) for f in findings] == [
        ("differs", "files/tokenizer/tokenizer_config.json")]
    result = CliRunner().invoke(store_command, ["validate", str(whole)])
    assert result.exit_code == 1 and "tokenizer_config.json differs" in result.output
    with pytest.raises(StoreError, match="tokenizer_config.json differs"):
        open_store(str(whole)).read_files("tokenizer")


def test_validate_names_a_changed_target_row_and_a_file_added_after(whole):
    norm = zarr.open_array(str(whole / "target" / "final_norm"), mode="r+")
    norm[3] = norm[3] ^ 1  # one bit of one bf16 value
    open_store(str(whole), mode="r+").write_files("tokenizer", {"added.txt": b"x"})
    findings = validate(str(whole))
    assert sorted((f.kind, f.message.split()[0]) for f in findings) == [
        ("differs", "target/final_norm"), ("unexpected", "files/tokenizer/added.txt")]


def test_a_unit_cut_short_is_refused_by_readers_and_written_again_whole(tmp_path, gen,
                                                                         monkeypatch):
    url = str(tmp_path / "hs.zarr")
    store = create_store(url, make_meta(num_parts=1), shard_tokens=64)
    rows, files = _unit(gen)
    real = Store.write_files

    def crash_at_the_tokenizer(self, group, named):
        if group == "tokenizer":
            real(self, group, dict(list(named.items())[:1]))  # one file on disk, as at a kill
            raise KeyboardInterrupt
        return real(self, group, named)

    monkeypatch.setattr(Store, "write_files", crash_at_the_tokenizer)
    with pytest.raises(KeyboardInterrupt):
        write_frozen(store, rows, files)
    monkeypatch.undo()
    cut = open_store(url)
    assert cut.frozen_record().state == "unfinished" and not frozen_written(cut, files)
    for read in (cut.target_rows, lambda: cut.read_files("tokenizer"),
                 lambda: cut.read_files("target")):
        with pytest.raises(StoreError, match="creation was cut short.*re-run the same"):
            read()
    assert validate(url) == []  # work in flight, not damage
    info = CliRunner().invoke(store_command, ["info", url])
    assert "INCOMPLETE" in info.output and "target rows and files not all written" in info.output
    strict = CliRunner().invoke(store_command, ["validate", url, "--require-complete"])
    assert strict.exit_code == 1 and "target rows and files not all written" in strict.output
    copy = CliRunner().invoke(store_command, ["convert", url, str(tmp_path / "copy.zarr")])
    assert copy.exit_code == 1 and "target rows and files not all written" in copy.output

    write_frozen(open_store(url, mode="r+"), rows, files)
    again = open_store(url)
    assert frozen_written(again, files) and validate(url) == []
    assert again.read_files("tokenizer") == TOKENIZER
    assert torch.equal(again.target_rows()["lm_head"], rows["lm_head"].to(torch.bfloat16))


def test_a_store_made_before_the_record_opens_and_validates_within_its_limits(tmp_path, gen):
    url = str(tmp_path / "old.zarr")
    store = create_store(url, make_meta(num_parts=1), shard_tokens=64)
    rows, files = _unit(gen)
    store.write_target_rows(rows["embed_tokens"], rows["lm_head"], rows["final_norm"])
    for group, named in files.items():  # piece by piece, as dflash wrote before the record
        store.write_files(group, named)
    old = open_store(url)
    assert old.frozen_record().state == "unrecorded" and validate(url) == []
    assert old.read_files("tokenizer") == TOKENIZER and frozen_written(old, files)
    result = CliRunner().invoke(store_command, ["validate", url])
    assert result.exit_code == 0
    assert "made before dflash recorded the sha256 of its target rows and files" in \
        result.output
    # the store older extract left when a kill fell among the tokenizer files: written again
    shutil.rmtree(Path(url) / "files" / "tokenizer" / "tokenizer_config.json")
    assert not frozen_written(open_store(url), files)


def test_a_malformed_record_is_named_by_validate_and_readers(whole):
    zarr.open_group(str(whole), mode="r+").attrs["dflash_frozen"] = {"complete": "yes"}
    findings = validate(str(whole))
    assert [f.kind for f in findings] == ["record"] and "dflash_frozen" in findings[0].message
    with pytest.raises(StoreError, match="dflash_frozen"):
        open_store(str(whole)).target_rows()


def test_on_an_object_store_a_unit_cut_short_is_written_again_whole(gen, monkeypatch):
    url = "memory://dflash-frozen/hs.zarr"  # fsspec: no rename, deletes by prefix
    store = create_store(url, make_meta(num_parts=1), shard_tokens=64)
    rows, files = _unit(gen)
    monkeypatch.setattr(Store, "write_files", lambda *a: (_ for _ in ()).throw(OSError(5, "x")))
    with pytest.raises(OSError):
        write_frozen(store, rows, files)
    monkeypatch.undo()
    assert open_store(url).frozen_record().state == "unfinished"
    write_frozen(open_store(url, mode="r+"), rows, files)
    assert validate(url) == [] and open_store(url).read_files("tokenizer") == TOKENIZER
