"""benchmarks/sampled_drafters.py without a target: which stores and runs it plans, what it
refuses, and the table and needed-prompts arithmetic it reports. Extract, train and eval are
replaced; nothing here loads a model."""

import json
import sys
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest

import benchmarks.sampled_drafters as bench
from benchmarks.real_target import PRESETS
from dflash_train.run_layout import COMPLETE, checkpoint_dir


def greedy_dir(root, preset="quick", steps=None, finished=True):
    """A real_target --out as it ends: prompts, stores (empty folders), results.json and,
    with `finished`, run_1L's last checkpoint."""
    cfg = PRESETS[preset] if steps is None else replace(PRESETS[preset], steps=steps)
    for name in ("train.zarr", "held_out.zarr"):
        (root / name).mkdir(parents=True)
    for name in ("train.jsonl", "held_out.jsonl"):
        (root / name).write_text("{}\n")
    (root / "results.json").write_text(json.dumps({"preset": preset, "config": asdict(cfg)}))
    if finished:
        last = checkpoint_dir(root / "run_1L", cfg.steps)
        last.mkdir(parents=True)
        (last / COMPLETE).write_text("")
    return root


def plan_for(tmp_path, steps=150, temperatures=(0.0, 0.7, 1.0), **made):
    stores = greedy_dir(tmp_path / "dir", **made)
    results = bench.greedy_results(stores, made.get("preset", "quick"))
    return bench.make_plan(stores, tmp_path / "out", results, temperatures, 0.7, steps)


def test_the_plan_samples_the_same_prompts_and_reuses_a_matching_greedy_run(tmp_path):
    plan = plan_for(tmp_path)
    stores, out = tmp_path / "dir", tmp_path / "out"
    assert [(j.prompts, j.store, j.temperature, j.seed) for j in plan.stores] == [
        (stores / "train.jsonl", out / "train_T0.7.zarr", 0.7, 0),
        (stores / "held_out.jsonl", out / "held_out_T0.7.zarr", 0.7, 1),
        (stores / "held_out.jsonl", out / "held_out_T1.zarr", 1.0, 1)]
    assert plan.held_out == {0.0: stores / "held_out.zarr", 0.7: out / "held_out_T0.7.zarr",
                             1.0: out / "held_out_T1.zarr"}
    greedy, sampled = plan.drafters
    assert (greedy.train_store, greedy.out, greedy.reused) == (stores / "train.zarr", stores,
                                                               True)
    assert (sampled.name, sampled.train_store, sampled.out, sampled.reused) == (
        "T=0.7", out / "train_T0.7.zarr", out / "sampled_T0.7", False)
    assert plan.cfg == replace(PRESETS["quick"], steps=150, eval_every=150)


@pytest.mark.parametrize("case", ["other steps", "unfinished run", "other recipe"])
def test_a_greedy_run_of_another_recipe_or_length_is_trained_again_in_out(tmp_path, case):
    if case == "other steps":
        plan = plan_for(tmp_path, steps=40)
    elif case == "unfinished run":
        plan = plan_for(tmp_path, finished=False)
    else:
        stores = greedy_dir(tmp_path / "dir")
        made = json.loads((stores / "results.json").read_text())
        made["config"]["lr"] = 1e-3
        plan = bench.make_plan(stores, tmp_path / "out", made, (0.0,), 0.7, 150)
    greedy = plan.drafters[0]
    assert (greedy.out, greedy.reused) == (tmp_path / "out" / "greedy", False)


@pytest.mark.parametrize("preset, command", [
    ("quick", "python -m benchmarks.real_target --quick --out"),
    ("full", "python -m benchmarks.real_target --out")])
def test_a_dir_without_the_greedy_pieces_is_refused_with_the_command_that_makes_them(
        tmp_path, preset, command):
    (tmp_path / "train.zarr").mkdir()
    with pytest.raises(SystemExit) as refused:
        bench.greedy_results(tmp_path, preset)
    said = str(refused.value.code)
    assert f"{command} {tmp_path}`" in said
    assert "train.jsonl, held_out.jsonl, held_out.zarr, results.json" in said


def test_a_dir_of_another_preset_is_refused_naming_it(tmp_path):
    greedy_dir(tmp_path, preset="full")
    with pytest.raises(SystemExit, match="pass --preset full"):
        bench.greedy_results(tmp_path, "quick")


def test_main_refuses_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran despite a refusal"))
    stores = greedy_dir(tmp_path / "dir")
    for args in (["--out", str(stores)], ["--out", str(tmp_path / "o"), "--temperatures", "-1"],
                 ["--out", str(tmp_path / "o"), "--train-temperature", "0"]):
        monkeypatch.setattr(sys, "argv", ["sampled_drafters.py", "--stores", str(stores), *args])
        with pytest.raises(SystemExit):
            bench.main()
    assert "--out must differ from --stores" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(sys, "argv", ["sampled_drafters.py", "--stores", str(stores), "--out",
                                      str(tmp_path / "file" / "sub")])
    with pytest.raises(SystemExit, match="--out .* is a file"):
        bench.main()


def test_temperatures_are_parsed_sorted_once_and_bad_ones_named():
    assert bench.parse_temperatures("1.0, 0,0.7,0.70") == (0.0, 0.7, 1.0)
    for bad in ("0,hot", "-0.5", "inf", ""):
        with pytest.raises(SystemExit, match="--temperatures"):
            bench.parse_temperatures(bad)


def test_prompts_needed_scale_the_measured_interval_as_one_over_sqrt_n():
    assert bench.prompts_needed(0.04, 16) == 64  # exactly 64, not rounded up to 65
    assert bench.prompts_needed(0.01, 16) == 4
    assert bench.prompts_needed(0.03, 10) == 23  # 22.5 rounded up
    assert bench.prompts_needed(None, 16) is None


def figures(base, prompts=16):
    """One drafter's evals at one held-out temperature: walk i at base + i, +-0.04."""
    return {"prompts": prompts, **{w: {"tau": base + i, "ci95": [base + i - 0.04,
                                                                  base + i + 0.04],
                                       "blocks": 100} for i, w in enumerate(bench.WALKS)}}


def fake_results(need=None):
    evals = {"greedy": {"0.0": figures(1.2), "0.7": figures(1.1)},
             "T=0.7": {"0.0": figures(1.15), "0.7": figures(1.3)}}
    return {"preset": "quick", "steps": 150, "date": "d", "temperatures": [0.0, 0.7],
            "evals": evals, "prompts_for_0.02": need}


def test_the_table_has_a_row_per_drafter_and_a_column_per_temperature_and_walk():
    table = bench.markdown(fake_results())
    assert "| trained on | T=0 chain | T=0 tree@16 | T=0 tree@32 | T=0 tree@64 | T=0.7 chain |" \
        in table
    assert "| greedy | 1.200 (1.160-1.240) | 2.200 (2.160-2.240) |" in table
    assert "| T=0.7 | 1.150 (1.110-1.190) |" in table
    assert table.count("| greedy |") == 1 and "needs about" not in table


def test_the_needed_prompts_come_from_the_evals_at_the_train_temperature():
    results = fake_results()
    need = bench.needed_at(results["evals"], 0.7)
    assert need == {d: dict.fromkeys(bench.WALKS, 64) for d in ("greedy", "T=0.7")}
    results["prompts_for_0.02"] = {"temperature": 0.7, "prompts": 16, "by_drafter": need}
    assert "needs about 64 held-out prompts" in bench.markdown(results)
    assert "1/sqrt(prompts)" in bench.markdown(results)


def test_complete_stores_are_kept_and_the_rest_extracted(tmp_path, monkeypatch):
    import dflash_train.extract.pipeline as pipeline

    plan = plan_for(tmp_path)
    extracted = []
    monkeypatch.setattr(bench, "is_complete", lambda job: job.temperature == 1.0)
    monkeypatch.setattr(bench, "extract_config", lambda greedy, job: (greedy, job.store))
    monkeypatch.setattr(pipeline, "run_extract", lambda cfg, echo: extracted.append(cfg) or
                        SimpleNamespace(lines=lambda: ["done"]))
    seconds = bench.build_stores(plan, tmp_path / "dir")
    stores, out = tmp_path / "dir", tmp_path / "out"
    assert extracted == [(str(stores / "train.zarr"), out / "train_T0.7.zarr"),
                         (str(stores / "held_out.zarr"), out / "held_out_T0.7.zarr")]
    assert set(seconds) == {"extract train_T0.7.zarr", "extract held_out_T0.7.zarr"}


def test_a_sampled_store_is_extracted_as_its_greedy_one_was_but_for_the_sampling(monkeypatch,
                                                                                   tmp_path):
    import dflash_train.store_schema as store_schema

    meta = SimpleNamespace(target=SimpleNamespace(name_or_path="/m"), context_layer_ids=[1, 5],
                           top_k=16, source=SimpleNamespace(max_length=1024),
                           hidden_dtype="float32", extra={"overlong": "truncate",
                                                          "rows_per_part": 256,
                                                          "max_new_tokens": 64})
    monkeypatch.setattr(store_schema, "open_store", lambda url: SimpleNamespace(meta=meta))
    job = plan_for(tmp_path).stores[1]
    cfg = bench.extract_config("greedy.zarr", job)
    assert (cfg.model, cfg.data, cfg.out, cfg.layers, cfg.top_k, cfg.max_length,
            cfg.rows_per_part, cfg.max_new_tokens, cfg.dtype, cfg.regenerate) == (
        "/m", [str(job.prompts)], str(job.store), "1,5", 16, 1024, 256, 64, "float32", True)
    assert (cfg.sampling.temperature, cfg.sampling.seed, cfg.sampling.top_p,
            cfg.sampling.top_k) == (0.7, 1, 1.0, 0)


def test_only_drafters_not_reused_are_trained_and_each_is_read_at_its_last_step(tmp_path,
                                                                               monkeypatch):
    plan = plan_for(tmp_path)
    trained = []
    monkeypatch.setattr(bench, "train_drafter",
                        lambda cfg, store, out, layers: trained.append((store, out, layers)))
    checkpoints = bench.train_drafters(plan)
    out = tmp_path / "out"
    assert trained == [(str(out / "train_T0.7.zarr"), out / "sampled_T0.7", 1)]
    assert checkpoints == {"greedy": checkpoint_dir(tmp_path / "dir" / "run_1L", 150),
                           "T=0.7": checkpoint_dir(out / "sampled_T0.7" / "run_1L", 150)}


def test_a_run_writes_its_results_and_the_prompts_needed_at_the_train_temperature(
        tmp_path, monkeypatch):
    plan = plan_for(tmp_path, temperatures=(0.0, 0.7))
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(bench, "build_stores", lambda plan, stores: {})
    monkeypatch.setattr(bench, "train_drafters",
                        lambda plan: {d.name: d.out / "ckpt" for d in plan.drafters})
    monkeypatch.setattr(bench, "evaluate_store", lambda held, checkpoints: {
        name: figures(1.0 + 0.1 * i) for i, name in enumerate(checkpoints)})
    results = bench.run(plan, tmp_path / "dir", out, "quick")
    written = json.loads((out / "results.json").read_text())
    assert written["prompts_for_0.02"]["temperature"] == 0.7
    assert written["prompts_for_0.02"]["by_drafter"]["greedy"]["chain"] == 64
    assert written["drafters"]["greedy"] == {"train_store": "--stores/train.zarr",
                                            "checkpoint": "--stores/ckpt", "reused": True}
    assert written["held_out_stores"]["0.7"] == "--out/held_out_T0.7.zarr"
    assert (out / "results.md").read_text() == bench.markdown(results)
    assert (out / "tau_by_temperature.png").stat().st_size > 0
