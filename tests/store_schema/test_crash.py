"""A writer killed at any moment leaves a part that says exactly what it holds, and resumes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_train.store_schema import open_store, validate
from dflash_train.store_schema.layout import SAMPLE_ARRAYS, TOKEN_ARRAYS
from tests.store_schema.conftest import assert_same_sample
from tests.store_schema.writer_process import row_sample, write_rows

ROWS = 120
REPO = Path(__file__).resolve().parents[2]


def _kill_after(url: str, appended: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.store_schema.writer_process", url, str(ROWS)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if int(line) >= appended:
            break  # the writer is still busy appending: the kill lands mid-flight
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _all_arrays(url: str) -> dict[str, np.ndarray]:
    part = open_store(url).part(0)
    names = [a.name for a in TOKEN_ARRAYS] + list(SAMPLE_ARRAYS)
    return {n: part.array(n)[...] for n in names}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, np.ndarray]:
    url = str(tmp_path_factory.mktemp("ref") / "hs.zarr")
    write_rows(url, ROWS)
    return _all_arrays(url)


@pytest.mark.parametrize("kill_after", [3, 40, 97])
def test_killed_writer_leaves_committed_counters_matching_disk(tmp_path, reference, kill_after):
    url = str(tmp_path / "hs.zarr")
    _kill_after(url, kill_after)

    store = open_store(url)
    part = store.part(0)
    assert not part.complete
    assert part.num_samples <= kill_after + 1
    assert validate(url) == []  # nothing committed is torn, missing or unreadable
    offsets = part.offsets()
    assert len(offsets) == part.num_samples + 1 and offsets[-1] == part.num_tokens
    assert part.sources().tolist() == list(range(part.num_samples))
    for i, s in enumerate(part.iter_samples()):
        assert_same_sample(row_sample(i), s)

    write_rows(url, ROWS)  # the same command again resumes and finishes
    final = _all_arrays(url)
    assert final.keys() == reference.keys()
    for name in reference:
        assert np.array_equal(final[name], reference[name]), name
    assert open_store(url).part(0).complete and validate(url) == []


def test_resumed_writer_removes_its_parts_torn_temp_files_and_no_one_elses(tmp_path):
    url = str(tmp_path / "hs.zarr")
    write_rows(url, 5)
    # what zarr's atomic write leaves when a crash cuts it short: a temp file never renamed
    mine = Path(url) / "parts" / "00000" / "context" / "c" / "0" / "0" / "zarr.1a2b.partial"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_bytes(b"half a chunk")
    other = Path(url) / "parts" / "zarr.3c4d.partial"  # the parts group: not part 0's to clear
    other.write_bytes(b"{")
    open_store(url, mode="r+").part_writer(0, 0, 5)
    assert not mine.exists() and other.exists()
    assert validate(url) == []
