"""`dflash log summary` on a log.jsonl that is not what training writes (bytes that are not
text, a record of another JSON type, a field of another type, hostile lines: deep nesting,
numbers too large, per-slot lists of another length) stops with one line naming the file and
the line, never a traceback; only a torn last line is passed over, and said to be."""

import json

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from tests.reliability.cli_errors import one_line_error

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
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),
    "a field nested 100000 deep": (_line(3)[:-2] + b', "x": ' + b"[" * 100_000
                                   + b"]" * 100_000 + b"}\n", "nested too deeply"),
    "an integer of 5000 digits": (_line(3)[:-2] + b', "tokens": ' + b"9" * 5000 + b"}\n",
                                  "a number too long to read"),
    "loss beyond a float": (_line(3, loss=10**400), "'loss'"),
    "step beyond 64 bits": (_line(3, step=2**64), "'step'"),
    "slot_acc of another length": (_line(3, slot_acc=[0.5]), "'slot_acc' has 1 slots, line "
                                                             "2's has 2"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_log_line_of_another_shape_is_one_line_naming_file_and_line(tmp_path, case):
    bad, words = BAD_LINES[case]
    log = tmp_path / "log.jsonl"
    log.write_bytes(_line(1, slot_acc=[0.9, 0.8]) + _line(2, slot_acc=[0.9, 0.7]) + bad
                    + _line(4) + _line(5))
    result = CliRunner().invoke(main, ["log", "summary", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    (line,) = [x for x in result.output.splitlines() if x.strip()]
    assert line.startswith(f"Error: {log} line 3") and words in line, line


def test_a_torn_last_line_even_of_bytes_is_passed_over_and_said_to_be(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_bytes(_line(1) + _line(2) + b'{"step": 3, "lo\xe2\x80')
    result = CliRunner().invoke(main, ["log", "summary", "--json", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 2
    assert result.stderr == (f"note: {log} line 3 is torn (a crash mid-write?); read the 2 "
                             "lines before it\n")


@pytest.mark.parametrize("content", [b"\x00\x01 garbage", b"hello world\n", b"[1, 2]\n"],
                         ids=["binary", "text", "json"])
def test_a_log_of_one_line_of_garbage_is_not_called_empty(tmp_path, content):
    log = tmp_path / "log.jsonl"
    log.write_bytes(content)
    said = one_line_error(CliRunner().invoke(main, ["log", "summary", str(tmp_path)]))
    assert said.startswith(f"Error: {log} line 1") and "no records yet" not in said, said
    assert "dflash training log?" in said


def test_an_empty_log_holds_no_records_yet(tmp_path):
    (tmp_path / "log.jsonl").write_bytes(b"\n")
    said = one_line_error(CliRunner().invoke(main, ["log", "summary", str(tmp_path)]))
    assert "holds no records yet (the run has not finished a step)" in said
