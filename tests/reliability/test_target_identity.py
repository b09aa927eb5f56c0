"""The target is its weights, not its path: weights replaced at the same path are refused by
a resumed extract, eval --online and train; the same weights copied elsewhere are accepted;
a store made before weights fingerprints is still known by its path (with a note).
"""

import shutil

import pytest
import zarr
from click.testing import CliRunner

from dflash_train.assets.tiny import make_chats, save_qwen3, write_jsonl
from dflash_train.cli import main
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import load_online_target
from dflash_train.extract.errors import ExtractError
from dflash_train.store_schema import StoreError, open_store
from dflash_train.store_schema.layout import META_KEY
from dflash_train.train.checkpoint import check_provenance
from dflash_train.train.data import StoreLoader
from dflash_train.train.errors import TrainError
from dflash_train.train.loader_config import LoaderConfig
from tests.extract.conftest import run_extract_cfg
from tests.train.conftest import build_store

ROWS = 4


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """A tiny target, its chats and a finished store of them, built once."""
    root = tmp_path_factory.mktemp("identity")
    model = save_qwen3(root / "qwen3")
    data = write_jsonl(root / "chats.jsonl", make_chats(ROWS))
    out = str(root / "hs.zarr")
    run_extract_cfg(model, data, out, rows_per_part=2)
    return model, data, out


@pytest.fixture
def setup(extracted, tmp_path):
    """A private copy of the model and the store (tests replace and move them)."""
    model, data, out = extracted
    shutil.copytree(model, tmp_path / "model")
    shutil.copytree(out, tmp_path / "hs.zarr")
    # the store records the module's model path; point it at this test's copy
    _edit_target(str(tmp_path / "hs.zarr"), name_or_path=str(tmp_path / "model"))
    return str(tmp_path / "model"), data, str(tmp_path / "hs.zarr")


def _edit_target(out: str, **fields) -> None:
    root = zarr.open_group(out, mode="r+")
    meta = dict(root.attrs[META_KEY])
    meta["target"] = {**meta["target"], **fields}
    for k, v in fields.items():
        if v is None:
            meta["target"].pop(k)
    root.attrs[META_KEY] = meta


def test_weights_replaced_at_the_same_path_are_refused_on_resume(setup):
    model, data, out = setup
    before = open_store(out).meta.target.weights_sha256
    save_qwen3(model, seed=1)  # same architecture and config, retrained weights
    with pytest.raises(ExtractError) as e:
        run_extract_cfg(model, data, out, rows_per_part=2)
    message = str(e.value)
    assert "\n" not in message
    assert f"--out {out} was extracted from other weights than --model {model}" in message
    assert before[:12] in message and "another --out" in message
    assert open_store(out).meta.target.weights_sha256 == before  # the store is untouched


def test_the_same_weights_copied_to_another_path_resume(setup, tmp_path):
    model, data, out = setup
    moved = shutil.copytree(model, tmp_path / "elsewhere" / "qwen3")
    again = run_extract_cfg(str(moved), data, out, rows_per_part=2)
    assert again.parts_already_complete == [0, 1] and again.parts_done == []


def test_eval_online_refuses_other_weights_and_accepts_a_copy(setup, tmp_path):
    model, _, out = setup
    meta = open_store(out).meta
    copy = shutil.copytree(model, tmp_path / "copy")
    assert load_online_target(str(copy), meta, device="cpu").target.info.weights_sha256 == \
        meta.target.weights_sha256
    save_qwen3(model, seed=1)
    with pytest.raises(EvalError, match=r"is not the store's target .*\n  weights_sha256: "):
        load_online_target(model, meta, device="cpu")


def test_a_store_without_a_fingerprint_is_known_by_its_path_with_a_note(setup, tmp_path):
    model, data, out = setup
    _edit_target(out, weights_sha256=None)
    assert open_store(out).meta.target.weights_sha256 is None  # still readable
    notes: list[str] = []
    again = run_extract_cfg(model, data, out, rows_per_part=2, echo=notes.append)
    assert again.parts_already_complete == [0, 1]
    assert any("records no weights fingerprint" in n and "by path only" in n for n in notes)
    moved = shutil.copytree(model, tmp_path / "elsewhere")
    with pytest.raises(ExtractError, match=r"target\.name_or_path: "):  # as before the field
        run_extract_cfg(str(moved), data, out, rows_per_part=2)


def test_train_refuses_stores_of_other_weights_and_accepts_copies(tmp_path):
    a, same, other = (str(tmp_path / f"{n}.zarr") for n in "abc")
    build_store(a, rows=4, parts=1, weights="a" * 64)
    build_store(same, rows=4, parts=1, name="/copied/to/here", weights="a" * 64)
    build_store(other, rows=4, parts=1, weights="b" * 64)
    StoreLoader([a, same], LoaderConfig(prefetch_batches=0))  # one target at two paths
    with pytest.raises(StoreError, match=r"target\.weights_sha256: 'bbbb\w+' != 'aaaa"):
        StoreLoader([a, other], LoaderConfig(prefetch_batches=0))
    # a checkpoint trained on `a` resumed on a store of other weights
    check_provenance(open_store(a).meta, open_store(same).meta, same, "checkpoint")
    with pytest.raises(TrainError, match=r"target\.weights_sha256"):
        check_provenance(open_store(a).meta, open_store(other).meta, other, "checkpoint")


def test_store_validate_and_info_report_the_fingerprint(setup):
    _, _, out = setup
    fp = open_store(out).meta.target.weights_sha256
    for command in ("validate", "info"):
        result = CliRunner().invoke(main, ["store", command, out])
        assert result.exit_code == 0 and f"sha256 {fp}" in result.output, result.output
    _edit_target(out, weights_sha256=None)
    result = CliRunner().invoke(main, ["store", "validate", out])
    assert result.exit_code == 0 and "not fingerprinted" in result.output
    assert result.output.splitlines()[-1] == f"{out}: ok"
