"""--device values: what each resolves to, and what is refused with the fix."""

import pytest
import torch

from dflash_train.devices import resolve_device


class StageError(Exception):
    pass


def test_auto_and_cpu_resolve_to_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", StageError) == torch.device("cpu")
    assert resolve_device("cpu", StageError, rank=3) == torch.device("cpu")


def test_each_rank_takes_its_own_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [resolve_device("cuda", StageError, rank=r) for r in (0, 1, 5)] == [
        torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1)]
    assert resolve_device("auto", StageError, rank=2) == torch.device("cuda", 2)
    assert resolve_device("cuda:3", StageError, rank=0) == torch.device("cuda", 3)
    with pytest.raises(StageError, match="only 4 CUDA device"):
        resolve_device("cuda:4", StageError)


@pytest.mark.parametrize("name, needle", [
    ("cuda", "sees no CUDA device on this machine; pass --device cpu"),
    ("cuda:0", "sees no CUDA device"),
    ("tpu", "not a device"),
    ("meta", "unsupported"),
])
def test_unusable_devices_raise_the_stage_error(monkeypatch, name, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StageError, match=needle):
        resolve_device(name, StageError)
