"""What a run says about the linear-attention kernels: transformers' per-function fallback
notes silenced, and one line of ours where installing the kernels would help.

transformers logs one note per kernel function the first time it takes its PyTorch path
(four for a Qwen3.5 hybrid), each advising to install flash-linear-attention or
causal_conv1d. On a CPU that advice is wrong: those packages need CUDA, and the PyTorch path
is the one a CPU must take (loading.guard_kernels makes sure of it). On CUDA it is right, but
it belongs in one line naming our extra. Only those notes are dropped; every other message
of transformers stays as it is. Never loads a model.
"""

import importlib.util
import logging

import torch

from dflash_train.target_config import text_part

FALLBACK_NOTE = "is falling back to its reference PyTorch implementation"
"""The words every one of transformers' kernel fallback notes contains."""
HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"
"""The logger transformers emits them on."""
CUDA_EXTRA = "pip install 'dflash-train[cuda]'"


class _DropFallbackNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return FALLBACK_NOTE not in record.getMessage()


def silence_fallback_notes() -> None:
    """Drop transformers' kernel fallback notes for the rest of the process (idempotent)."""
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if not any(isinstance(f, _DropFallbackNotes) for f in logger.filters):
        logger.addFilter(_DropFallbackNotes())


def missing_kernels_note(config, device: torch.device) -> str | None:
    """One line when a target with linear attention runs on CUDA without fla; else None."""
    if device.type != "cuda":
        return None
    text = text_part(config)
    if "linear_attention" not in (getattr(text, "layer_types", None) or []):
        return None
    if importlib.util.find_spec("fla") is not None:
        return None
    return ("note: flash-linear-attention is not installed, so linear attention runs on "
            f"transformers' PyTorch path (correct, much slower on a GPU): {CUDA_EXTRA}")
