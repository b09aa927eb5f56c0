"""The target rows and carried files: validate checks them, reading a damaged one is refused."""

from pathlib import Path

import pytest
import torch

from dflash_train.store_schema import (
    StoreError,
    check_before_reading,
    create_store,
    open_store,
    validate,
)
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
