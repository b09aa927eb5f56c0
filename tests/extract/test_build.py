"""build_extract makes a run ready to fill the store without writing a byte of it, and the
run it makes fills the store run_extract does; plan_extract gives each rank its parts."""

import os

from conftest import assert_same_samples, run_extract_cfg, store_samples

from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.fill import fill_store
from dflash_train.extract.pipeline import build_extract, plan_extract
from dflash_train.store_schema import open_store

SETTINGS = dict(device="cpu", dtype="float32", rows_per_part=5, shard_tokens=16,
                batch_tokens=96, layers="0,1,2", progress=False)


def test_a_built_run_writes_nothing_until_filled_then_fills_what_run_extract_fills(
        qwen3_dir, chats_jsonl, tmp_path):
    out = str(tmp_path / "built.zarr")
    run = build_extract(ExtractConfig(model=qwen3_dir, data=[chats_jsonl], out=out,
                                      **SETTINGS), 0, 1, echo=lambda _: None)
    assert run.target.model is not None and run.servers == []
    assert not os.path.exists(out) and not os.path.exists(out + ".locks")
    summary = fill_store(run)
    assert summary.store_complete and summary.parts_done == [0, 1, 2]
    assert open_store(out).meta == run.meta
    reference = str(tmp_path / "reference.zarr")
    run_extract_cfg(qwen3_dir, chats_jsonl, reference)
    assert_same_samples(store_samples(out), store_samples(reference))


def test_rank_r_of_w_plans_parts_r_r_plus_w_and_budgets_only_their_rows(qwen3_dir,
                                                                         chats_jsonl):
    cfg = ExtractConfig(model=qwen3_dir, data=[chats_jsonl], out="unused.zarr",
                        **{**SETTINGS, "rows_per_part": 2}, regenerate=True,
                        max_new_tokens=8)
    plan = plan_extract(cfg, 1, 3, echo=lambda _: None)
    assert [p.index for p in plan.parts] == list(range(7))  # 14 rows, 2 a part
    assert [p.index for p in plan.mine] == [1, 4]
    mine = [2, 3, 8, 9]
    assert [i.row for i in plan.scanned] == mine
    assert plan.budgets == {i.row: len(i.input_ids) + 8 for i in plan.scanned}
    assert plan.budget(plan.mine[0]) == plan.budgets[2] + plan.budgets[3]
