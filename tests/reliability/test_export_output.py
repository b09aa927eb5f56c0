"""`dflash export` where the export cannot be what was asked: a weight float16 cannot hold
(written as Inf before), an output path through a file, a filesystem that refuses the write.
Each is one line naming the weight or the path, exit 1, and nothing at OUT (no temporary
file left either)."""

import errno
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash_train.cli import main
from dflash_train.drafter import save_drafter
from tests.drafter.test_gguf_export import gguf_drafter, write_target
from tests.reliability.cli_errors import one_line_error


def _drafter(tmp_path, largest: float):
    model = gguf_drafter()
    with torch.no_grad():
        model.fc.weight[0, 0] = largest
    return save_drafter(model, tmp_path / "src")


def _export(src, out, fmt, target, *args):
    gguf = ["--format", "gguf", "--target-gguf", str(target)] if fmt == "gguf" else []
    return CliRunner().invoke(main, ["export", str(src), str(out), *gguf, *args])


def _out(tmp_path, fmt):
    return tmp_path / ("drafter.gguf" if fmt == "gguf" else "drafter")


@pytest.fixture
def target(tmp_path):
    return write_target(tmp_path / "target.gguf")


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_weight_beyond_float16_is_refused_naming_it(tmp_path, target, fmt):
    src, out = _drafter(tmp_path, 1e5), _out(tmp_path, fmt)
    said = one_line_error(_export(src, out, fmt, target, "--dtype", "float16"))
    assert "weight fc.weight holds 100000, beyond float16's largest value (65504)" in said
    assert "export as bfloat16 or float32 (--dtype)" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "target.gguf"]
    kept = _export(src, out, fmt, target, "--dtype", "bfloat16")
    assert kept.exit_code == 0, kept.output


def test_float16s_largest_value_is_exported_as_it_is(tmp_path, target):
    src, out = _drafter(tmp_path, 65504.0), _out(tmp_path, "hf")
    result = _export(src, out, "hf", target, "--dtype", "float16")
    assert result.exit_code == 0, result.output
    weights = load_file(out / "model.safetensors")
    assert weights["fc.weight"].dtype == torch.float16
    assert float(weights["fc.weight"][0, 0]) == 65504.0
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("depth", [1, 2])
def test_an_output_path_through_a_file_is_one_line_naming_the_file(tmp_path, target, fmt,
                                                                   depth):
    src = _drafter(tmp_path, 1.0)
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    out = blocker.joinpath(*["sub"] * (depth - 1), _out(tmp_path, fmt).name)
    said = one_line_error(_export(src, out, fmt, target))
    assert said == (f"Error: {out}: {blocker} is a file, not a directory; choose another "
                    "output path")
    assert blocker.read_text() == "mine\n"


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("at", ["temporary", "publish"])
def test_a_filesystem_that_refuses_the_write_is_one_line_and_leaves_nothing(
        tmp_path, target, monkeypatch, fmt, at):
    """Root writes through chmod, so a read-only filesystem is stood in for by the OS's
    refusal itself: EROFS from creating the temporary, or ENOSPC from publishing it."""
    src, out = _drafter(tmp_path, 1.0), _out(tmp_path, fmt)
    code = errno.EROFS if at == "temporary" else errno.ENOSPC

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(out.parent))

    if at == "temporary":
        monkeypatch.setattr("tempfile.mkdtemp" if fmt == "hf" else "tempfile.mkstemp", refuse)
    else:
        monkeypatch.setattr("os.replace", refuse)
    said = one_line_error(_export(src, out, fmt, target))
    assert said.startswith(f"Error: {out}: cannot write it: {os.strerror(code)}"), said
    assert "nothing was written there" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "target.gguf"]
