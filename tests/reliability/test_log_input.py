"""`dflash log summary` on a log.jsonl that is not what training writes (bytes that are not
text, a record of another JSON type, a field of another type) stops with one line naming
the file and the line, never a traceback; only a torn last line is passed over."""

import json

import pytest
from click.testing import CliRunner

from dflash_train.cli import main

GOOD = {"step": 1, "epoch": 0, "loss": 4.0, "lr": 1e-4, "tokens": 100, "samples": 2,
        "noise_std": 0.05, "data_wait_s": 0.1, "step_s": 0.9, "tokens_per_s": 100.0}


def _line(number: int, **changes) -> bytes:
    return (json.dumps({**GOOD, "step": number, **changes}) + "\n").encode()


BAD_LINES = {
    # name: (the third line of the log, words the refusal must hold)
    "binary bytes": (b"\x80\xff\x00\x9c garbage\n", "not UTF-8 text"),
    "a list": (b"[1, 2, 3]\n", "array"),
    "a number": (b"42\n", "number"),
    "a string": (b'"step 3"\n', "string"),
    "null": (b"null\n", "null"),
    "step a string": (_line(3, step="3"), "'step'"),
    "step a float": (_line(3, step=3.5), "'step'"),
    "step missing": (json.dumps({k: v for k, v in GOOD.items() if k != "step"}).encode()
                     + b"\n", "'step'"),
    "loss a string": (_line(3, loss="low"), "'loss'"),
    "lr a list": (_line(3, lr=[1e-4]), "'lr'"),
    "epoch a bool": (_line(3, epoch=True), "'epoch'"),
    "tokens_per_s a string": (_line(3, tokens_per_s="fast"), "'tokens_per_s'"),
    "slot_acc a number": (_line(3, slot_acc=0.5), "'slot_acc'"),
    "slot_acc holding a string": (_line(3, slot_acc=[0.5, "x"]), "'slot_acc'"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_log_line_of_another_shape_is_one_line_naming_file_and_line(tmp_path, case):
    bad, words = BAD_LINES[case]
    log = tmp_path / "log.jsonl"
    log.write_bytes(_line(1) + _line(2) + bad + _line(4) + _line(5))
    result = CliRunner().invoke(main, ["log", "summary", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    (line,) = [x for x in result.output.splitlines() if x.strip()]
    assert line.startswith(f"Error: {log} line 3") and words in line, line


def test_a_torn_last_line_even_of_bytes_is_passed_over(tmp_path):
    (tmp_path / "log.jsonl").write_bytes(_line(1) + _line(2) + b'{"step": 3, "lo\xe2\x80')
    result = CliRunner().invoke(main, ["log", "summary", "--json", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["steps"] == 2
