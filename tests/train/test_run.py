"""What run.precision=auto trains in, and that a run says so in its first lines; where a
process trains and how its ranks join."""

import pytest
import torch

from dflash_train.train import run as run_module
from dflash_train.train.config import RunConfig, TrainConfig
from dflash_train.train.run import precision_note, use_bf16

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("native, want", [("avx512_bf16", True), ("amx", True), (None, False)])
def test_auto_takes_bf16_exactly_where_the_cpu_runs_it_natively(monkeypatch, native, want):
    monkeypatch.setattr(run_module, "native_bf16", lambda device: native)
    assert use_bf16("auto", CPU) is want
    assert use_bf16("bf16", CPU) is True and use_bf16("fp32", CPU) is False
    note = precision_note("auto", CPU)
    assert note.startswith("precision: bf16" if want else "precision: fp32")
    assert (native or "no native bf16") in note


def test_auto_is_bf16_on_cuda_and_an_explicit_choice_needs_no_note():
    assert use_bf16("auto", CUDA) and not use_bf16("fp32", CUDA)
    assert precision_note("fp32", CPU) is None and precision_note("bf16", CUDA) is None


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_ranks_join_by_the_device_trained_on_not_by_the_host(monkeypatch, device, backend):
    # A GPU host training on CPU under torchrun: NCCL holds no CPU tensor.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda _: None)
    monkeypatch.setattr(run_module.dist, "is_initialized", lambda: False)
    joined = []
    monkeypatch.setattr(run_module.dist, "init_process_group", joined.append)
    placement = run_module._placement(TrainConfig(run=RunConfig(device=device)))
    assert joined == [backend]
    assert (placement.rank, placement.world, placement.device.type) == (1, 2, device)
