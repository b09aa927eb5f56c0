"""`dflash store convert SRC DST` on a user's mistakes and a kill: DST an existing file, a
convert killed midway, a value float16 cannot hold. Each is one line and a non-zero exit, and
no DST is left that `validate` would call ok while it holds only part of SRC."""

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from click.testing import CliRunner

from dflash_train.store_schema import StoreError, open_store, validate
from dflash_train.store_schema.command import store
from dflash_train.store_schema.layout import part_path
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store
from tests.reliability.s3_server import serve_s3, subprocess_env

REPO = Path(__file__).resolve().parents[2]
KILL_AT_SAMPLE = 15
"""make_store's part 0 holds 12 samples: the kill falls in part 1, after part 0 is whole."""

KILLED_CONVERT = f"""
import os, signal, sys
from dflash_train.store_schema import command

real = command.copy_store
seen = [0]

def keep(sample):
    seen[0] += 1
    if seen[0] == {KILL_AT_SAMPLE}:
        os.kill(os.getpid(), signal.SIGKILL)
    return True

command.copy_store = lambda *a, **k: real(*a, keep=keep, **k)
command.store(["convert", sys.argv[1], sys.argv[2], "--no-progress"])
"""


def _source(tmp_path: Path) -> str:
    """make_store's two complete parts, with the tokenizer files extract writes last."""
    url = make_store(str(tmp_path / "hs.zarr"))
    open_store(url, mode="r+").write_files("tokenizer", {"tokenizer.json": b"{}"})
    return url


def _convert(*args: str):
    return CliRunner().invoke(store, ["convert", *args, "--no-progress"])


def test_a_dst_that_is_a_file_is_refused_and_kept(tmp_path):
    src = _source(tmp_path)
    dst = tmp_path / "notes.txt"
    dst.write_text("mine\n")
    line = one_line_error(_convert(src, str(dst)))
    assert f"{dst} already exists (a file)" in line
    assert dst.read_text() == "mine\n"


def test_a_killed_convert_leaves_no_dst_and_a_rerun_completes_it(tmp_path):
    src = _source(tmp_path)
    dst = tmp_path / "copy.zarr"
    killed = subprocess.run([sys.executable, "-c", KILLED_CONVERT, src, str(dst)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not dst.exists()  # nothing validate could call ok, nor train read in part
    assert validate(str(dst)) != []
    leftover = tmp_path / ".copy.zarr.converting"
    assert leftover.is_dir()

    again = _convert(src, str(dst))
    assert again.exit_code == 0, again.output
    assert f"removing {leftover}, the partial copy of an interrupted convert" in again.output
    assert not leftover.exists() and validate(str(dst)) == []
    copied, original = open_store(str(dst)), open_store(src)
    assert copied.complete and copied.num_samples == original.num_samples
    for a, b in zip(copied.parts(), original.parts(), strict=True):
        assert a.sources().tolist() == b.sources().tolist()


def test_a_convert_killed_on_an_object_store_leaves_a_copy_every_reader_refuses(tmp_path):
    """No rename on S3: the copy is written in place, marked unfinished until it is whole."""
    src = _source(tmp_path)
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(contextlib.contextmanager(serve_s3)())
        dst = s3.url("copy.zarr")
        killed = subprocess.run([sys.executable, "-c", KILLED_CONVERT, src, dst], cwd=REPO,
                                env=subprocess_env(s3), capture_output=True, text=True,
                                timeout=300)
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert s3.keys("copy.zarr/")  # part 0 was written in place
        unfinished = f"{dst} is an unfinished copy of {src}"
        with pytest.raises(StoreError, match=unfinished):
            open_store(dst)
        assert any(unfinished in str(f) for f in validate(dst))
        line = one_line_error(_convert(src, dst))
        assert f"{dst} already exists (if a convert into it was interrupted" in line

        whole = s3.url("whole.zarr")
        assert _convert(src, whole).exit_code == 0
        assert validate(whole) == [] and open_store(whole).complete


def test_a_value_past_float16_is_refused_as_an_overflow_naming_it(tmp_path):
    src = _source(tmp_path)
    sample = open_store(src).parts()[1].iter_samples()
    first = next(sample)
    second_start = len(first)  # token 3 of part 1's sample 1, layer index 1, channel 5
    context = zarr.open_array(f"{src}/{part_path(1)}/context", mode="r+")
    context[second_start + 3, 1, 5] = np.float32(1e5)
    assert validate(src) == []  # a sound float32 store: 1e5 is an ordinary value there
    dst = tmp_path / "half.zarr"
    line = one_line_error(_convert(src, str(dst), "--hidden-dtype", "float16"))
    assert f"{src} part 1 sample 1 (source row 13)" in line
    assert "context value 100000 (token 3, layer 2, channel 5) overflows float16" in line
    assert "NaN" not in line
    assert not dst.exists() and not (tmp_path / ".half.zarr.converting").exists()


@pytest.mark.parametrize("dst", [".", "..", "./"])
def test_a_dst_that_is_the_directory_one_is_in_is_refused(tmp_path, monkeypatch, dst):
    """Publishing DST renames a finished copy onto it: the shell's own directory would be
    swapped for another one under it."""
    src = _source(tmp_path)
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    line = one_line_error(_convert(src, dst))
    assert f"{dst} is the directory you are in (or holds it)" in line
    assert "give a new path" in line
    assert list(here.iterdir()) == [] and not (tmp_path / ".empty.converting").exists()


@pytest.mark.parametrize("under", ["notes.txt/copy.zarr", "notes.txt/sub/copy.zarr"])
def test_a_dst_under_a_regular_file_is_one_line_naming_the_file(tmp_path, under):
    src = _source(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    dst = tmp_path / under
    line = one_line_error(_convert(src, str(dst)))
    assert line == f"Error: {dst}: {tmp_path / 'notes.txt'} is a file, not a directory; give " \
                   "another DST"
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_a_filesystem_that_refuses_the_copy_is_one_line_and_leaves_no_dst(tmp_path,
                                                                          monkeypatch):
    """Root writes through chmod: a read-only filesystem is stood in for by its EROFS."""
    import errno
    import os

    from dflash_train.store_schema import command

    src = _source(tmp_path)
    dst = tmp_path / "copy.zarr"
    real = command.copy_store

    def read_only(source, target, **how):
        real(source, target, **how, keep=lambda sample: False)  # starts writing, then:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), f"{target}/zarr.json")

    monkeypatch.setattr(command, "copy_store", read_only)
    line = one_line_error(_convert(src, str(dst)))
    assert line.startswith(f"Error: {dst}: cannot write the converted store: Read-only file "
                           "system"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hs.zarr"]
