"""--device values: what each resolves to, and what is refused with the fix."""

import pytest
import torch

from dflash_train.devices import native_bf16, resolve_device


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


def _help(command: str) -> str:
    from click.testing import CliRunner

    from dflash_train.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # click wraps the help text


@pytest.mark.parametrize("command", ["extract", "train", "eval"])
def test_every_stage_defaults_to_auto_and_says_the_rule_in_its_help(command):
    from dflash_train.evaluate.pipeline import EvalConfig
    from dflash_train.extract.config import ExtractConfig
    from dflash_train.train.config import RunConfig

    defaults = {"extract": ExtractConfig(model="m", data=[], out="o").device,
                "train": RunConfig().device, "eval": EvalConfig(store="s", checkpoints=[]).device}
    assert defaults[command] == "auto"
    text = _help(command)
    assert "Torch device: auto (cuda when torch sees one, else cpu)" in text
    assert "[default: auto]" in text.split("--device", 1)[1].split("--", 1)[0]


def test_extract_without_device_runs_where_auto_points_with_the_dtype_of_that_device(tmp_path):
    from dflash_train.assets.tiny import make_chats, save_qwen3, write_jsonl
    from dflash_train.extract.config import ExtractConfig
    from dflash_train.extract.pipeline import run_extract
    from dflash_train.store_schema import open_store

    model = save_qwen3(tmp_path / "m")
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(3))
    cfg = ExtractConfig(model=str(model), data=[data], out=str(tmp_path / "hs.zarr"),
                        layers="0,1,2", progress=False)
    run_extract(cfg, echo=lambda *_: None)
    meta = open_store(cfg.out).meta
    cuda = torch.cuda.is_available()
    assert meta.created_with.device == ("cuda" if cuda else "cpu")
    assert meta.hidden_dtype == ("bfloat16" if cuda else "float32")


@pytest.mark.parametrize("amx, avx512_bf16, want", [
    (True, True, "amx"), (False, True, "avx512_bf16"), (False, False, None)])
def test_native_bf16_names_the_cpu_feature_that_runs_it(monkeypatch, amx, avx512_bf16, want):
    _no_overrides(monkeypatch)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert native_bf16(torch.device("cpu")) == want
    assert native_bf16(torch.device("cuda", 0)) == "cuda"


def test_native_bf16_is_none_on_a_torch_without_the_cpu_probes(monkeypatch):
    _no_overrides(monkeypatch)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert native_bf16(torch.device("cpu")) is None


def _no_overrides(monkeypatch) -> None:
    monkeypatch.delenv("DFLASH_NATIVE_BF16", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("cap", ["AVX2", "avx512_core"])
def test_a_onednn_cap_below_bf16_makes_a_bf16_cpu_emulate_it(monkeypatch, cap, amx):
    # measured: ONEDNN_MAX_CPU_ISA=AVX2 took a bf16 GEMM from 39 to 1.3 GFLOP/s
    _no_overrides(monkeypatch)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert native_bf16(torch.device("cpu")) is None
    # capped below AMX, an AMX CPU runs bf16 on its AVX-512 BF16 kernels
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert native_bf16(torch.device("cpu")) == "avx512_bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert native_bf16(torch.device("cpu")) == ("amx" if amx else "avx512_bf16")


@pytest.mark.parametrize("value, cuda_too", [("0", False), ("1", True)])
def test_the_environment_overrides_every_probe(monkeypatch, value, cuda_too):
    _no_overrides(monkeypatch)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: value == "0")
    monkeypatch.setenv("DFLASH_NATIVE_BF16", value)
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        assert (native_bf16(device) is not None) == cuda_too


@pytest.mark.parametrize("capability, want", [((7, 0), None), ((8, 0), "cuda"), ((9, 0), "cuda")])
def test_cuda_cards_before_ampere_have_no_native_bf16(monkeypatch, capability, want):
    _no_overrides(monkeypatch)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert native_bf16(torch.device("cuda", 0)) == want


def test_auto_dtype_is_float32_on_a_cuda_card_without_native_bf16(monkeypatch):
    from dflash_train.dtypes import resolve_dtype

    _no_overrides(monkeypatch)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert resolve_dtype("auto", "auto") == torch.float32
    assert resolve_dtype("bfloat16", "cuda") == torch.bfloat16
