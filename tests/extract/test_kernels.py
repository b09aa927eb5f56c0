"""transformers' kernel fallback notes stay out of a CPU run's output; on CUDA without fla a
single line of ours says what to install."""

import importlib.util
import logging

import pytest
import torch
from conftest import run_extract_cfg
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_train.target_model.kernels import (
    CUDA_EXTRA,
    FALLBACK_NOTE,
    HUB_KERNELS_LOGGER,
    missing_kernels_note,
    silence_fallback_notes,
)


class _Said(logging.Handler):
    """What transformers' logger tree passes on to its handlers (what it would print)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        from transformers.utils.logging import warning_once

        warning_once.cache_clear()  # each note is said once per process: forget which were
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def test_a_cpu_extract_with_regenerate_says_none_of_the_fallback_notes(qwen3_5_dir,
                                                                      chats_jsonl, tmp_path):
    echoed = []
    with _Said() as said:
        run_extract_cfg(qwen3_5_dir, chats_jsonl, str(tmp_path / "hs.zarr"), regenerate=True,
                        max_new_tokens=3, echo=echoed.append)
    assert not [line for line in said.lines if FALLBACK_NOTE in line], said.lines
    assert not [line for line in echoed if CUDA_EXTRA in line], echoed
    # the control: without our filter the same target's forward does say them
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    ours = [f for f in logger.filters if type(f).__name__ == "_DropFallbackNotes"]
    assert ours, "extract installed no filter"
    for f in ours:
        logger.removeFilter(f)
    try:
        with _Said() as plain, torch.no_grad():
            AutoModelForCausalLM.from_pretrained(qwen3_5_dir)(torch.tensor([[5, 6, 7]]))
    finally:
        for f in ours:
            logger.addFilter(f)
    if not [line for line in plain.lines if FALLBACK_NOTE in line]:
        pytest.skip("this transformers says no kernel fallback notes: nothing to silence")


def test_only_the_fallback_notes_are_dropped_from_their_logger():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    handler = Keep()
    logger.addHandler(handler)
    try:
        silence_fallback_notes()
        silence_fallback_notes()  # a second target load adds no second filter
        logger.warning(f"`f` {FALLBACK_NOTE} because `fla` is not installed.")
        logger.warning("some other trouble")
    finally:
        logger.removeHandler(handler)
    assert seen == ["some other trouble"]
    assert sum(type(f).__name__ == "_DropFallbackNotes" for f in logger.filters) == 1


@pytest.mark.parametrize("fixture, device, fla, said", [
    ("qwen3_5_dir", "cuda", False, True),
    ("qwen3_5_dir", "cuda", True, False),
    ("qwen3_5_dir", "cpu", False, False),
    ("qwen3_dir", "cuda", False, False),  # no linear attention: nothing to speed up
])
def test_the_cuda_note_is_said_only_where_fla_would_run(fixture, device, fla, said, request,
                                                       monkeypatch):
    config = AutoConfig.from_pretrained(request.getfixturevalue(fixture))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if fla else None) if name == "fla"
                        else real(name, *a))
    note = missing_kernels_note(config, torch.device(device))
    assert (note is not None) == said
    if said:
        assert CUDA_EXTRA in note and "\n" not in note
