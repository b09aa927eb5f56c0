"""SIGKILL at seeded random moments while dflash writes a unit in pieces: checkpoints (inside
`train`, with pruning), an export over a previous one (a drafter directory, a GGUF file) and
an eval report over a previous one. Between kills a reader finds whole units only (the
previous one or the new one, never a mix, a torn file or a checkpoint half deleted), and the
rerun ends equal to an uninterrupted run's. `slow` soak variants kill more often."""

import random
import shutil
from pathlib import Path

import pytest
import torch

from dflash_train.drafter import load_drafter, save_drafter
from dflash_train.train.checkpoint import complete_checkpoints, read_checkpoint
from tests.drafter.conftest import tiny_drafter
from tests.drafter.test_gguf_export import gguf_drafter, write_target
from tests.reliability import kill_children
from tests.reliability.kill_points import kill_points, run_child, tree, tree_differences
from tests.train.conftest import build_store

SEED = 48
TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--epochs", "2",
         "--no-progress", "--set", "run.checkpoint_every=3", "--set", "loader.prefetch_batches=0"]
"""10 steps, a checkpoint every 3 and at the end."""
KEEP = ["--set", "run.keep_checkpoints=2"]
"""The killed runs prune (the reference keeps all, to compare every step)."""
KILLS = [pytest.param(2, id="2-kills"), pytest.param(8, id="8-kills", marks=pytest.mark.slow)]


def _dflash(args: list[str], root: Path, kill_at: int | None = None):
    return run_child(kill_children.dflash, (args,), root, kill_at=kill_at)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_drafter(path).state_dict()


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return build_store(str(tmp_path_factory.mktemp("kill_writers") / "hs.zarr")).url


@pytest.fixture(scope="module")
def reference_run(store, tmp_path_factory) -> tuple[dict[str, dict], list[str], Path]:
    """Every checkpoint of an uninterrupted run by name (their weights), its file operations
    and its last checkpoint."""
    root = tmp_path_factory.mktemp("reference_run")
    done = _dflash(["train", "--store", store, "--out", str(root / "run"), *TRAIN,
                    "--set", "run.keep_checkpoints=0"], root)
    assert done.exitcode == 0, done.error
    found = complete_checkpoints(root / "run")
    assert [p.name for p in found][-1] == "step_00000010" and len(found) == 4
    return {p.name: _weights(p) for p in found}, done.events, found[-1]


@pytest.mark.parametrize("kills", KILLS)
def test_train_killed_anywhere_keeps_whole_checkpoints_and_resumes_to_the_same_ones(
        store, reference_run, tmp_path, kills):
    want, events, _ = reference_run
    run = tmp_path / "run"
    for at in kill_points(events, random.Random(SEED + kills), kills):
        resume = ["--resume"] if complete_checkpoints(run) else []
        trial = _dflash(["train", "--store", store, "--out", str(run), *TRAIN, *KEEP, *resume],
                        tmp_path, kill_at=at)
        assert trial.exitcode in (-9, 0), (at, trial.error)
        for path in complete_checkpoints(run):  # whole, and the uninterrupted run's
            assert _same_weights(read_checkpoint(path).drafter.state_dict(), want[path.name])
        if trial.exitcode == 0:  # the kill fell past what this resume still had to do
            break
    else:
        resume = ["--resume"] if complete_checkpoints(run) else []
        done = _dflash(["train", "--store", store, "--out", str(run), *TRAIN, *KEEP, *resume],
                       tmp_path)
        assert done.exitcode == 0, done.error
    kept = complete_checkpoints(run)
    assert [p.name for p in kept] == sorted(want)[-2:]
    for path in kept:
        assert _same_weights(_weights(path), want[path.name]), path.name


def _export_case(kind: str, root: Path) -> tuple[list[str], list[str], str]:
    """(export args of a previous drafter, of a new one, OUT) for an HF dir or a GGUF."""
    if kind == "hf":
        old, new = tiny_drafter(seed=1), tiny_drafter(seed=2)
        out, more = str(root / "drafter"), []
    else:
        old, new = gguf_drafter(seed=1), gguf_drafter(seed=2)
        out = str(root / "drafter.gguf")
        more = ["--format", "gguf", "--target-gguf", str(write_target(root / "target.gguf"))]
    src = [str(save_drafter(m, root / name)) for m, name in ((old, "old"), (new, "new"))]
    return (["export", src[0], out, *more, "--overwrite"],
            ["export", src[1], out, *more, "--overwrite"], out)


def _publishing(events: list[str], root: Path) -> list[int]:
    """The operations that move or remove an entry directly under `root` (where OUT lives):
    the moments an export is published or the previous one removed, killed every time."""
    return [i for i, e in enumerate(events, 1)
            if e.split()[0] in ("os.rename", "os.remove", "shutil.rmtree")
            and Path(e.split(maxsplit=1)[1]).parent == root]


def _copy(src: Path, dst: Path) -> None:
    """Make `dst` a copy of `src` (a directory or a file), replacing what is there."""
    if dst.is_dir():
        shutil.rmtree(dst)
    (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)


def _published(out: str) -> dict[str, bytes] | None:
    path = Path(out)
    if path.is_dir():
        return tree(path)
    return {path.name: path.read_bytes()} if path.exists() else None


@pytest.mark.parametrize("kills", KILLS)
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_an_export_killed_anywhere_leaves_the_previous_or_the_new_one_whole(tmp_path, kind,
                                                                           kills):
    first, second, out = _export_case(kind, tmp_path)
    done = _dflash(first, tmp_path)
    assert done.exitcode == 0, done.error
    old, saved = _published(out), tmp_path / "saved"
    _copy(Path(out), saved)
    counted = _dflash(second, tmp_path)  # over the previous one: its operations
    assert counted.exitcode == 0, counted.error
    new = _published(out)
    assert new != old
    drawn = kill_points(counted.events, random.Random(SEED + kills), kills)
    for at in sorted(set(drawn) | set(_publishing(counted.events, tmp_path))):
        _copy(saved, Path(out))
        killed = _dflash(second, tmp_path, kill_at=at)
        assert killed.exitcode == -9, (at, killed.error)
        assert _published(out) in (old, new), f"kill at {at}: {counted.events[at - 1]}"
    assert _dflash(second, tmp_path).exitcode == 0
    assert _published(out) == new


def _eval(store: str, checkpoint: Path, out: Path, limit: int) -> list[str]:
    return ["eval", "--store", store, str(checkpoint), "--out", str(out), "--limit",
            str(limit), "--tree-budget", "4", "--device", "cpu", "--no-progress"]


def _not_png_nor_leftover(name: str) -> bool:
    """The plot (matplotlib's bytes are its own business) and `.NAME.tmp-*` leftovers of a
    write cut short (never read) are left out of comparisons."""
    return name.endswith(".png") or name.startswith(".")


@pytest.mark.parametrize("kills", KILLS)
def test_an_eval_killed_while_writing_leaves_no_report_beside_another_runs_rows(
        store, reference_run, tmp_path, kills):
    checkpoint = reference_run[2]
    out, whole, previous = tmp_path / "eval", tmp_path / "whole", tmp_path / "previous"
    assert _dflash(_eval(store, checkpoint, previous, 1), tmp_path).exitcode == 0
    uninterrupted = _dflash(_eval(store, checkpoint, whole, 2), tmp_path)
    assert uninterrupted.exitcode == 0, uninterrupted.error
    want, before = (tree(d, _not_png_nor_leftover) for d in (whole, previous))
    assert sorted(want) == ["blocks.parquet", "report.json"] and before != want
    for at in kill_points(uninterrupted.events, random.Random(SEED + kills), kills):
        _copy(previous, out)
        killed = _dflash(_eval(store, checkpoint, out, 2), tmp_path, kill_at=at)
        assert killed.exitcode == -9, (at, killed.error)
        got = tree(out, _not_png_nor_leftover)
        if "report.json" in got:  # whole, and only ever beside its own rows
            assert got in (want, before), f"kill at {at}: {uninterrupted.events[at - 1]}"
    rerun = _dflash(_eval(store, checkpoint, out, 2), tmp_path)
    assert rerun.exitcode == 0, rerun.error
    assert tree_differences(tree(out, _not_png_nor_leftover), want) == []
