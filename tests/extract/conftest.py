"""Tiny in-process targets, tokenizer and chat data for the extract tests (reusable elsewhere).

The builders live in dflash_train.assets.tiny (the example pipeline uses them too); this file adds
the session fixtures and the helpers that run extract the way the tests need.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.assets.tiny import (  # noqa: F401 -- re-exported for the tests
    CHAT_TEMPLATE,
    SPECIALS,
    TOKENIZER_VOCAB,
    VOCAB_SIZE,
    WORDS,
    build_tokenizer,
    make_chats,
    save_qwen3,
    save_qwen3_5,
    write_jsonl,
)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory):
    return save_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="session")
def chats_jsonl(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", make_chats(14))


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    """The tiny Qwen3 whose answers end on an eos (tests/evaluate/conftest.py), for the
    regeneration tests that stop on one."""
    from tests.evaluate.conftest import save_eos_target

    return save_eos_target(tmp_path_factory.mktemp("eos_target"))


@pytest.fixture(scope="session")
def data(chats_jsonl):
    return chats_jsonl  # the extract tests' shared 14 chats


def run_extract_cfg(model: str, data: str, out: str, **overrides):
    """run_extract on CPU in fp32 with small parts and shards, no progress bar."""
    from dflash_train.extract.config import ExtractConfig
    from dflash_train.extract.pipeline import run_extract

    settings = dict(device="cpu", dtype="float32", rows_per_part=5, shard_tokens=16,
                    batch_tokens=96, layers="0,1,2", progress=False)
    settings.update(overrides)
    rank, world = settings.pop("rank", 0), settings.pop("world_size", 1)
    echo = settings.pop("echo", lambda *_: None)
    cfg = ExtractConfig(model=model, data=[data], out=out, **settings)
    return run_extract(cfg, rank=rank, world_size=world, echo=echo)


def store_samples(url: str) -> list:
    """Every committed sample of a store, part by part, in stored order."""
    from dflash_train.store_schema import open_store

    return [s for p in open_store(url).parts() for s in p.iter_samples()]


def assert_same_samples(a: list, b: list) -> None:
    assert [s.source_row for s in a] == [s.source_row for s in b]
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "loss_mask", "context", "topk_ids", "topk_logits", "lse"):
            assert torch.equal(getattr(x, name), getattr(y, name)), (name, x.source_row)


REPO = Path(__file__).resolve().parents[2]


def cli_args(model: str, data: str, out: str) -> list[str]:
    """The CLI form of run_extract_cfg's settings."""
    return ["--model", model, "--data", data, "--out", out, "--device", "cpu", "--dtype",
            "float32", "--rows-per-part", "5", "--shard-tokens", "16", "--batch-tokens", "96",
            "--layers", "0,1,2", "--no-progress"]


def cli_command(args: list[str]) -> list[str]:
    code = "from dflash_train.extract.command import extract; extract()"
    return [sys.executable, "-c", code, *args]


def cli_env(**env) -> dict:
    # the repo first, then whatever the caller already had (a --target site of wheels, say)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **env}


def run_cli(args: list[str], **env) -> subprocess.CompletedProcess:
    """`dflash extract ARGS` in a fresh Python process."""
    return subprocess.run(cli_command(args), env=cli_env(**env), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
