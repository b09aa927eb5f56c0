"""Shared pieces of the extract reliability tests and scripts/soak_extract.py.

A tiny random Qwen3.5 target and 14 chats, extract settings small enough that one run writes
3 parts of several shards, a way to run the real CLI in a fresh process (optionally through
the fault launcher) and the checks every test ends with: arrays equal a reference run's, and
every source row is stored exactly once.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).with_name("extract_faults.py")
NUM_ROWS = 14
ARRAYS = ("input_ids", "loss_mask", "context", "topk_ids", "topk_logits", "lse")

SETTINGS = dict(device="cpu", dtype="float32", rows_per_part=5, shard_tokens=16,
                batch_tokens=96, layers="0,1,2", progress=False)
"""14 rows -> parts of 5, 5, 4 rows; 16-token shards so every part commits several times."""


def build_inputs(root: Path) -> tuple[str, str]:
    """A tiny Qwen3.5 target directory and a jsonl of NUM_ROWS chats under `root`."""
    from dflash_train.assets.tiny import make_chats, save_qwen3_5, write_jsonl

    model = root / "qwen3_5"
    model.mkdir(parents=True, exist_ok=True)
    save_qwen3_5(model)
    return str(model), write_jsonl(root / "chats.jsonl", make_chats(NUM_ROWS))


@functools.cache
def shared_inputs(base: Path) -> tuple[str, str]:
    """build_inputs once per test session (`base`: pytest's basetemp), for every module."""
    return build_inputs(Path(base) / "extract_inputs")


@functools.cache
def shared_reference(base: Path) -> list:
    """The samples of one uninterrupted in-process run on shared_inputs(base)."""
    out = str(Path(base) / "extract_reference.zarr")
    run_in_process(*shared_inputs(base), out)
    return stored_samples(out)


def cli_args(model: str, data: str, out: str, **overrides) -> list[str]:
    """The `dflash extract` options equal to SETTINGS (plus overrides, by config name)."""
    s = {**SETTINGS, **overrides}
    args = ["--model", model, "--data", data, "--out", out]
    for name, value in s.items():
        if name == "progress":
            args.append("--progress" if value else "--no-progress")
        else:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def run_in_process(model: str, data: str, out: str, **overrides):
    """run_extract with SETTINGS in this process; returns its ExtractSummary."""
    from dflash_train.extract.config import ExtractConfig
    from dflash_train.extract.pipeline import run_extract

    s = {**SETTINGS, **overrides}
    rank, world = s.pop("rank", 0), s.pop("world_size", 1)
    cfg = ExtractConfig(model=model, data=[data], out=out, **s)
    return run_extract(cfg, rank=rank, world_size=world, echo=lambda *_: None)


def child_env(**env) -> dict:
    """This environment minus any fault variable, plus `env`."""
    from dflash_train.extract.writer import KILL_AFTER_ENV
    from tests.reliability.extract_faults import FAULT_VARS

    base = {k: v for k, v in os.environ.items() if k not in (*FAULT_VARS, KILL_AFTER_ENV)}
    return {**base, "PYTHONPATH": str(REPO), **{k: str(v) for k, v in env.items()}}


def cli_command(args: list[str]) -> list[str]:
    """`dflash extract ARGS` through the fault launcher (inert without fault variables)."""
    return [sys.executable, str(FAULTS), *args]


def run_cli(args: list[str], timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(args), env=child_env(**env), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def stored_samples(out: str) -> list:
    from dflash_train.store_schema import open_store

    return [s for p in open_store(out).parts() for s in p.iter_samples()]


def committed_rows(out: str) -> list[int]:
    """Source rows committed so far, part by part; [] when no store (or no part) exists."""
    from dflash_train.store_schema import StoreError, open_store

    if not os.path.exists(out):
        return []
    try:
        parts = open_store(out).parts()
    except StoreError:  # the kill tore the store's creation: nothing is committed
        return []
    return [int(r) for p in parts for r in p.sources().tolist()]


def is_complete(out: str) -> bool:
    from dflash_train.store_schema import StoreError, open_store

    try:
        return os.path.exists(out) and open_store(out).complete
    except StoreError:
        return False


def differences(got: list, want: list) -> list[str]:
    """Why two stores' samples differ (empty when they are identical, array by array)."""
    rows_got, rows_want = [s.source_row for s in got], [s.source_row for s in want]
    if rows_got != rows_want:
        return [f"source rows {rows_got} != {rows_want}"]
    return [f"row {x.source_row}: {name} differs" for x, y in zip(got, want, strict=True)
            for name in ARRAYS if not torch.equal(getattr(x, name), getattr(y, name))]


def duplicates_and_losses(rows: list[int], expected: range) -> tuple[list[int], list[int]]:
    """(rows stored more than once, expected rows never stored)."""
    seen, dup = set(), []
    for r in rows:
        if r in seen:
            dup.append(r)
        seen.add(r)
    return dup, [r for r in expected if r not in seen]
