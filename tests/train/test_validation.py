"""Validation during training (--val-store): the figures are dflash eval's, whatever the batch
size or the number of ranks; the best checkpoint is marked, kept through rotation and
resume, and taken by export and eval; run.patience stops a run; bad validation stores are
refused before anything is written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import load_drafter
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.run_layout import BEST, LOG, checkpoint_dir
from dflash_train.run_reader import read_best
from dflash_train.store_schema import open_store
from dflash_train.train.checkpoint import complete_checkpoints
from dflash_train.train.config import ValidationConfig, load_train_config
from dflash_train.train.data import StoreLoader
from dflash_train.train.errors import TrainError
from dflash_train.train.loader_config import LoaderConfig
from dflash_train.train.log_summary import format_summary, read_log, summarize_log
from dflash_train.train.loop import train
from dflash_train.train.record import StoreFigures, ValidationFigures
from dflash_train.train.validation import Validation, open_validation
from tests.train.conftest import build_store
from tests.train.test_loop import tensorboard_tags

REPO = Path(__file__).resolve().parents[2]

FAST = {"model.num_hidden_layers": 1, "loader.batch_tokens": 256, "run.anchors_per_seq": 8,
        "run.progress": False, "run.log_every": 1, "loader.prefetch_batches": 0,
        "run.precision": "fp32"}
"""The train tests' shape, in float32: validation figures compared exactly."""


def _cfg(store, out, val, **extra):
    return load_train_config(None, {"stores": [store], "run.out_dir": str(out),
                                    "validation.stores": val, **FAST, **extra})


@pytest.fixture(scope="module")
def val_store(tmp_path_factory) -> str:
    """The synthetic target's store of other prompts: never in the train store."""
    url = str(tmp_path_factory.mktemp("val") / "val.zarr")
    build_store(url, rows=8, parts=1, first_sample=24)
    return url


@pytest.fixture(scope="module")
def other_val_store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("val2") / "val2.zarr")
    build_store(url, rows=6, parts=2, first_sample=40)
    return url


@pytest.fixture(scope="module")
def learned(synthetic_store, val_store, tmp_path_factory) -> Path:
    """A run whose drafter has learnt some of the rule (validation tau ~2), validated at
    steps 20, 40 and 60 on the 8-sample store, 5 of them drawn (--val-limit)."""
    out = tmp_path_factory.mktemp("learned") / "run"
    train(_cfg(synthetic_store, out, [val_store], **{
        "loader.batch_tokens": 512, "optim.lr": 1e-2, "optim.epochs": 100,
        "optim.max_steps": 60, "run.checkpoint_every": 20, "run.keep_checkpoints": 0,
        "validation.limit": 5, "validation.tree_budgets": [4, 16]}))
    return out


def _logged_validation(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / LOG).read_text().splitlines()]
    return {r["step"]: r["validation"] for r in lines if "validation" in r}


def test_the_figures_are_what_dflash_eval_reports_on_the_same_samples(learned, val_store):
    logged = _logged_validation(learned)
    assert sorted(logged) == [20, 40, 60]
    for step, figures in logged.items():
        report = run_eval(EvalConfig(store=val_store, checkpoints=[str(checkpoint_dir(
            learned, step))], settings=EvalSettings(tree_budgets=(4, 16)), limit=5, seed=0,
            progress=False), echo=lambda _: None).report
        offline = report["checkpoints"][0]["offline"]
        assert figures["tau"] == offline["mean_tau"]
        assert figures["blocks"] == offline["n_blocks"]
        assert figures["tree_tau"] == {b: t["mean_tau"] for b, t in offline["tree"].items()}
    # a drafter that drafts: the figures below can tell counts summed from means averaged
    assert logged[60]["tau"] > 1.5


def _drafter(checkpoint: Path, store: str):
    model = load_drafter(checkpoint)
    rows = open_store(store).target_rows()
    model.attach_target_head(rows["embed_tokens"], rows["lm_head"])
    return model


def test_a_figure_sums_counts_so_batch_size_and_store_split_do_not_change_it(
        learned, synthetic_store, val_store, other_val_store):
    model = _drafter(checkpoint_dir(learned, 60), synthetic_store)
    loader = StoreLoader([synthetic_store], LoaderConfig(prefetch_batches=0))

    def validation(urls: list[str], batch_tokens: int = 16384) -> Validation:
        cfg = ValidationConfig(stores=urls, limit=None, tree_budgets=(4, 16),
                               batch_tokens=batch_tokens)
        return open_validation(cfg, loader.stores, loader.parts, model.config, 0, 1,
                               lambda _: None)

    def figures(batch_tokens: int, urls: list[str]) -> ValidationFigures:
        return validation(urls, batch_tokens).evaluate(model)

    one_by_one = figures(1, [val_store, other_val_store])  # a batch per sequence
    all_at_once = figures(10**6, [val_store, other_val_store])
    assert one_by_one.pooled == all_at_once.pooled and one_by_one.stores == all_at_once.stores
    a, b = (all_at_once.stores[u] for u in (val_store, other_val_store))
    assert a.tau != b.tau  # else a mean of the stores' means could not be told apart
    pooled = all_at_once.pooled
    assert pooled.blocks == a.blocks + b.blocks
    assert pooled.tau == pytest.approx((a.tau * a.blocks + b.tau * b.blocks) / pooled.blocks)
    alone = figures(10**6, [val_store])
    assert alone.pooled == a  # one store's figures do not depend on the others beside it
    for training in (True, False):  # evaluate leaves the drafter's mode as it found it
        model.train(training)
        validation([val_store]).evaluate(model)
        assert model.training == training


def test_two_ranks_report_the_figure_one_process_reports(learned, synthetic_store, val_store,
                                                         tmp_path):
    # Both start from the learnt drafter at a negligible lr: what differs is only how the
    # 5 validation samples are split (3 and 2 per rank) and merged.
    args = ["--store", synthetic_store, "--val-store", val_store, "--val-limit", "5",
            "--tree-budget", "4,16", "--layers", "1", "--batch-tokens", "256",
            "--anchors-per-seq", "8", "--max-steps", "2", "--lr", "1e-12", "--no-progress",
            "--set", f"model.init_from={checkpoint_dir(learned, 60)}",
            "--set", "loader.prefetch_batches=0", "--set", "run.precision=fp32",
            "--set", "run.checkpoint_every=1"]
    one = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "one"), *args])
    assert one.exit_code == 0, one.output
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "dflash_train", "train", "--out", str(tmp_path / "two"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _logged_validation(tmp_path / "one"), _logged_validation(tmp_path / "two")
    for figures in (*a.values(), *b.values()):
        figures.pop("seconds")
    assert sorted(a) == [1, 2] and a == b
    assert a[2]["tau"] > 1.5 and a[2]["blocks"] > 0
    assert read_best(tmp_path / "two") == read_best(tmp_path / "one")


def test_validation_never_changes_what_is_trained(synthetic_store, val_store, tmp_path):
    settings = {"optim.max_steps": 5, "run.checkpoint_every": 2, "run.keep_checkpoints": 0}
    plain = train(load_train_config(None, {"stores": [synthetic_store], **FAST, **settings,
                                           "run.out_dir": str(tmp_path / "plain")}))
    validated = train(_cfg(synthetic_store, tmp_path / "validated", [val_store], **settings))
    assert _steps(tmp_path / "plain") == _steps(tmp_path / "validated") == [2, 4, 5]
    assert sorted(_logged_validation(tmp_path / "validated")) == [2, 4, 5]  # and the last

    def losses(run):
        return [r.loss for r in read_log(run)]

    assert losses(tmp_path / "plain") == losses(tmp_path / "validated")
    a, b = (load_drafter(r.checkpoint).state_dict() for r in (plain, validated))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _scripted(taus: list[float], store: str):
    """Validation.evaluate giving these pooled taus in turn (tree taus above them)."""
    figures = iter(taus)

    def evaluate(self, model):
        tau = next(figures)
        f = StoreFigures(tau=tau, tree_tau={16: tau + 0.5}, blocks=100)
        return ValidationFigures(pooled=f, tau_ci95=None, stores={store: f}, seconds=0.0)
    return evaluate


def _steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in complete_checkpoints(run_dir)]


def test_the_best_checkpoint_survives_rotation_patience_and_resume(synthetic_store, val_store,
                                                                   tmp_path, monkeypatch):
    run = tmp_path / "run"
    settings = {"optim.max_steps": 14, "run.checkpoint_every": 2, "run.keep_checkpoints": 1,
                "validation.tree_budgets": [16]}
    # validations at steps 2, 4, 6, 8: the best is 4's; 6 and 8 do not beat it: patience 2
    monkeypatch.setattr(Validation, "evaluate", _scripted([1.5, 2.0, 1.8, 2.0], val_store))
    first = train(_cfg(synthetic_store, run, [val_store], **settings, **{"run.patience": 2}))
    assert first.steps == 8 and "has not beaten step 4's 2.0000 in 2 validations" in first.stopped
    assert _steps(run) == [4, 8]  # keep 1, and the best beside it
    assert read_best(run).step == 4 and read_best(run).figure == "tau"
    assert [r.step for r in read_log(run)] == list(range(1, 9))

    again = train(_cfg(synthetic_store, run, [val_store], **settings, **{"run.patience": 2}),
                  resume=True)
    assert again.steps == 8 and again.stopped  # still out of patience: nothing trained
    assert _steps(run) == [4, 8]

    # more patience: step 10 (1.9) does not move the best the resume kept; 12 (2.5) does,
    # and the old best leaves rotation; 14 ends the run
    monkeypatch.setattr(Validation, "evaluate", _scripted([1.9, 2.5, 2.1], val_store))
    resumed = train(_cfg(synthetic_store, run, [val_store], **settings, **{"run.patience": 5}),
                    resume=True)
    assert resumed.steps == 14 and resumed.stopped is None
    log = {r.step: r.validation for r in read_log(run) if r.validation is not None}
    assert {s: v.best_step for s, v in log.items()} == {2: 2, 4: 4, 6: 4, 8: 4, 10: 4, 12: 12,
                                                        14: 12}
    assert _steps(run) == [12, 14] and read_best(run).step == 12
    assert json.loads((run / BEST).read_text()) == {"step": 12, "figure": "tau", "value": 2.5}


def test_best_by_tree_tau_follows_the_largest_budget(synthetic_store, val_store, tmp_path,
                                                     monkeypatch):
    figures = iter([(1.5, 3.0), (2.0, 2.5), (1.8, 3.5)])  # (chain, tree@64)

    def evaluate(self, model):
        tau, tree = next(figures)
        f = StoreFigures(tau=tau, tree_tau={4: tau, 64: tree}, blocks=10)
        return ValidationFigures(pooled=f, tau_ci95=None, stores={val_store: f}, seconds=0.0)

    monkeypatch.setattr(Validation, "evaluate", evaluate)
    train(_cfg(synthetic_store, tmp_path / "run", [val_store], **{
        "optim.max_steps": 6, "run.checkpoint_every": 2, "validation.best_by": "tree_tau",
        "validation.tree_budgets": [64, 4]}))
    assert json.loads((tmp_path / "run" / BEST).read_text()) == {
        "step": 6, "figure": "tree_tau@64", "value": 3.5}


def test_export_and_eval_of_a_run_directory_take_its_best_checkpoint(synthetic_store,
                                                                      val_store, tmp_path,
                                                                      monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(Validation, "evaluate", _scripted([1.5, 2.0, 1.8], val_store))
    train(_cfg(synthetic_store, run, [val_store], **{"optim.max_steps": 6,
                                                     "run.checkpoint_every": 2}))
    assert read_best(run).step == 4 and _steps(run)[-1] == 6

    exported = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "out"),
                                         "--dtype", "keep"])
    assert exported.exit_code == 0, exported.output
    assert "its best checkpoint (tau 2.0000 on validation)" in exported.output
    got = load_drafter(tmp_path / "out").state_dict()
    for name, want in load_drafter(checkpoint_dir(run, 4)).state_dict().items():
        assert torch.equal(got[name], want), name

    report = run_eval(EvalConfig(store=val_store, checkpoints=[str(run)], progress=False),
                      echo=lambda _: None).report
    (column,) = report["checkpoints"]
    assert column["name"] == "run/step_00000004"
    assert column["path"] == str(checkpoint_dir(run, 4))
    named = run_eval(EvalConfig(store=val_store, checkpoints=[str(checkpoint_dir(run, 6))],
                                progress=False), echo=lambda _: None).report
    assert named["checkpoints"][0]["path"] == str(checkpoint_dir(run, 6))  # a step named

    # a marker edited or left stale never picks the drafter: the saved validation does
    (run / BEST).write_text(json.dumps({"step": 100, "figure": "tau", "value": 1.5}))
    stale = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "out2")])
    assert stale.exit_code == 0, stale.output
    assert f"{BEST} named step 100, stale" in stale.output
    assert f"exported {checkpoint_dir(run, 4)} ->" in stale.output


def test_a_run_without_validation_stands_for_its_newest_checkpoint(synthetic_store, tmp_path):
    run = tmp_path / "run"
    train(load_train_config(None, {"stores": [synthetic_store], "run.out_dir": str(run), **FAST,
                                   "optim.max_steps": 3, "run.checkpoint_every": 2}))
    assert not (run / BEST).exists()
    out = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "out")])
    assert out.exit_code == 0, out.output
    assert f"its newest checkpoint (the run has no validation: no {BEST})" in out.output
    assert f"exported {checkpoint_dir(run, 3)}" in out.output


def test_the_log_summary_shows_the_curve_and_the_best_step(synthetic_store, val_store,
                                                           tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(Validation, "evaluate", _scripted([1.5, 2.25, 1.75], val_store))
    train(_cfg(synthetic_store, run, [val_store], **{"optim.max_steps": 6,
                                                     "run.checkpoint_every": 2,
                                                     "run.tensorboard": True}))
    summary = summarize_log(read_log(run))
    v = summary["validation"]
    assert [(p["step"], p["tau"]) for p in v["curve"]] == [(2, 1.5), (4, 2.25), (6, 1.75)]
    assert v["best_step"] == 4 and v["best"]["tree_tau"] == {"16": 2.75}
    text = format_summary(summary)
    assert "best: step 4 (tau 2.2500, tree@16 2.7500)" in text
    assert summarize_log(read_log(run))["validation"] is not None
    tags = tensorboard_tags(run)
    assert tags["val/tau"] == [(2, 1.5), (4, 2.25), (6, 1.75)]
    assert [s for s, _ in tags["val/tree_tau_16"]] == [2, 4, 6]


def _refused(synthetic_store, tmp_path, val, **extra) -> str:
    out = tmp_path / "refused"
    with pytest.raises(TrainError) as e:
        train(_cfg(synthetic_store, out, val, **{"optim.max_steps": 1}, **extra))
    assert not out.exists()  # refused before anything was written
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_validation_store_of_another_target_is_refused(synthetic_store, tmp_path):
    other = str(tmp_path / "other.zarr")
    build_store(other, rows=8, parts=1, name="another-model", first_sample=24)
    message = _refused(synthetic_store, tmp_path, [other])
    assert message.startswith(f"--val-store {other} is a store of another target")
    assert "target.name_or_path: 'tiny' != 'another-model'" in message


def test_a_validation_store_sharing_samples_with_the_train_store_is_refused(synthetic_store,
                                                                             tmp_path):
    # rows 0..7 hold the token ids of the train store's rows 0..7
    shared = str(tmp_path / "shared.zarr")
    build_store(shared, rows=16, parts=2, first_sample=16)  # rows 16..23 of the train store
    message = _refused(synthetic_store, tmp_path, [shared])
    assert f"--val-store {shared} part 0 sample 0 (source row 0) has the same token ids as " \
           f"--store {synthetic_store} part 1 sample 4 (source row 16)" in message
    assert "(8 validation sample(s) shared with the train stores)" in message


def test_the_same_validation_store_twice_is_refused(synthetic_store, val_store, tmp_path):
    message = _refused(synthetic_store, tmp_path, [val_store, val_store])
    assert "holds the same token ids as --val-store" in message


def test_an_empty_validation_store_is_refused(synthetic_store, tmp_path):
    empty = str(tmp_path / "empty.zarr")
    build_store(empty, rows=4, parts=1, first_sample=24, unfinished=1)  # nothing committed
    message = _refused(synthetic_store, tmp_path, [empty])
    assert message == (f"--val-store {empty} holds no sample in a complete part: nothing to "
                       "validate on; extract it first, or drop it")


def test_validation_settings_without_a_validation_store_are_refused(synthetic_store, tmp_path):
    with pytest.raises(TrainError, match=r"--val-limit \(validation.limit\) must be 64 unless "
                                         r"--val-store is given"):
        _cfg(synthetic_store, tmp_path, [], **{"validation.limit": 8})
    with pytest.raises(TrainError, match=r"run.patience must be left unset unless"):
        _cfg(synthetic_store, tmp_path, [], **{"run.patience": 3})
    with pytest.raises(TrainError, match="does not validate under --fsdp"):
        _cfg(synthetic_store, tmp_path, ["v.zarr"], **{"run.fsdp": True})
    with pytest.raises(TrainError, match="validation.best_by must be tau when"):
        _cfg(synthetic_store, tmp_path, ["v.zarr"], **{"validation.best_by": "tree_tau",
                                                       "validation.tree_budgets": []})
