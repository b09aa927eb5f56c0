"""Real stores for the benchmarks: the embedded tiny target run over its embedded prompts.

Owns the settings the benchmarks extract with (so every section measures the same states) and
the drafter they evaluate. Every stage goes through the public entry points (run_extract,
train); this module never re-implements one and writes only under the directory it is given.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from dflash_train.assets.embedded import prompt_file, target_dir
from dflash_train.extract.config import ExtractConfig

SHARD_TOKENS = 1024
"""Shard length of the benchmark stores (the CLI default)."""


@dataclass
class EmbeddedSettings:
    """How much of the embedded prompt set the benchmarks extract."""

    train_prompts: int = 48
    """Train prompts extracted as they are (prompt + stored response, no regeneration)."""
    held_out_prompts: int = 8
    """Held-out prompts extracted with --regenerate (offline replay == live decoding)."""
    max_new_tokens: int = 48
    """Tokens the target generates per held-out prompt."""
    dtype: str = "bfloat16"
    """Compute and storage dtype of the states: bf16, as on a GPU, so sizes are realistic."""
    batch_tokens: int = 4096
    """Padded tokens per extract forward batch."""


def first_rows(split: str, n: int, dst: Path) -> str:
    """The first `n` rows of an embedded prompt split, written to `dst`."""
    rows = prompt_file(split).read_text().splitlines(keepends=True)[:n]
    dst.write_text("".join(rows))
    return str(dst)


def extract_config(data: str, out: str, s: EmbeddedSettings, *, regenerate: bool
                   ) -> ExtractConfig:
    return ExtractConfig(model=str(target_dir()), data=[data], out=out, device="cpu",
                         dtype=s.dtype, regenerate=regenerate, max_new_tokens=s.max_new_tokens,
                         batch_tokens=s.batch_tokens, shard_tokens=SHARD_TOKENS, progress=False)


def extract(data: str, out: str, s: EmbeddedSettings, *, regenerate: bool) -> float:
    """run_extract into `out`; returns its wall time in seconds."""
    from dflash_train.extract.pipeline import run_extract

    start = time.perf_counter()
    run_extract(extract_config(data, out, s, regenerate=regenerate), echo=lambda *_: None)
    return time.perf_counter() - start


@dataclass
class EmbeddedStores:
    """The stores one benchmark run shares."""

    train: str
    """Embedded train prompts with their stored responses."""
    train_seconds: float
    """run_extract wall time of `train`."""
    held_out: str
    """Embedded held-out prompts answered by the target (--regenerate)."""
    data: str
    """The train prompts' jsonl (the input of `train`)."""


def build(root: Path, s: EmbeddedSettings) -> EmbeddedStores:
    data = first_rows("train", s.train_prompts, root / "train.jsonl")
    held = first_rows("held_out", s.held_out_prompts, root / "held_out.jsonl")
    train_url, held_url = str(root / "train.zarr"), str(root / "held_out.zarr")
    seconds = extract(data, train_url, s, regenerate=False)
    extract(held, held_url, s, regenerate=True)
    return EmbeddedStores(train_url, seconds, held_url, data)


def fit_drafter(store: str, run_dir: Path, steps: int) -> str:
    """A 1-layer drafter trained `steps` steps on `store` by `dflash_train.train` (varied taus)."""
    from dflash_train.train.config import ModelConfig, OptimConfig, RunConfig, TrainConfig
    from dflash_train.train.loader_config import LoaderConfig
    from dflash_train.train.loop import train

    cfg = TrainConfig(
        stores=[store], loader=LoaderConfig(batch_tokens=4096),
        model=ModelConfig(num_hidden_layers=1),
        optim=OptimConfig(lr=6e-3, epochs=10**6, max_steps=steps),
        run=RunConfig(out_dir=str(run_dir), device="cpu", anchors_per_seq=32,
                      checkpoint_every=10**9, keep_checkpoints=1, log_every=10**9,
                      progress=False))
    return str(train(cfg, echo=lambda *_: None).checkpoint)
