"""Bad input from tests/data/bad_input (and bad model-side options): `dflash extract` stops with
one line naming the file and row (or the option), a non-zero exit, and no complete store.

A prompt longer than --max-length is not an error for one row: the row is skipped, counted
and named in the summary (prepare.py's length policy); only a dataset in which every row is
skipped is refused.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.assets.tiny import VOCAB_SIZE, build_tokenizer, save_qwen3
from dflash_train.extract.command import extract
from dflash_train.store_schema import open_store, validate
from tests.reliability.extract_support import is_complete, stored_samples

DATA = Path(__file__).resolve().parents[1] / "data" / "bad_input"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_qwen3(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def no_template_model(model, tmp_path_factory):
    """The same config, with a tokenizer that has no chat template (and no weights at all:
    extract must refuse before it would load them)."""
    path = tmp_path_factory.mktemp("no_template")
    shutil.copy(Path(model) / "config.json", path)
    build_tokenizer(chat_template=None).save_pretrained(path)
    return str(path)


@dataclass
class Case:
    name: str
    data: str
    needles: tuple[str, ...]
    """Text the error line must contain: {model} and {out} are filled in."""
    options: tuple[str, ...] = ()
    model: str = "model"
    """Which fixture: "model", "no_template_model", or "missing" (a path that does not exist)."""


CASES = [
    Case("malformed_jsonl", "malformed.jsonl", ("malformed.jsonl:line 3", "malformed JSON")),
    Case("not_utf8", "not_utf8.jsonl", ("not_utf8.jsonl:line 2", "not UTF-8", "0xff")),
    Case("empty_messages", "empty_messages.jsonl",
         ("empty_messages.jsonl:line 2", "'messages' must be a non-empty list")),
    Case("no_assistant_turn", "no_assistant.jsonl",
         ("no_assistant.jsonl:line 2 (row 1)", "no assistant turn")),
    Case("unknown_role", "unknown_role.jsonl", ("unknown_role.jsonl:line 2", "'robot'")),
    Case("every_prompt_longer_than_max_length", "overlong_prompts.jsonl",
         ("overlong_prompts.jsonl", "all 2 rows were skipped", "--max-length 24", "line 1"),
         ("--max-length", "24")),
    Case("empty_dataset", "empty.jsonl", ("empty.jsonl", "no rows")),
    Case("parquet_wrong_dtype", "wrong_dtype.parquet",
         ("wrong_dtype.parquet:parquet row 0", "'prompt' must be a string, got int")),
    Case("tokenizer_without_chat_template", "one_overlong_prompt.jsonl",
         ("--model {model}", "no chat template"), model="no_template_model"),
    Case("model_path_missing", "one_overlong_prompt.jsonl",
         ("--model {model}", "no such directory"), model="missing"),
    Case("layer_ids_out_of_range", "one_overlong_prompt.jsonl",
         ("--layers", "[4, 9] out of range", "4 layers"), ("--layers", "0,4,9")),
    Case("mask_token_outside_vocab", "one_overlong_prompt.jsonl",
         (f"--mask-token-id {VOCAB_SIZE}", f"size {VOCAB_SIZE}"),
         ("--mask-token-id", str(VOCAB_SIZE))),
]


def _invoke(model: str, data: Path, out: str, *options: str):
    args = ["--model", model, "--data", str(data), "--out", out, "--device", "cpu",
            "--layers", "0,1", "--rows-per-part", "2", "--no-progress", *options]
    return CliRunner().invoke(extract, args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_fails_with_one_line_naming_where(case, request, tmp_path):
    model = (str(tmp_path / "no-such-model") if case.model == "missing"
             else request.getfixturevalue(case.model))
    out = str(tmp_path / "hs.zarr")
    result = _invoke(model, DATA / case.data, out, *case.options)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in case.needles:
        assert needle.format(model=model, out=out) in lines[0], lines[0]
    assert not is_complete(out)
    assert not Path(out).exists() or validate(out) != [] or not open_store(out).complete


def test_one_prompt_longer_than_max_length_is_skipped_counted_and_named(model, tmp_path):
    out = str(tmp_path / "hs.zarr")
    data = DATA / "one_overlong_prompt.jsonl"
    result = _invoke(model, data, out, "--max-length", "40")
    assert result.exit_code == 0, result.output
    assert "skipped with no assistant token within max-length: 1" in result.stdout
    assert "one_overlong_prompt.jsonl:line 3 (row 2)" in result.stdout
    assert is_complete(out) and validate(out) == []
    rows = [s.source_row for s in stored_samples(out)]
    assert rows == [0, 1, 3]
    assert all(len(s) <= 40 for s in stored_samples(out))
