"""validate() finds each kind of damage and names the part and sample it touches."""

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from dflash_train.store_schema import (
    StoreError,
    check_before_reading,
    create_store,
    open_store,
    validate,
)
from dflash_train.store_schema.integrity import refuse_unless_skipping
from dflash_train.store_schema.layout import SCHEMA_VERSION, part_path
from tests.store_schema.conftest import flip_bytes, make_meta, random_sample

SHARD = 1024
INNER = 256
LENGTHS = [100, 100, 100, 900, 700, 50, 600]  # tokens 0..2550; shards [0,1024) [1024,2048) ...


def _offsets():
    return np.concatenate([[0], np.cumsum(LENGTHS)])


def _samples_overlapping(start, stop):
    off = _offsets()
    return {i for i in range(len(LENGTHS)) if off[i] < stop and off[i + 1] > start}


@pytest.fixture
def store_path(tmp_path, gen) -> Path:
    url = tmp_path / "hs.zarr"
    store = create_store(str(url), make_meta(), shard_tokens=SHARD)
    writer = store.part_writer(0, 0, 100)
    for row, n in enumerate(LENGTHS):
        writer.append(random_sample(n, row, gen))
    writer.finish()
    assert validate(str(url)) == []
    return url


def _part(url: Path) -> zarr.Group:
    return zarr.open_group(str(url), mode="r+")[part_path(0)]


def test_flipped_byte_in_a_context_chunk_names_the_samples_of_that_chunk(store_path):
    shard_file = store_path / part_path(0) / "context" / "c" / "1" / "0" / "0"
    data = bytearray(shard_file.read_bytes())
    data[5] ^= 0x40  # inside the shard's first inner chunk: tokens [1024, 1280), layer 0
    shard_file.write_bytes(bytes(data))
    findings = validate(str(store_path))
    assert findings and {f.kind for f in findings} == {"checksum"}
    assert {f.part for f in findings} == {0}
    assert {f.sample for f in findings} == _samples_overlapping(1024, 1024 + INNER) == {3, 4}


def test_offsets_that_disagree_with_the_token_count_are_found(store_path):
    offsets = _part(store_path)["sample_offsets"]
    off = offsets[:]
    off[5] = off[4] - 1  # sample 4 now ends before it starts
    offsets[:] = off
    findings = validate(str(store_path))
    assert [(f.part, f.sample, f.kind) for f in findings] == [(0, 4, "offsets")]


def test_commit_record_claiming_more_tokens_than_stored_is_found(store_path):
    part = _part(store_path)
    record = dict(part.attrs["dflash_part"])
    record["committed_tokens"] += 7
    part.attrs["dflash_part"] = record
    findings = validate(str(store_path))
    assert findings and {f.kind for f in findings} == {"offsets"}
    assert all(f.part == 0 for f in findings)
    assert any("says 2557" in f.message for f in findings)


def test_nan_in_context_names_its_sample(store_path):
    context = _part(store_path)["context"]
    token = int(_offsets()[5]) + 10  # inside sample 5
    row = context[token]
    row[1, 2] = 0x7FC0  # a bfloat16 quiet NaN
    context[token] = row
    findings = validate(str(store_path))
    assert [(f.part, f.sample, f.kind) for f in findings] == [(0, 5, "nan")]


def test_schema_version_from_the_future_is_refused(store_path):
    meta_file = store_path / "zarr.json"
    doc = json.loads(meta_file.read_text())
    doc["attributes"]["dflash"]["schema_version"] = SCHEMA_VERSION + 1
    meta_file.write_text(json.dumps(doc))
    findings = validate(str(store_path))
    assert [(f.part, f.kind) for f in findings] == [(None, "schema")]
    message = findings[0].message
    assert f"schema version {SCHEMA_VERSION + 1}" in message and "Upgrade" in message


def test_complete_part_with_a_missing_shard_names_the_samples_it_held(store_path):
    (store_path / part_path(0) / "context" / "c" / "1" / "0" / "0").unlink()
    findings = validate(str(store_path))
    assert findings and {f.kind for f in findings} == {"missing"}
    assert {f.sample for f in findings} == _samples_overlapping(1024, 2048) == {3, 4, 5, 6}


def test_torn_commit_record_is_reported_not_raised(store_path):
    (store_path / part_path(0) / "zarr.json").write_text('{"zarr_format": 3, "node_ty')
    findings = validate(str(store_path))
    assert [(f.part, f.kind) for f in findings] == [(0, "record")]
    assert "unreadable" in findings[0].message


def test_a_crash_leftover_partial_file_is_not_a_part(store_path):
    # zarr's local writes go to '<name>.<hex>.partial' and are renamed into place; a SIGKILL
    # in between (e.g. while a new part's parent group metadata is rewritten) leaves one.
    (store_path / "parts" / "zarr.8d8ace2714084ada90e06ffbae715fc0.partial").write_text("{")
    assert validate(str(store_path)) == []
    assert [p.index for p in open_store(str(store_path)).parts()] == [0]


@pytest.mark.parametrize("name", ["sample_offsets", "sample_source"])
def test_corrupt_per_sample_array_is_a_finding_naming_part_and_array(store_path, name):
    flip_bytes(store_path / part_path(0) / name / "c" / "0")
    findings = validate(str(store_path))
    assert [(f.part, f.sample, f.kind) for f in findings] == [(0, None, "checksum")]
    assert name in findings[0].message
    assert validate(str(store_path), check_data=False) == findings  # readers' cheap check too


@pytest.mark.parametrize("name", ["sample_offsets", "sample_source"])
def test_reading_a_corrupt_per_sample_array_raises_store_error_naming_part_and_array(
        store_path, name):
    flip_bytes(store_path / part_path(0) / name / "c" / "0")
    part = open_store(str(store_path)).part(0)
    with pytest.raises(StoreError) as e:
        next(part.iter_samples())
    assert "part 0" in str(e.value) and name in str(e.value)
    assert "dflash store validate" in str(e.value)


def test_corrupt_offsets_are_whole_part_damage_that_skipping_steps_around(store_path):
    flip_bytes(store_path / part_path(0) / "sample_offsets" / "c" / "0")
    store = open_store(str(store_path))
    damage = check_before_reading(store, [0])
    assert [(d.part, d.sample) for d in damage] == [(0, None)]  # the whole part, skippable
    assert "sample_offsets" in damage[0].reason
    with pytest.raises(StoreError, match="--skip-corrupt"):
        refuse_unless_skipping(damage, skip=False)
    refuse_unless_skipping(damage, skip=True)
