"""Which torch device a stage runs on: one resolution and one refusal for every command.

Owns the meaning of a `--device` value only; never moves a tensor.
"""

import os

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DEFAULT_DEVICE = "auto"
"""Every stage's default: the same command runs on a GPU machine and on a laptop."""
DEVICE_HELP = "Torch device: auto (cuda when torch sees one, else cpu), cpu, cuda or cuda:N."
"""The rule, as each command's --help states it."""
RANKS_HELP = " Under torchrun each rank of a node takes its own card."


def resolve_device(name: str, error: type[Exception], rank: int = 0) -> torch.device:
    """`auto` (CUDA when torch sees one, else CPU), `cpu`, `cuda` or `cuda:N`.

    A device torch cannot use raises `error` (the calling stage's exception type) with the
    fix, instead of torch's own assertion deep inside the first `.to()`.
    """
    cuda = torch.cuda.is_available()
    if name == "auto":
        name = "cuda" if cuda else "cpu"
    if name == "cuda" and cuda:
        # under torchrun each rank of a node takes its own card
        name = f"cuda:{rank % torch.cuda.device_count()}"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise error(f"--device {name!r}: not a device (expected {DEVICE_CHOICES})") from e
    if device.type not in ("cpu", "cuda"):
        raise error(f"--device {name!r}: unsupported (expected {DEVICE_CHOICES})")
    if device.type == "cuda":
        if not cuda:
            raise error(f"--device {name!r}: torch {torch.__version__} sees no CUDA device "
                        "on this machine; pass --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise error(f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) "
                        "visible")
    return device


NATIVE_BF16_ENV = "DFLASH_NATIVE_BF16"
"""Set to 1 or 0 to override what native_bf16 reports (tests; a machine whose probe is wrong)."""

ONEDNN_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                     "AVX512_CORE_VNNI")
"""ONEDNN_MAX_CPU_ISA caps that keep oneDNN off its bf16 kernels: with the cap at AVX2 a bf16
matmul at SmolLM2's 512x576x1536 ran 1.3 GFLOP/s against float32's 33 on an AVX-512 BF16 CPU
(emulated, as on an AVX2-only Zen 3), whatever the hardware probes say."""

ONEDNN_BELOW_AMX = (*ONEDNN_BELOW_BF16, "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512")
"""ONEDNN_MAX_CPU_ISA caps that keep oneDNN off AMX (the three added: on AVX-512 BF16)."""


def native_bf16(device: torch.device) -> str | None:
    """What runs bf16 matmuls natively on `device` ("cuda", "amx" or "avx512_bf16"), or None
    where bf16 would be emulated (slower than float32): every `auto` precision asks this.

    On a CPU with AVX-512 BF16 or AMX a bf16 matmul at SmolLM2's lm_head shape ran 2.5-5x a
    float32 one (docs/benchmarks.md); on AVX2 alone ~50x slower (emulated). CUDA cards before
    compute capability 8.0 (Ampere) have no bf16 tensor cores. DFLASH_NATIVE_BF16=0/1 wins."""
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced in ("0", "1"):
        return f"{NATIVE_BF16_ENV}=1" if forced == "1" else None
    if device.type == "cuda":
        # a torch that has or sees no CUDA never runs on this device (resolve_device refuses
        # it first), so it is answered as for any card since Ampere; ROCm's bf16 cards likewise
        usable = torch.backends.cuda.is_built() and torch.cuda.is_available()
        if not usable or torch.version.hip is not None:
            return "cuda"
        return "cuda" if torch.cuda.get_device_capability(device) >= (8, 0) else None
    if device.type != "cpu":
        return None
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap in ONEDNN_BELOW_BF16:
        return None
    # torch.cpu's probes are private; a torch without them is treated as having neither
    for name, probe in (("amx", "_is_amx_tile_supported"),
                        ("avx512_bf16", "_is_avx512_bf16_supported")):
        if getattr(torch.cpu, probe, lambda: False)() and not (
                name == "amx" and cap in ONEDNN_BELOW_AMX):
            return name
    return None
