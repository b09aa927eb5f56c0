"""How the drafter is spread over ranks: one process, DDP, or FSDP2 (fully_shard).

Owns wrapping and the gathering / restoring of full weights and optimiser state, so the
checkpoint code sees plain tensors whatever the mode. Both DDP and FSDP2 average gradients
over ranks; the loop scales its loss for that, not this module.
"""

import inspect
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

Mode = Literal["none", "ddp", "fsdp"]
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def parallel_mode(world: int, fsdp: bool) -> Mode:
    if fsdp:
        return "fsdp"
    return "ddp" if world > 1 else "none"


def wrap(model: torch.nn.Module, mode: Mode, device: torch.device) -> torch.nn.Module:
    """The module the loop calls forward on; `model` itself stays the one to save."""
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            **_no_buffer_sync_per_forward())
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:  # one all-gather per layer keeps peak memory at one layer
            fully_shard(layer)
        fully_shard(model)
    return model


def _no_buffer_sync_per_forward() -> dict:
    """DDP's argument that keeps it from re-sending the buffers before every forward.

    The drafter's buffers are the target's frozen embedding and head (and the draft
    vocabulary's rows): DDP's default re-broadcast them from rank 0 each step, 2 x 49,152 x
    576 floats for SmolLM2 (~90 ms of a ~1.1 s CPU step), 2.5 GB each for Qwen3.6-27B. Nothing
    writes them after construction. torch >= 2.13 still syncs them once there; older torch's
    broadcast_buffers=False skips that too, which is safe as every rank builds the same
    buffers from the same files."""
    ddp_options = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    if "forward_sync_buffers" in ddp_options:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def full_states(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """Full (unsharded) weights and optimiser state, on CPU; complete on rank 0.

    A collective under FSDP: every rank must call it."""
    return (get_model_state_dict(model, options=_FULL),
            get_optimizer_state_dict(model, optimizer, options=_FULL))


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Restore full optimiser state saved by `full_states` (resharding it under FSDP)."""
    set_optimizer_state_dict(model, optimizer, state,
                             options=StateDictOptions(full_state_dict=True))


def global_norm(grad_norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float (a DTensor under FSDP)."""
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm)


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """`value` summed over every rank (a collective: every rank must call it)."""
    total = value.detach().clone()
    dist.all_reduce(total)
    return total


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def gather_objects(obj, world: int) -> list:
    """`obj` of every rank, in rank order (a collective); [obj] in a single process."""
    if world <= 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out
