"""`dflash eval` on the command line: side-by-side checkpoints, outputs, refusals."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_train.drafter import save_drafter
from dflash_train.evaluate.command import eval_command
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.store_schema import open_store
from tests.evaluate.conftest import random_drafter, synthetic_meta


def _run(*args: str):
    return CliRunner().invoke(eval_command, [*args, "--no-progress"], catch_exceptions=False)


def test_two_checkpoints_side_by_side_on_the_same_blocks(tmp_path, regen_store,
                                                         trained_drafter_dir,
                                                         random_drafter_dir):
    out = tmp_path / "out"
    result = _run("--store", regen_store, "--mode", "all", "--tree-budget", "4,16",
                  "--out", str(out), "--show", "2", trained_drafter_dir, random_drafter_dir)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "trained" in line)
    assert "rand" in header  # one table, both checkpoints as columns
    report = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in report["checkpoints"]] == ["trained", "rand"]
    trained, rand = (c["offline"] for c in report["checkpoints"])
    assert trained["n_blocks"] == rand["n_blocks"] > 0
    assert trained["mean_tau"] > rand["mean_tau"] >= 1.0
    assert set(trained["tree"]) == {"4", "16"}
    rows = pq.read_table(out / "blocks.parquet").to_pydict()
    walks = {(name, b): [(p, s, a) for c, p, s, a, tb in
                         zip(rows["checkpoint"], rows["part"], rows["sample"], rows["anchor"],
                             rows["tree_budget"], strict=True) if c == name and tb == b]
             for name in ("trained", "rand") for b in (None, 4, 16)}
    chain = walks[("trained", None)]
    assert len(chain) == trained["n_blocks"]
    # --mode all: every walk of either checkpoint drafts the same blocks
    assert all(blocks == chain for blocks in walks.values())
    # --show: two decoded blocks, each with the target line and one line per checkpoint.
    assert result.output.count("--- part") == 2
    assert result.output.count("  target  : ") == 2
    assert result.output.count("(streak ") == 4


def test_the_same_command_twice_gives_the_same_numbers(regen_store, trained_drafter_dir):
    args = ("--store", regen_store, "--limit", "5", "--seed", "3", "--json",
            trained_drafter_dir)
    first, second = _run(*args), _run(*args)
    assert first.exit_code == 0, first.output
    assert first.output == second.output
    report = json.loads(first.output)
    assert report["samples"] == 5 and report["limit"] == 5
    other = json.loads(_run("--store", regen_store, "--limit", "5", "--seed", "4", "--json",
                            trained_drafter_dir).output)
    assert other["checkpoints"][0]["offline"] != report["checkpoints"][0]["offline"]


@pytest.mark.parametrize("overrides, named", [
    (dict(target_layer_ids=[0, 3]), ["[0, 3]", "[0, 1, 2]"]),
    (dict(vocab_size=400), ["vocab_size: checkpoint 400, store 344"]),
    (dict(hidden_size=32), ["hidden_size: checkpoint 32, store 64"]),
    (dict(num_target_layers=6), ["checkpoint expects a 6-layer target, store target has 4"]),
])
def test_a_drafter_for_another_target_is_refused_naming_both(tmp_path, regen_store,
                                                              overrides, named):
    path = save_drafter(random_drafter(**overrides), tmp_path / "other")
    result = _run("--store", regen_store, str(path))
    assert result.exit_code == 1
    for text in named:
        assert text in result.output


def test_a_training_checkpoint_from_another_target_is_refused_naming_both(
        tmp_path, regen_store, random_drafter_dir):
    ckpt = tmp_path / "step_100"
    shutil.copytree(random_drafter_dir, ckpt / "drafter")
    meta = synthetic_meta(regenerated=True, name="/models/other-target", num_layers=6)
    (ckpt / "provenance.json").write_text(json.dumps(meta.to_dict()))
    (ckpt / "COMPLETE").write_text("step 100\n")
    result = _run("--store", regen_store, str(ckpt))
    assert result.exit_code == 1
    store_name = open_store(regen_store).meta.target.name_or_path
    assert f"target.name_or_path: '/models/other-target' != {store_name!r}" in result.output
    assert "target.num_hidden_layers: 6 != 4 (checkpoint != store)" in result.output


def test_training_checkpoint_and_third_party_drafter_evaluate_together(
        tmp_path, regen_store, random_drafter_dir):
    ckpt = tmp_path / "step_200"
    shutil.copytree(random_drafter_dir, ckpt / "drafter")
    (ckpt / "provenance.json").write_text(json.dumps(open_store(regen_store).meta.to_dict()))
    (ckpt / "COMPLETE").write_text("step 200\n")
    # A z-lab-style directory: no num_target_layers, no auto_map, an extra unknown field.
    zlab = tmp_path / "zlab-drafter"
    shutil.copytree(random_drafter_dir, zlab)
    config = json.loads((zlab / "config.json").read_text())
    for key in ("num_target_layers", "auto_map"):
        config.pop(key)
    config["transformers_version"] = "4.57.1"
    (zlab / "config.json").write_text(json.dumps(config))
    (zlab / "checksums.json").unlink()  # dflash's own record: z-lab directories have none
    result = _run("--store", regen_store, "--limit", "4", "--json", str(ckpt), str(zlab))
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    first, second = report["checkpoints"]
    assert first["trained_on"] == open_store(regen_store).meta.source.paths
    assert second["trained_on"] is None
    # The same weights: the same numbers.
    assert first["offline"] == second["offline"]


def test_plot_needs_matplotlib_or_says_how_to_get_it(tmp_path, regen_store,
                                                     random_drafter_dir):
    png = tmp_path / "acceptance.png"
    result = _run("--store", regen_store, "--limit", "2", "--plot", str(png),
                  random_drafter_dir)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.exit_code == 1 and "dflash-train[plot]" in result.output
        assert not png.exists()
        return
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_user_mistakes_are_one_line_errors(tmp_path, regen_store, random_drafter_dir):
    result = _run("--store", str(tmp_path / "nowhere.zarr"), random_drafter_dir)
    assert result.exit_code == 1 and "no such store" in result.output
    result = _run("--store", regen_store, "--online", random_drafter_dir)
    assert result.exit_code == 1 and "--online needs --model" in result.output
    result = _run("--store", regen_store, str(tmp_path))
    assert result.exit_code == 1 and "not a drafter or checkpoint" in result.output
    assert "Traceback" not in result.output
    result = _run("--store", regen_store, "--tree-budget", "4,x", random_drafter_dir)
    assert result.exit_code == 2 and "comma-separated integers" in result.output


def test_checkpoints_with_different_block_sizes_share_the_anchors(tmp_path, regen_store,
                                                                  random_drafter_dir):
    small = save_drafter(random_drafter(seed=9, block_size=4), tmp_path / "b4")
    result = _run("--store", regen_store, "--mode", "all", "--json", random_drafter_dir,
                  str(small))
    assert result.exit_code == 0, result.output
    b8, b4 = (c["offline"] for c in json.loads(result.output)["checkpoints"])
    assert (b8["block_size"], b4["block_size"]) == (8, 4)
    assert b8["n_blocks"] == b4["n_blocks"]
    assert len(b8["cond_accept"]) == 7 and len(b4["cond_accept"]) == 3


def test_position_bin_sets_the_bin_width_and_below_one_is_refused(regen_store,
                                                                  random_drafter_dir):
    result = _run("--store", regen_store, "--limit", "4", "--position-bin", "8", "--json",
                  random_drafter_dir)
    assert result.exit_code == 0, result.output
    offline = json.loads(result.output)["checkpoints"][0]["offline"]
    by_position = offline["tau_by_position"]
    assert by_position["bin_tokens"] == 8
    assert [b["start"] % 8 for b in by_position["bins"]] == [0] * len(by_position["bins"])
    assert sum(b["n_blocks"] for b in by_position["bins"]) == offline["n_blocks"]
    result = _run("--store", regen_store, "--position-bin", "0", random_drafter_dir)
    assert result.exit_code == 2 and "--position-bin" in result.output
    cfg = EvalConfig(store=regen_store, checkpoints=[random_drafter_dir], progress=False,
                     settings=EvalSettings(position_bin=0))
    with pytest.raises(EvalError, match="--position-bin 0: a bin spans at least 1 token"):
        run_eval(cfg)
