"""Two processes under torchrun (gloo, CPU), with DDP or FSDP2, train what one process trains."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import load_drafter
from dflash_train.drafter.config import DRAFTER_KINDS
from dflash_train.train.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[2]



DPACE = ["--set", "loss.position_weights=dpace"]  # its weight sum is only known after forward
MUON = ["--set", "optim.optimizer=muon"]
DFLASH2 = ["--set", "model.kind=dflash2", "--set", "model.selector_rank=8",
           "--set", "model.selector_top_k=4"]  # its selector term is summed over ranks too


# DDP ranks run their half batches in chunks of 4 blocks (the grads flow through chunks
# recomputed in backward); the one process runs its blocks all at once.
@pytest.mark.parametrize(("sharding", "variant"), [
    (["--set", "run.chunk_blocks=4"], []), (["--fsdp"], []),
    (["--set", "run.chunk_blocks=4"], DPACE), (["--fsdp"], MUON + DPACE),
    (["--set", "run.chunk_blocks=4"], DFLASH2 + DPACE),
    (["--set", "run.chunk_blocks=4"], MUON),  # each rank iterates its share of the matrices
], ids=["ddp", "fsdp", "ddp-dpace", "fsdp-muon-dpace", "ddp-dflash2-dpace", "ddp-muon"])
def test_two_ranks_match_one_process(synthetic_store, tmp_path, sharding, variant):
    # Muon's weights are compared through the losses only: it orthogonalises in bf16 and
    # gives every singular direction a full step, so the all-reduce's rounding (1e-7) moves
    # its matrices by up to ~1e-3 (of ~5e-3 moved in 6 steps) in directions the loss barely
    # sees, under DDP and FSDP alike (and the norms trained beside them follow, by ~1e-4).
    exact_weights = MUON[1] not in variant
    args = ["--store", synthetic_store, "--layers", "1", "--batch-tokens", "256",
            "--anchors-per-seq", "8", "--max-steps", "6", "--lr", "3e-3", "--no-progress",
            "--set", "loader.prefetch_batches=0", "--set", "run.log_every=1",
            # float32: bf16 (auto on a CPU with native bf16) rounds each rank's half apart
            "--set", "run.precision=fp32", *variant]
    one = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "one"), *args])
    assert one.exit_code == 0, one.output
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "dflash_train", "train", "--out", str(tmp_path / "two"), *args, *sharding],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]

    def losses(run):
        return [json.loads(line)["loss"] for line in (tmp_path / run / "log.jsonl").open()]

    a, b = losses("one"), losses("two")
    assert len(a) == len(b) == 6
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-4 * max(1.0, abs(x)), (a, b)
    wa = load_drafter(latest_checkpoint(tmp_path / "one"), kinds=DRAFTER_KINDS).state_dict()
    wb = load_drafter(latest_checkpoint(tmp_path / "two"), kinds=DRAFTER_KINDS).state_dict()
    for k in wa:
        if exact_weights:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=k)


def test_a_rank_with_no_sample_in_a_step_still_steps(synthetic_store, tmp_path):
    # one sample per global batch: rank 1 never has one, yet must join every all-reduce
    args = ["--store", synthetic_store, "--layers", "1", "--batch-tokens", "1",
            "--anchors-per-seq", "4", "--max-steps", "3", "--no-progress",
            "--set", "loader.prefetch_batches=0", "--set", "run.log_every=1"]
    one = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "one"), *args])
    assert one.exit_code == 0, one.output
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "dflash_train", "train", "--out", str(tmp_path / "two"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    logs = {run: [json.loads(line) for line in (tmp_path / run / "log.jsonl").open()]
            for run in ("one", "two")}
    assert [r["samples"] for r in logs["one"]] == [1, 1, 1]
    for a, b in zip(logs["one"], logs["two"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), logs
