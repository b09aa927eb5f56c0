"""What the roofline's stages share: how big each measurement is, what a measured stage is,
the FLOP counter, and the random-weight target of SmolLM2's shape."""

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from benchmarks.train_memory import WIDTHS

SMOLLM2 = WIDTHS["smollm2"]
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Size:
    """How big each measurement is: the full run, or --quick's for the test."""

    square: int = 2048
    copy_mib: int = 256
    seconds: float = 1.0
    """Least time each rate is measured over."""
    target_layers: int = 30
    target_tokens: int = 512
    batch_tokens: int = 4096
    samples: int = 96
    steps: int = 4
    writer_tokens: int = 32768
    generate_rows: int = 32
    generate_prompt: int = 64
    generate_tokens: int = 32
    replay_sequences: int = 32
    replay_length: int = 512
    """Offline replay's batch: eval's default 16,384 tokens."""
    replay_steps: int = 64
    """Steps of eval's replay walk over that batch, one block per sequence each (a 128-token
    answer at tau ~1.4 takes ~90)."""
    live_prompt: int = 256
    """Tokens the live decodes start from."""
    live_rounds: int = 16
    """Rounds of the shorter of the two live decodes; the longer runs twice as many."""


QUICK = Size(square=1024, copy_mib=32, seconds=0.2, target_layers=5, target_tokens=128,
             batch_tokens=1024, samples=16, steps=1, writer_tokens=4096, generate_rows=4,
             generate_prompt=16, generate_tokens=4, replay_sequences=2, replay_length=64,
             replay_steps=4, live_prompt=16, live_rounds=4)


@dataclass(frozen=True)
class Stage:
    """One stage's measured work: FLOPs (0 for pure data movement) and least bytes moved."""

    name: str
    shape: str
    flops: float
    bytes: float
    seconds: float
    dtype: torch.dtype | None = None
    """The dtype its matmuls run in (its GEMM peak); None: bound by copying alone."""
    mix: dict[str, float] | None = None
    """FLOPs per matmul output dtype, where they were counted as run (then `flops` is their
    sum and the bound mixes the peaks)."""
    limit: tuple[str, float] | None = None
    """(what, bytes/s): a ceiling besides copying for a stage that moves bytes (a disk)."""


def _cpu_attention(query, key, value, *args, **kwargs) -> float:
    """The CPU flash attention's forward: QK^T and AV over every query and key position
    (torch's registry counts the CUDA kernels only), K/V heads shared by groups of Q's."""
    batch, heads, queries, dim = query.shape
    return 2 * batch * heads * queries * key.shape[-2] * (dim + value.shape[-1])


def _cpu_attention_backward(grad_out, query, key, value, *args, **kwargs) -> float:
    """Its backward, as torch counts the CUDA kernels': the scores recomputed, then the
    gradients of the scores, V, Q and K."""
    batch, heads, queries, dim = query.shape
    return 2 * batch * heads * queries * key.shape[-2] * (3 * dim + 2 * value.shape[-1])


CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


class CountedFlops(TorchDispatchMode):
    """The FLOPs of every matmul run under it (torch.utils.flop_counter's registry: mm,
    addmm, bmm, CUDA attention, ...; and the CPU's flash attention), per output dtype. A
    dispatch mode, not FlopCounterMode, whose module tracker refuses the drafter's chunked
    autograd.grad backward. Ops run under inference_mode never reach it."""

    def __init__(self):
        super().__init__()
        self.by_dtype: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in CPU_ATTENTION:
            flops = CPU_ATTENTION[packet](*args)
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            return out
        dtype = dtype_name((out[0] if isinstance(out, tuple) else out).dtype)
        self.by_dtype[dtype] = self.by_dtype.get(dtype, 0.0) + flops
        return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_target(size: Size):
    """(a random-weight model of SmolLM2's config in extract's auto dtype, its config, five
    context layer ids spread over it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_train.dtypes import resolve_dtype

    shape = {**SMOLLM2, "num_hidden_layers": size.target_layers}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    layer_ids = list(range(0, size.target_layers, max(1, size.target_layers // 5)))[:5]
    return model.to(resolve_dtype("auto", CPU)).eval(), shape, layer_ids
