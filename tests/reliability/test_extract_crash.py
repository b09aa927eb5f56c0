"""SIGKILL `dflash extract` at seeded pseudo-random points, resume each time: nothing is lost,
nothing is duplicated, and the arrays equal an uninterrupted run's bit for bit."""

import random

import pytest

from dflash_train.extract.writer import KILL_AFTER_ENV
from dflash_train.store_schema import validate
from tests.reliability.extract_faults import KILL_AT_WRITE, TORN_COMMIT
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

SEED = 9


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return shared_inputs(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_reference(tmp_path_factory.getbasetemp())


def kill_plan(rng: random.Random) -> list[tuple[str, int]]:
    """Three kills: a torn part commit record, after some appends, before some store write.

    The ranges stay inside what a resumed run still has to do (a fresh run makes ~445 store
    writes and 20 part commit records, 3 of them part creations), so every planned kill lands.
    """
    return [(TORN_COMMIT, rng.randint(2, 15)), (KILL_AFTER_ENV, rng.randint(1, 4)),
            (KILL_AT_WRITE, rng.randint(1, 120))]


def assert_rows_once_in_order(rows: list[int]) -> None:
    """Committed rows so far: each at most once, increasing within the store's part order."""
    dup, _ = duplicates_and_losses(rows, range(0))
    assert dup == [] and rows == sorted(rows), rows


def test_three_kills_then_resume_equal_an_uninterrupted_run(inputs, reference, tmp_path):
    out = str(tmp_path / "hs.zarr")
    args = cli_args(*inputs, out)
    for variable, at in kill_plan(random.Random(SEED)):
        before = committed_rows(out)
        killed = run_cli(args, **{variable: at})
        assert killed.returncode == -9, (variable, at, killed.stderr[-2000:])
        assert not is_complete(out)
        after = committed_rows(out)
        assert_rows_once_in_order(after)
        assert set(before) <= set(after), f"{variable}={at} lost committed rows"
        # incomplete but sound: at most a part whose creation the kill cut short
        assert [f for f in validate(out) if "creation was torn" not in f.message] == []
    run_in_process(*inputs, out)
    assert is_complete(out) and validate(out) == []
    got = stored_samples(out)
    rows = [s.source_row for s in got]
    assert duplicates_and_losses(rows, range(NUM_ROWS)) == ([], [])
    assert differences(got, reference) == []

