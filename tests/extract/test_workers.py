"""Several worker processes (RANK / WORLD_SIZE) fill one store exactly as one process does."""

import subprocess

from conftest import (
    REPO,
    assert_same_samples,
    cli_args,
    cli_command,
    cli_env,
    run_extract_cfg,
    store_samples,
)

from dflash_train.store_schema import open_store, validate


def test_two_workers_into_one_store_equal_one_process(qwen3_5_dir, chats_jsonl, tmp_path):
    single = str(tmp_path / "single.zarr")
    run_extract_cfg(qwen3_5_dir, chats_jsonl, single)
    shared = str(tmp_path / "shared.zarr")
    workers = [
        subprocess.Popen(cli_command(cli_args(qwen3_5_dir, chats_jsonl, shared)),
                         env=cli_env(RANK=str(r), WORLD_SIZE="2"), cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outputs = [w.communicate(timeout=300) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [e[-2000:] for _, e in outputs]
    # rank 0 took parts 0 and 2, rank 1 part 1; whichever finished last saw the whole store
    assert "parts written: [0, 2]" in outputs[0][0] and "parts written: [1]" in outputs[1][0]
    assert any("store complete" in o for o, _ in outputs)
    assert open_store(shared).complete and validate(shared) == []
    assert_same_samples(store_samples(shared), store_samples(single))
    assert open_store(shared).meta.mismatches(open_store(single).meta) == []


def test_a_rank_only_fills_its_own_parts(qwen3_dir, chats_jsonl, tmp_path):
    out = str(tmp_path / "hs.zarr")
    summary = run_extract_cfg(qwen3_dir, chats_jsonl, out, rank=1, world_size=2)
    assert summary.parts_done == [1] and not summary.store_complete
    assert [p.index for p in open_store(out).parts()] == [1]
    summary = run_extract_cfg(qwen3_dir, chats_jsonl, out, rank=0, world_size=2)
    assert summary.parts_done == [0, 2] and summary.store_complete
