"""Issue 61's size and output cases: sizes past what they size, and benchmark drivers that
fail late or with a traceback.

- A train setting typed `int | None` past a 64-bit integer is refused for that reason, not
  as "is not a int | None".
- A benchmark driver checks where it writes before any work, and ends on a package error
  (DflashError) with one line and exit status 1 (benchmarks/driver.py).
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import benchmarks.arms as arms
import benchmarks.dflash2_vs_dflash as dflash2_vs_dflash
import benchmarks.fp8_store as fp8_store
import benchmarks.gamma_ddtree as gamma_ddtree
import benchmarks.live_decoding as live_decoding
import benchmarks.tau_vs_time as tau_vs_time
import benchmarks.weights_optimizers as weights_optimizers
from dflash_train.cli import main
from dflash_train.evaluate.tree import MAX_TREE_BUDGET, budget_cap_refusal, tree_budget_refusal
from dflash_train.train.config import load_train_config
from dflash_train.train.errors import TrainError
from tests.evaluate.conftest import save_eos_target
from tests.reliability.corrupt_store import make_store

HUGE = 10**20


@pytest.mark.parametrize("key", ["optim.max_steps", "run.patience", "model.draft_vocab_size",
                                 "validation.limit"])
@pytest.mark.parametrize("value", [HUGE, str(HUGE)])
def test_an_optional_integer_past_64_bits_is_refused_for_that_reason(key, value):
    with pytest.raises(TrainError, match="beyond a 64-bit integer") as refused:
        load_train_config(None, {key: value})
    assert "is not a" not in str(refused.value)


def test_an_optional_setting_of_the_wrong_kind_says_what_it_expected():
    with pytest.raises(TrainError, match=r"expected int, got 'many'"):
        load_train_config(None, {"optim.max_steps": "many"})
    assert load_train_config(None, {"optim.max_steps": "none"}).optim.max_steps is None


def _refusal(main, monkeypatch, *argv: str) -> str:
    """What a benchmark's `main` exits with on `argv`: a message (exit status 1, printed as
    is, as the dflash CLI prints it), never another exception (a traceback)."""
    monkeypatch.setattr(sys, "argv", ["benchmark", *argv])
    with pytest.raises(SystemExit) as stopped:
        main()
    said = stopped.value.code
    assert isinstance(said, str), said
    return said


def _never(*_args, **_kwargs):
    raise AssertionError("the benchmark started its work before checking its options")


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "taken"
    path.write_text("not a directory\n")
    return path


def test_live_decoding_refuses_an_out_that_is_a_file_before_loading_anything(
        monkeypatch, tmp_path, a_file):
    monkeypatch.setattr(live_decoding, "load", _never)
    said = _refusal(live_decoding.main, monkeypatch, "--model", str(tmp_path), "--store",
                    str(tmp_path), "--checkpoint", str(tmp_path), "--out", str(a_file))
    assert "--out" in said and "is a file" in said
    assert a_file.read_text() == "not a directory\n"


def test_live_decoding_says_a_missing_store_in_one_line(monkeypatch, tmp_path):
    out = tmp_path / "out"
    said = _refusal(live_decoding.main, monkeypatch, "--model", str(tmp_path), "--store",
                    str(tmp_path / "none.zarr"), "--checkpoint", str(tmp_path), "--out",
                    str(out))
    assert said.startswith("Error: ") and "none.zarr" in said
    assert not (out / "live.json").exists()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))


def test_live_decoding_says_another_targets_model_in_one_line(monkeypatch, tmp_path, store):
    for model in (tmp_path / "no_target", Path(save_eos_target(tmp_path / "other"))):
        said = _refusal(live_decoding.main, monkeypatch, "--model", str(model), "--store",
                        store, "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"))
        assert said.startswith("Error: "), said


def test_live_decoding_says_a_missing_checkpoint_in_one_line(monkeypatch, tmp_path, store):
    import dflash_train.evaluate.online as online

    monkeypatch.setattr(online, "load_online_target", lambda *_a, **_k: None)
    said = _refusal(live_decoding.main, monkeypatch, "--model", str(tmp_path), "--store",
                    store, "--checkpoint", str(tmp_path / "no_drafter"), "--out",
                    str(tmp_path / "out"))
    assert said.startswith("Error: ") and "no_drafter" in said


@pytest.fixture
def stores_dir(tmp_path, store) -> Path:
    """A real_target.py working directory whose stores are the tiny 64-id one."""
    stores = tmp_path / "stores"
    stores.mkdir()
    for name in ("train.zarr", "held_out.zarr"):
        (stores / name).symlink_to(store)
    return stores


def test_gamma_ddtree_refuses_an_out_that_is_a_file_before_training(monkeypatch, stores_dir,
                                                                    a_file):
    monkeypatch.setattr(gamma_ddtree, "train_arm", _never)
    said = _refusal(gamma_ddtree.main, monkeypatch, "--stores", str(stores_dir), "--out",
                    str(a_file))
    assert "--out" in said and "is a file" in said


def test_gamma_ddtree_says_a_vocabulary_its_recipe_does_not_fit_in_one_line(
        monkeypatch, tmp_path, stores_dir):
    out = tmp_path / "out"
    said = _refusal(gamma_ddtree.main, monkeypatch, "--stores", str(stores_dir), "--out",
                    str(out), "--steps", "1", "--seeds", "1")
    assert said.startswith("Error: ") and "4096" in said
    assert not (out / "gamma.json").exists()


DRIVERS = {
    "arms": (arms, "train_arms", ["--store", "s", "--held-out", "h", "--arm", "a=k=v"]),
    "dflash2_vs_dflash": (dflash2_vs_dflash, "train_arms", ["--store", "s", "--held-out", "h"]),
    "fp8_store": (fp8_store, "copy_store", ["--store", "s", "--held-out", "h"]),
    "weights_optimizers": (weights_optimizers, "train_arms", ["--store", "s", "--held-out",
                                                              "h"]),
    "tau_vs_time": (tau_vs_time, "seconds_by_step", ["run", "a=report.json"]),
}
"""Benchmark -> (module, its first expensive step, arguments besides --out)."""


@pytest.mark.parametrize("name", DRIVERS)
def test_every_driver_refuses_an_out_it_cannot_write_before_its_work(monkeypatch, tmp_path,
                                                                      a_file, name):
    module, work, argv = DRIVERS[name]
    monkeypatch.setattr(module, work, _never)
    # fp8_store and weights_optimizers start afresh: any existing --out is refused;
    # tau_vs_time writes a PNG: a directory in its place is; the others' a file.
    taken = {"fp8_store": tmp_path, "weights_optimizers": tmp_path,
             "tau_vs_time": tmp_path}.get(name, a_file)
    said = _refusal(module.main, monkeypatch, *argv, "--out", str(taken))
    assert said.startswith("--out") and "choose another --out" in said, said


@pytest.mark.parametrize("depth, top_k", [(1, 3), (3, 2), (4, 3), (2, 5)])
def test_a_grown_tree_holds_exactly_max_tree_nodes_whatever_the_budget(depth, top_k):
    from dflash_train.evaluate.tree import (
        build_tree,
        grow_tree,
        max_tree_nodes,
        selector_candidates,
    )

    logp = torch.log_softmax(torch.randn(depth, top_k), -1).sort(-1, descending=True).values
    unary = build_tree(logp, torch.arange(depth * top_k).view(depth, top_k), 10**6)
    moves = torch.log_softmax(torch.randn(depth, top_k, top_k), -1)
    selector = grow_tree(selector_candidates(moves, torch.arange(depth * top_k)
                                             .view(depth, top_k)), 10**6)
    assert unary.size == selector.size == max_tree_nodes(depth, top_k)
    assert max_tree_nodes(depth, top_k) == sum(top_k**d for d in range(1, depth + 1))


VALIDATED = {"validation.stores": ["val.zarr"]}


def test_a_tree_budget_past_what_a_block_holds_says_the_bound():
    # two candidates per depth over a 16-token block's 15 drafted slots: 2 + 4 + ... + 2**15;
    # within it, the cap still applies (MAX_TREE_BUDGET is below every block's bound but k=1's)
    most = 2**16 - 2
    assert tree_budget_refusal(most, 15, 2) == budget_cap_refusal(most)
    assert tree_budget_refusal(most + 1, 15, 2) == (
        "at most 65,534 nodes, the most a DDTree grown from one block holds: 2 candidates per "
        "depth over 15 depths (2 + 2^2 + ... + 2^15)")
    assert tree_budget_refusal(16, 15, 1) == ("at most 15 nodes, the most a DDTree grown from "
                                              "one block holds: 1 candidates per depth over 15 "
                                              "depths (1 + 1^2 + ... + 1^15)")


@pytest.mark.parametrize("budgets", ["16,10000", str(MAX_TREE_BUDGET + 1)])
def test_a_tree_budget_past_the_cap_is_refused_by_eval_and_validation(tmp_path, budgets):
    # 10000 was accepted and grew memory ~20 MB/s under --online on the tiny target
    with pytest.raises(TrainError, match=rf"at most {MAX_TREE_BUDGET:,} nodes: a verify"):
        load_train_config(None, {**VALIDATED, "validation.tree_budgets": budgets})
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "ckpt"), "--store",
                                       str(tmp_path / "none.zarr"), "--online",
                                       "--tree-budget", budgets])
    assert result.exit_code == 2, result.output  # click's usage error: nothing was read
    assert f"at most {MAX_TREE_BUDGET:,} nodes" in result.output
    assert "Traceback" not in result.output
    cfg = load_train_config(None, {**VALIDATED, "validation.tree_budgets": str(MAX_TREE_BUDGET)})
    assert cfg.validation.tree_budgets == (MAX_TREE_BUDGET,)


def test_a_dflash2_validation_budget_of_10_to_the_20_is_refused_with_the_bound():
    with pytest.raises(TrainError, match=r"beyond a 64-bit integer"):
        load_train_config(None, {**VALIDATED, "model.kind": "dflash2",
                                 "validation.tree_budgets": str(HUGE)})
    with pytest.raises(TrainError, match=rf"at most {MAX_TREE_BUDGET:,} nodes"):
        load_train_config(None, {**VALIDATED, "model.kind": "dflash2",
                                 "validation.tree_budgets": str(2**62)})


@pytest.mark.parametrize("budgets", [str(HUGE), f"16,{2**63}"])
def test_eval_refuses_a_huge_tree_budget_before_reading_anything(tmp_path, budgets):
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "ckpt"), "--store",
                                       str(tmp_path / "none.zarr"), "--online",
                                       "--tree-budget", budgets])
    assert result.exit_code == 2, result.output  # click's usage error: nothing was read
    assert "--tree-budget" in result.output and f"at most {MAX_TREE_BUDGET:,}" in result.output
    assert "Traceback" not in result.output


def test_live_decoding_refuses_a_budget_past_what_the_drafters_block_holds(monkeypatch,
                                                                           tmp_path):
    drafter = SimpleNamespace(walks=False, block_size=8,
                              config=SimpleNamespace(draft_vocab=344))
    monkeypatch.setattr(live_decoding, "load", lambda *_: (None, None, drafter))
    monkeypatch.setattr(live_decoding, "prompts_of", _never)
    monkeypatch.setattr(live_decoding, "measure", _never)
    said = _refusal(live_decoding.main, monkeypatch, "--model", "m", "--store", "s",
                    "--checkpoint", "c", "--out", str(tmp_path / "out"), "--ignore-eos",
                    "--budgets", f"16,{HUGE}")
    # 64 candidates drafted per slot over the block's 7 drafted slots: 64 + ... + 64**7
    most = sum(64**d for d in range(1, 8))
    assert said.startswith(f"--budgets {HUGE}: must be at most {most:,} nodes")
