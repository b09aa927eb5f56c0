"""Disk full / permission denied on the output: one clear line naming the store and the cause,
a non-zero exit, and a re-run (the fault gone) that resumes to an uninterrupted run's arrays.

The tests run as root, where chmod blocks nothing, so the OSError is injected at zarr's write
layer in the extract process (tests/reliability/extract_faults.py).
"""

import errno
import os

import pytest

from dflash_train.store_schema import validate
from tests.reliability.extract_faults import ERRNO_AT_WRITE
from tests.reliability.extract_support import (
    NUM_ROWS,
    cli_args,
    committed_rows,
    differences,
    duplicates_and_losses,
    is_complete,
    run_cli,
    run_in_process,
    shared_inputs,
    shared_reference,
    stored_samples,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return shared_inputs(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_reference(tmp_path_factory.getbasetemp())


# A fresh run makes ~445 store writes: write 230 falls inside part 1, after part 0 is complete;
# write 3 is while the store itself is being created.
@pytest.mark.parametrize("name, at", [("ENOSPC", 230), ("EACCES", 3)])
def test_refused_store_write_is_one_line_and_the_rerun_resumes(name, at, inputs, reference,
                                                               tmp_path):
    out = str(tmp_path / "hs.zarr")
    failed = run_cli(cli_args(*inputs, out), **{ERRNO_AT_WRITE: f"{name}@{at}"})
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: --out {out}: cannot write the store"), last
    assert os.strerror(getattr(errno, name)) in last and out in last.split(" at ", 1)[1]
    assert "re-run the same command to resume" in last
    assert not is_complete(out)
    rows = committed_rows(out)
    assert duplicates_and_losses(rows, range(0)) == ([], []) and len(rows) < NUM_ROWS

    run_in_process(*inputs, out)  # the disk has room again
    assert is_complete(out) and validate(out) == []
    got = stored_samples(out)
    assert duplicates_and_losses([s.source_row for s in got], range(NUM_ROWS)) == ([], [])
    assert differences(got, reference) == []
