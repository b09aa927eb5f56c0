"""A store whose attributes were changed or torn: the provenance (root attrs) or a part's
commit record holding a value of another type (a JSON boolean for a count, a string for a
list, an object replaced by a list, a field gone). Every reader (validate, info, train) names
the field in one line, never a traceback; a damaged part is refused, or skipped under
--skip-corrupt, as any damaged part is. A part whose creation a crash cut short before its
commit record is not started to validate as to every other reader."""

import shutil

import pytest
import zarr
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.store_schema import open_store, validate
from dflash_train.store_schema.layout import part_path
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store

TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
         "--max-steps", "1", "--set", "loader.prefetch_batches=0"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))


def _copy(pristine: str, tmp_path) -> str:
    return str(shutil.copytree(pristine, tmp_path / "hs.zarr"))


def _set_root(url: str, change) -> None:
    root = zarr.open_group(url, mode="r+")
    root.attrs["dflash"] = change(dict(root.attrs["dflash"]))


def _in(section: str, **fields):
    return lambda m: {**m, section: {**m[section], **fields}}


ROOT = {
    # name: (change to the provenance, words every reader's line holds)
    "not an object": (lambda m: [1, 2], "its 'dflash' attributes are list, not an object"),
    "schema version a boolean": (lambda m: {**m, "schema_version": True},
                                 "its schema version True is not an integer"),
    "layers a string": (lambda m: {**m, "context_layer_ids": "12"},
                        "context_layer_ids is '12', not a list of integers"),
    "layers of strings": (lambda m: {**m, "context_layer_ids": ["a", "b"]},
                          "context_layer_ids is ['a', 'b'], not a list of integers"),
    "num_parts a float": (lambda m: {**m, "num_parts": 2.0}, "num_parts is 2.0, not an integer"),
    "num_parts past the rows": (lambda m: {**m, "num_parts": 10**12},
                                "num_parts 1000000000000 is more than the source's 24 rows"),
    "vocab a boolean": (_in("target", vocab_size=True),
                        "target.vocab_size is True, not an integer"),
    "paths a number": (_in("source", paths=5), "source.paths is 5, not a list of strings"),
    "extra a list": (lambda m: {**m, "extra": [1]}, "extra is [1], not an object"),
    "target a string": (lambda m: {**m, "target": "x"}, "target is 'x', not an object"),
}


@pytest.mark.parametrize("case", list(ROOT))
def test_damaged_provenance_is_one_line_naming_the_field_for_every_reader(pristine, tmp_path,
                                                                         case):
    change, words = ROOT[case]
    url = _copy(pristine, tmp_path)
    _set_root(url, change)
    (finding,) = validate(url)
    assert words in finding.message, finding
    checked = CliRunner().invoke(main, ["store", "validate", url])
    assert checked.exit_code == 1 and words in checked.output, checked.output
    assert checked.exception is None or isinstance(checked.exception, SystemExit)
    for command in (["store", "info", url],
                    ["train", "--store", url, "--out", str(tmp_path / "run"), *TRAIN]):
        said = one_line_error(CliRunner().invoke(main, command))
        assert said.startswith(f"Error: {url}: ") and words in said, said
        assert "were changed or torn" in said
    assert not (tmp_path / "run").exists()


PART = {
    "not an object": (lambda r: [1], "commit record: [1], not an object"),
    "samples a boolean": (lambda r: {**r, "committed_samples": True},
                          "commit record: committed_samples is True, not a count >= 0"),
    "samples a string": (lambda r: {**r, "committed_samples": "12"},
                         "commit record: committed_samples is '12', not a count >= 0"),
    "tokens a float": (lambda r: {**r, "committed_tokens": 402.0},
                       "commit record: committed_tokens is 402.0, not a count >= 0"),
    "complete a string": (lambda r: {**r, "complete": "yes"},
                          "commit record: complete is 'yes', not true or false"),
    "tokens gone": (lambda r: {k: v for k, v in r.items() if k != "committed_tokens"},
                    "commit record: no committed_tokens"),
}


def _set_part(url: str, part: int, change) -> None:
    group = zarr.open_group(f"{url}/{part_path(part)}", mode="r+")
    group.attrs["dflash_part"] = change(dict(group.attrs["dflash_part"]))


@pytest.mark.parametrize("case", list(PART))
def test_a_damaged_commit_record_is_damage_named_by_every_reader(pristine, tmp_path, case):
    change, words = PART[case]
    url = _copy(pristine, tmp_path)
    _set_part(url, 0, change)
    (finding,) = validate(url)
    assert (finding.part, finding.kind) == (0, "record") and words in finding.message, finding
    info = CliRunner().invoke(main, ["store", "info", url])
    assert info.exit_code == 0 and "DAMAGED [0]" in info.output, info.output
    said = one_line_error(CliRunner().invoke(
        main, ["train", "--store", url, "--out", str(tmp_path / "run"), *TRAIN]))
    assert f"{url}: part 0 metadata: [record] {words}" in said, said
    assert "--skip-corrupt" in said
    skipped = CliRunner().invoke(main, ["train", "--store", url, "--out",
                                        str(tmp_path / "skip"), "--skip-corrupt", *TRAIN])
    assert skipped.exit_code == 0, skipped.output
    assert f"skipping damaged data (--skip-corrupt): {url}: part 0 metadata" in skipped.output


def test_a_part_whose_creation_was_cut_short_is_not_started_to_every_reader(pristine,
                                                                            tmp_path):
    """Killed after the part's group and arrays, before its commit record (written last)."""
    url = _copy(pristine, tmp_path)
    group = zarr.open_group(f"{url}/{part_path(1)}", mode="r+")
    del group.attrs["dflash_part"]
    store = open_store(url)
    assert [p.index for p in store.parts()] == [0] and store.unfinished_parts() == [1]
    assert validate(url) == []  # sound, not complete: as train, info and extract see it
    checked = CliRunner().invoke(main, ["store", "validate", url])
    assert checked.exit_code == 0 and f"{url}: ok" in checked.output, checked.output
    strict = CliRunner().invoke(main, ["store", "validate", "--require-complete", url])
    assert strict.exit_code == 1 and "not complete (not started [1])" in strict.output
    info = CliRunner().invoke(main, ["store", "info", url])
    assert "INCOMPLETE" in info.output and "not started [1]" in info.output, info.output
    trained = CliRunner().invoke(main, ["train", "--store", url, "--out",
                                        str(tmp_path / "run"), *TRAIN])
    assert trained.exit_code == 0, trained.output
    assert "leaving out unfinished parts" in trained.output and "part(s) 1" in trained.output
