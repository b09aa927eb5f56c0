"""A `.gguf` that starts with the GGUF magic and is damaged after it (bytes of no format, a
metadata key that is not UTF-8, a file cut in half) stops `extract` with one line naming it as
a damaged GGUF file, not as whatever transformers made of it (for the key: 'a config file
that is not valid JSON'), and nothing is written."""

import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.extract.command import extract
from tests.extract.tiny_gguf import write_tiny_gguf
from tests.reliability.cli_errors import one_line_error
from tests.reliability.extract_support import cli_args, shared_inputs


def _garbage(path: Path) -> None:
    path.write_bytes(b"GGUF" + bytes(range(7, 250, 3)) * 4)


def _key_not_utf8(path: Path) -> None:
    """Version 3, no tensor, one metadata key of 4 bytes that are not UTF-8 (a uint32 7)."""
    key = b"\xff\xfe\xfd\xfc"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<II", 4, 7))


def _cut_in_half(path: Path) -> None:
    write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", [_garbage, _key_not_utf8, _cut_in_half],
                         ids=["garbage", "key_not_utf8", "cut_in_half"])
def test_a_damaged_gguf_is_named_as_one(tmp_path_factory, tmp_path, damage):
    _, data = shared_inputs(tmp_path_factory.getbasetemp())
    model = tmp_path / "model.gguf"
    damage(model)
    out = tmp_path / "hs.zarr"
    line = one_line_error(CliRunner().invoke(extract, cli_args(str(model), data, str(out))))
    assert line.startswith(f"Error: --model {model}: a damaged GGUF file (it starts with the "
                           "GGUF magic")
    assert "download or convert it again" in line and "JSON" not in line
    assert not out.exists()
