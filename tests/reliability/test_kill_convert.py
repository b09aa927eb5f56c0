"""`dflash store convert` SIGKILLed at seeded random moments leaves no DST (or the whole one),
and a rerun equals an uninterrupted convert file by file; a second convert into a DST that
another is writing is refused by name, and the first completes untouched."""

import random

import pytest
from click.testing import CliRunner

from dflash_train.store_schema import open_store, validate
from dflash_train.store_schema.command import store
from tests.reliability import kill_children
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store
from tests.reliability.kill_points import (
    events,
    kill_points,
    run_child,
    start_child,
    tree,
    tree_differences,
)

SEED = 48
KILLS = [pytest.param(2, id="2-kills"), pytest.param(8, id="8-kills", marks=pytest.mark.slow)]


def _source(tmp_path) -> str:
    url = make_store(str(tmp_path / "hs.zarr"))
    open_store(url, mode="r+").write_files("tokenizer", {"tokenizer.json": b"{}"})
    return url


def _convert_args(src: str, dst, *more: str) -> list[str]:
    return ["store", "convert", src, str(dst), "--no-progress", *more]


@pytest.mark.parametrize("kills", KILLS)
def test_a_convert_killed_anywhere_leaves_no_dst_and_a_rerun_equals_an_uninterrupted_one(
        tmp_path, kills):
    src = _source(tmp_path)
    (tmp_path / "whole").mkdir()
    (tmp_path / "killed").mkdir()
    whole, dst = tmp_path / "whole" / "copy.zarr", tmp_path / "killed" / "copy.zarr"
    reference = run_child(kill_children.dflash, (_convert_args(src, whole),), whole.parent)
    assert reference.exitcode == 0, reference.error
    for at in kill_points(reference.events, random.Random(SEED + kills), kills):
        killed = run_child(kill_children.dflash, (_convert_args(src, dst),), dst.parent,
                           kill_at=at)
        assert killed.exitcode == -9, (at, killed.error)
        if dst.exists():  # killed after the rename: the copy is whole
            assert tree_differences(tree(dst), tree(whole)) == [], at
            return
        assert validate(str(dst)) != []  # nothing validate could call ok
    rerun = run_child(kill_children.dflash, (_convert_args(src, dst),), dst.parent)
    assert rerun.exitcode == 0, rerun.error
    assert tree_differences(tree(dst), tree(whole)) == []
    assert sorted(p.name for p in dst.parent.iterdir()) == ["copy.zarr"]  # no leftovers
    assert validate(str(dst)) == []


def test_a_second_convert_into_a_dst_being_written_is_refused_and_the_first_completes(
        tmp_path):
    src = _source(tmp_path)
    dst = tmp_path / "copy.zarr"
    copying, go = events(), events()
    first = start_child(kill_children.convert_held, (_convert_args(src, dst)[2:], copying, go),
                        tmp_path)
    try:
        assert copying.wait(120), "the first convert never started copying"
        for encoding in ("keep", "float8_e4m3"):
            second = CliRunner().invoke(store, _convert_args(src, dst, "--context-dtype",
                                                             encoding)[1:])
            line = one_line_error(second)
            assert f"{dst}: another `dflash store convert` is writing it" in line
    finally:
        go.set()
    done = first.wait()
    assert done.exitcode == 0, done.error
    assert validate(str(dst)) == []
    copied, original = open_store(str(dst)), open_store(src)
    assert copied.complete and copied.meta.context_dtype == original.meta.context_dtype
    for a, b in zip(copied.parts(), original.parts(), strict=True):
        assert a.sources().tolist() == b.sources().tolist()
