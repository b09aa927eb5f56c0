"""Several processes, one store: 4 ranks produce one process's arrays, and a part held by one
process is never written by a second one started on it."""

import re
import subprocess

import pytest

from dflash_train.store_schema import open_store, validate
from tests.reliability.extract_faults import STALL_AT_COMMIT
from tests.reliability.extract_support import (
    NUM_ROWS,
    REPO,
    child_env,
    cli_args,
    cli_command,
    committed_rows,
    differences,
    duplicates_and_losses,
    run_in_process,
    shared_inputs,
    stored_samples,
)

ROWS_PER_PART = 3  # 14 rows -> 5 parts, so every one of 4 ranks has work and rank 0 has two


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return shared_inputs(tmp_path_factory.getbasetemp())


def _start(args: list[str], *, stdin=None, **env) -> subprocess.Popen:
    return subprocess.Popen(cli_command(args), env=child_env(**env), cwd=REPO, text=True,
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _parts_written(stdout: str) -> list[int]:
    found = re.search(r"parts written: (\[[\d, ]*\]|none)", stdout)
    assert found, stdout
    return [] if found[1] == "none" else [int(x) for x in re.findall(r"\d+", found[1])]


def test_four_ranks_into_one_store_equal_one_process(inputs, tmp_path):
    single = str(tmp_path / "single.zarr")
    run_in_process(*inputs, single, rows_per_part=ROWS_PER_PART)
    shared = str(tmp_path / "shared.zarr")
    args = cli_args(*inputs, shared, rows_per_part=ROWS_PER_PART)
    ranks = [_start(args, RANK=r, WORLD_SIZE=4, OMP_NUM_THREADS=1) for r in range(4)]
    outputs = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0] * 4, [e[-2000:] for _, e in outputs]
    written = [_parts_written(o) for o, _ in outputs]
    assert written == [[0, 4], [1], [2], [3]]
    store = open_store(shared)
    assert store.complete and validate(shared) == []
    got = stored_samples(shared)
    assert duplicates_and_losses([s.source_row for s in got], range(NUM_ROWS)) == ([], [])
    assert differences(got, stored_samples(single)) == []
    assert store.meta.mismatches(open_store(single).meta) == []


def test_a_second_process_on_a_held_part_does_not_write_it(inputs, tmp_path):
    out = str(tmp_path / "hs.zarr")
    args = cli_args(*inputs, out)
    # the holder's writer stops before part 0's first shard commit (record 1 creates it)
    holder = _start(args, stdin=subprocess.PIPE, **{STALL_AT_COMMIT: 2})
    assert holder.stdout.readline().strip() == "STALLED", holder.stderr.read()[-2000:]
    second = _start(args)
    try:
        out2, err2 = second.communicate(timeout=120)
        waited = False
    except subprocess.TimeoutExpired:  # a design that makes the second one wait is fine too
        waited = True
    if not waited:  # nothing of part 0 (or any part) committed by the second process
        assert committed_rows(out) == [], err2[-2000:]
    holder.stdin.write("\n")
    holder.stdin.flush()
    out1, err1 = holder.communicate(timeout=300)
    assert holder.returncode == 0, err1[-2000:]
    assert 0 in _parts_written(out1)
    if waited:
        out2, err2 = second.communicate(timeout=300)
        assert second.returncode == 0 and 0 not in _parts_written(out2), out2
    else:
        last = err2.strip().splitlines()[-1]
        assert second.returncode == 1 and last.startswith("Error: "), err2[-2000:]
        assert "another process" in last and out in last and re.search(r"part[- ]0*0\b", last)
    assert open_store(out).complete and validate(out) == []
    rows = [s.source_row for s in stored_samples(out)]
    assert duplicates_and_losses(rows, range(NUM_ROWS)) == ([], [])
