"""`dflash train --out` given what is not a run directory, a run's own files left damaged or
edited, and a resume onto another store.

A checkpoint directory (or the drafter inside one, or an exported drafter) is refused as
--out, new run or resume, before anything in it changes. A log.jsonl whose last line a crash
cut mid-write is continued on a line of its own by the resume, so every step is recorded and
`dflash log summary` reads the run's own log. Each refusal or note gives the true reason:
a resume onto another store or target says so (not that parts changed); checkpoints without
their marker are named when a resume finds none and when a new run moves them aside; a
RUN/config.toml edited by hand is not silently rewritten; a run already skipping damaged
samples is not told to pass --skip-corrupt.
"""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import save_drafter
from dflash_train.run_layout import LOG, checkpoint_dir
from dflash_train.train.sinks import cut_torn_tail
from tests.drafter.conftest import tiny_drafter
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store
from tests.train.conftest import build_store

TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
         "--max-steps", "4", "--set", "loader.prefetch_batches=0", "--set",
         "run.checkpoint_every=2", "--set", "run.keep_checkpoints=10"]


def _train(store: str, out: Path, *args: str):
    return CliRunner().invoke(main, ["train", "--store", store, "--out", str(out), *TRAIN,
                                     *args])


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))


@pytest.fixture(scope="module")
def finished(store, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    result = _train(store, run)
    assert result.exit_code == 0, result.output
    return run


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
@pytest.mark.parametrize("where", ["checkpoint", "its drafter"])
def test_out_at_a_checkpoint_is_refused_and_nothing_in_the_run_changes(store, finished,
                                                                      tmp_path, where, resume):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    before = _snapshot(run)
    checkpoint = checkpoint_dir(run, 4)
    out = checkpoint if where == "checkpoint" else checkpoint / "drafter"
    said = one_line_error(_train(store, out, *(["--resume"] if resume else [])))
    inside = "" if where == "checkpoint" else "inside "
    assert f"--out {out} is {inside}the training checkpoint {checkpoint}, not a run" in said
    assert f"pass --out {run} --resume" in said
    assert _snapshot(run) == before


def test_out_at_an_exported_drafter_is_refused(store, tmp_path):
    export = save_drafter(tiny_drafter(0), tmp_path / "drafter")
    before = _snapshot(export)
    said = one_line_error(_train(store, export))
    assert f"--out {export} holds a model (config.json), not a run" in said
    assert _snapshot(export) == before


def _steps(log: Path) -> list[int]:
    return [json.loads(line)["step"] for line in log.read_text().splitlines()]


def test_a_resume_after_a_torn_log_line_records_every_step_on_a_line_of_its_own(
        store, finished, tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    log = run / LOG
    whole = log.read_text().splitlines()
    assert _steps(log) == [1, 2, 3, 4]
    # killed while writing step 4's line, before its checkpoint
    shutil.rmtree(checkpoint_dir(run, 4))
    log.write_text("\n".join(whole[:3]) + "\n" + whole[3][:40])

    torn = CliRunner().invoke(main, ["log", "summary", "--json", str(run)])
    assert torn.exit_code == 0, torn.output
    assert f"note: {log} line 4 is torn" in torn.stderr
    assert json.loads(torn.stdout)["steps"] == 3

    resumed = _train(store, run, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert _steps(log) == [1, 2, 3, 3, 4]  # step 3 again from the step-2 checkpoint
    again = [_exact(line) for line in log.read_text().splitlines()[3:]]
    assert again == [_exact(line) for line in whole[2:]]  # as the uninterrupted run's
    summary = CliRunner().invoke(main, ["log", "summary", "--json", str(run)])
    assert summary.exit_code == 0 and "torn" not in summary.output, summary.output
    assert json.loads(summary.output)["steps"] == 4


def _exact(line: str) -> dict:
    """A record without its wall-clock fields (they vary run to run)."""
    return {k: v for k, v in json.loads(line).items()
            if k not in ("data_wait_s", "step_s", "tokens_per_s")}


@pytest.mark.parametrize("content, kept", [
    (b"", b""),
    (b'{"step": 1}\n', b'{"step": 1}\n'),
    (b'{"step": 1}\n{"step": 2, "lo', b'{"step": 1}\n'),
    (b'{"step": 1, "lo', b""),
    (b'{"step": 1}\n' + b"x" * 200_000, b'{"step": 1}\n'),  # a tail longer than one read
    (b"y" * 200_000, b""),
])
def test_cut_torn_tail_keeps_exactly_the_whole_lines(tmp_path, content, kept):
    log = tmp_path / "log.jsonl"
    log.write_bytes(content)
    assert cut_torn_tail(log) == len(content) - len(kept)
    assert log.read_bytes() == kept


@pytest.fixture(scope="module")
def halfway(store, tmp_path_factory) -> Path:
    """A run stopped after its step-2 checkpoint, 4 steps planned (step 4's checkpoint gone
    with its crash)."""
    run = tmp_path_factory.mktemp("halfway") / "run"
    assert _train(store, run).exit_code == 0
    shutil.rmtree(checkpoint_dir(run, 4))
    return run


@pytest.mark.parametrize("other, said", [
    ({"rows": 30, "seed": 1}, ("was trained on another store than", "source.num_rows: 24 != 30")),
    ({"name": "another-target"}, ("was trained on a store of another target or layer set than",
                                  "target.name_or_path: 'tiny' != 'another-target'")),
], ids=["other data", "other target"])
def test_a_resume_onto_another_store_says_so_not_that_its_parts_changed(halfway, tmp_path,
                                                                       other, said):
    run = Path(shutil.copytree(halfway, tmp_path / "run"))
    url = str(tmp_path / "other.zarr")
    build_store(url, **other)
    result = _train(url, run, "--resume")
    assert result.exit_code == 1, result.output
    for words in said:
        assert words in result.output, result.output
    assert "usable parts changed" not in result.output


def test_checkpoints_without_their_marker_are_named_not_passed_over(store, finished,
                                                                    tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    for checkpoint in (run / "checkpoints").iterdir():
        (checkpoint / "COMPLETE").unlink()  # copied without it, or saves cut short
    said = one_line_error(_train(store, run, "--resume"))
    assert "it holds step_00000002, step_00000004, without the COMPLETE marker" in said
    fresh = _train(store, run)
    assert fresh.exit_code == 0, fresh.output
    assert (f"moved its checkpoints (holding step_00000002, step_00000004, none complete), "
            f"log.jsonl, config.toml to {run / 'aborted-1'}") in fresh.output
    assert (run / "aborted-1" / "checkpoints" / "step_00000004" / "trainer.pt").is_file()


@pytest.mark.parametrize("edit, said", [
    (("lr = 0.0006", "lr = 0.01"), "--lr (optim.lr): 0.01 in the file, 0.0006 resumed"),
    (("log_every = 10", "log_every = 3"), "run.log_every: 3 in the file, 10 resumed"),
], ids=["lr", "log_every"])
def test_an_edited_run_config_is_not_silently_rewritten_by_a_resume(store, halfway, tmp_path,
                                                                    edit, said):
    run = Path(shutil.copytree(halfway, tmp_path / "run"))
    config = run / "config.toml"
    assert edit[0] in config.read_text()
    config.write_text(config.read_text().replace(edit[0], edit[1]))
    edited = config.read_text()
    refused = _train(store, run, "--resume")
    assert refused.exit_code == 1 and said in refused.output, refused.output
    assert f"pass --config {config}" in refused.output
    assert config.read_text() == edited
    if edit[1].startswith("log_every"):  # a setting a resume may change: taken from the file
        resumed = _train(store, run, "--resume", "--config", str(config))
        assert resumed.exit_code == 0, resumed.output


def test_a_resume_after_a_crash_takes_its_own_run_config(store, halfway, tmp_path):
    """The file as the run wrote it, and as another resume rewrote it with its settings."""
    run = Path(shutil.copytree(halfway, tmp_path / "run"))
    assert _train(store, run, "--resume", "--set", "run.log_every=3").exit_code == 0


def test_a_run_already_skipping_damage_is_not_told_to_skip_it(tmp_path):
    url = make_store(str(tmp_path / "hs.zarr"))
    for shard in Path(url, "parts").glob("*/context/c/*/0/0"):  # every context shard
        data = bytearray(shard.read_bytes())
        data[40] ^= 0xFF
        shard.write_bytes(bytes(data))
    said = one_line_error(_train(url, tmp_path / "run", "--skip-corrupt"))
    assert "even skipping the damaged samples (--skip-corrupt is on)" in said, said
    assert "pass --skip-corrupt" not in said
    said = one_line_error(_train(url, tmp_path / "run2"))
    assert "pass --skip-corrupt" in said
