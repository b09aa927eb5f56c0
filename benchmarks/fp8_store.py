"""bf16 against fp8 context on the same real store, side by side: bytes, speeds, held-out tau.

    python -m benchmarks.fp8_store --store TRAIN.zarr --held-out HELD_OUT.zarr --out DIR
        [--steps 60] [--rounds 2] [--set KEY=VALUE ...]

From TRAIN (any hidden dtype) it makes, under DIR, the bf16 copy and the fp8 copy of the same
samples (the fp8 one quantized from the bf16 values, as extract in bf16 with
`--context-dtype float8_e4m3` would), and a bf16 copy of HELD_OUT. Then, in one run:
  size    bytes/token on disk, context only and the whole parts, bf16 vs fp8;
  write   tokens/s through the part writer from samples held in memory (rounds take turns,
          the best of each kept): the quantization is inside the fp8 figure;
  read    tokens/s of one shuffled epoch through train's loader (StoreLoader), same rounds;
  tau     one drafter trained on each store (`dflash train`, same seed and step budget, the
          settings of benchmarks/weights_optimizers.py), both evaluated in ONE `dflash eval`
          on the bf16 held-out copy, with the 95 % intervals.
It checks that both copies hold the same input_ids and loss masks before training. Writes
DIR/results.json. Not a test.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from benchmarks.driver import new_dir, package_errors_as_one_line
from benchmarks.runs import columns_by_path, dflash, train_arms
from dflash_train.evaluate.report import BLOCKS_FILE, REPORT_FILE
from dflash_train.extract.writer import FLUSH_SHARDS
from dflash_train.store_schema import create_store, open_store
from dflash_train.store_schema.info import summarize
from dflash_train.store_schema.layout import FP8_CONTEXT
from dflash_train.store_schema.subset import copy_store
from dflash_train.train.data import StoreLoader
from dflash_train.train.loader_config import LoaderConfig

ARMS = {"bf16": None, "fp8": FP8_CONTEXT}
TRAIN_SETTINGS = ["model.num_hidden_layers=1", "loader.batch_tokens=4096",
                  "run.anchors_per_seq=16", "optim.lr=3e-3", "run.precision=fp32",
                  "run.device=cpu"]


def write_copy(src, url: str, context_dtype: str | None, parts: dict) -> float:
    """Write `parts` (index -> samples in memory) as a new store; seconds in the writer."""
    meta = replace(src.meta, context_dtype=context_dtype, schema_version=None)
    dst = create_store(url, meta, shard_tokens=src.shard_tokens)
    rows = src.target_rows()
    dst.write_target_rows(rows["embed_tokens"], rows["lm_head"], rows["final_norm"])
    dst.write_files("target", src.read_files("target"))
    seconds = 0.0
    for part in src.parts():
        start = time.perf_counter()
        writer = dst.part_writer(part.index, part.row_start, part.row_stop, FLUSH_SHARDS)
        for sample in parts[part.index]:
            writer.append(sample)
        writer.finish()
        seconds += time.perf_counter() - start
    dst.write_files("tokenizer", src.read_files("tokenizer"))
    return seconds


def read_epoch(url: str) -> float:
    """Seconds for one shuffled epoch through the training loader."""
    loader = StoreLoader([url], LoaderConfig(batch_tokens=4096, seed=1))
    start = time.perf_counter()
    tokens = sum(b.num_tokens for b in loader.epoch(0) if b is not None)
    seconds = time.perf_counter() - start
    assert tokens == open_store(url).num_tokens
    return seconds


def same_tokens(a: str, b: str) -> bool:
    pa, pb = open_store(a).parts(), open_store(b).parts()
    return len(pa) == len(pb) and all(
        np.array_equal(x.read_tokens(0, x.num_tokens, (name,))[name],
                       y.read_tokens(0, y.num_tokens, (name,))[name])
        for x, y in zip(pa, pb, strict=True) for name in ("input_ids", "loss_mask"))


@package_errors_as_one_line
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="train store (any hidden dtype)")
    p.add_argument("--held-out", required=True, help="held-out store to evaluate on")
    p.add_argument("--out", required=True, help="directory for stores and runs (must not exist)")
    p.add_argument("--steps", type=int, default=60, help="optimiser steps of each drafter")
    p.add_argument("--rounds", type=int, default=2, help="write / read rounds per arm")
    p.add_argument("--io-only", action="store_true",
                   help="measure bytes and speeds only; train and evaluate nothing")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a `dflash train --set` for both drafters, after the defaults")
    a = p.parse_args()
    out = new_dir("--out", Path(a.out))
    out.mkdir()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log("bf16 copies of the train and held-out stores")
    bf16 = str(out / "train_bf16.zarr")
    held_out = str(out / "held_out_bf16.zarr")
    copy_store(a.store, bf16, hidden_dtype="bfloat16", context_dtype=None)
    copy_store(a.held_out, held_out, hidden_dtype="bfloat16", context_dtype=None)
    src = open_store(bf16)
    in_memory = {part.index: list(part.iter_samples()) for part in src.parts()}
    stores = {arm: str(out / f"train_{arm}_w.zarr") for arm in ARMS}
    write_s = {arm: [] for arm in ARMS}
    read_s = {arm: [] for arm in ARMS}
    for r in range(a.rounds):
        for arm, context_dtype in ARMS.items():
            log(f"round {r}: write + read {arm}")
            url = stores[arm] if r == 0 else str(out / f"scratch_{arm}_{r}.zarr")
            write_s[arm].append(write_copy(src, url, context_dtype, in_memory))
            read_s[arm].append(read_epoch(url))
    del in_memory
    tokens = src.num_tokens
    assert same_tokens(stores["bf16"], stores["fp8"]), "the two copies hold different tokens"
    sizes = {arm: summarize(open_store(url)) for arm, url in stores.items()}
    if a.io_only:
        print(f"{tokens:,} tokens, best of {a.rounds} rounds")
        print(f"{'arm':<5} {'context B/tok':>13} {'parts B/tok':>11} {'write tok/s':>11} "
              f"{'read tok/s':>10}")
        for arm in ARMS:
            print(f"{arm:<5} {sizes[arm].context_bytes_per_token:>13,.1f} "
                  f"{sizes[arm].bytes_per_token:>11,.1f} {tokens / min(write_s[arm]):>11,.0f} "
                  f"{tokens / min(read_s[arm]):>10,.0f}")
        return

    sets = [x for s in TRAIN_SETTINGS + a.sets for x in ("--set", s)]
    runs = train_arms(out, {f"run_{arm}": ["--store", url] for arm, url in stores.items()},
                      ["--max-steps", str(a.steps), "--no-progress", *sets])
    checkpoints = {arm: runs[f"run_{arm}"] for arm in stores}
    log("evaluating both on the bf16 held-out store")
    dflash("eval", "--store", held_out, "--out", str(out / "eval"), "--no-progress",
           *map(str, checkpoints.values()))
    report = json.loads((out / "eval" / REPORT_FILE).read_text())
    columns = columns_by_path(report)
    names = {arm: columns[ckpt.resolve()]["name"] for arm, ckpt in checkpoints.items()}
    blocks = pq.read_table(out / "eval" / BLOCKS_FILE).to_pydict()
    taus = {arm: [t for c, t in zip(blocks["checkpoint"], blocks["tau"], strict=True)
                  if c == name] for arm, name in names.items()}
    differing = sum(x != y for x, y in zip(taus["bf16"], taus["fp8"], strict=True))

    results = {"tokens": tokens, "steps": a.steps, "rounds": a.rounds, "blocks":
               len(taus["bf16"]), "blocks_with_another_tau": differing, "arms": {}}
    for arm in ARMS:
        s, off = sizes[arm], columns[checkpoints[arm].resolve()]["offline"]
        results["arms"][arm] = {
            "context_bytes_per_token": s.context_bytes_per_token,
            "part_bytes_per_token": s.bytes_per_token, "bytes_on_disk": s.bytes_on_disk,
            "write_tokens_per_s": tokens / min(write_s[arm]),
            "read_tokens_per_s": tokens / min(read_s[arm]),
            "tau": off["mean_tau"], "tau_ci95": off["tau_ci95"]}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"{tokens:,} tokens, {a.steps} steps, best of {a.rounds} rounds; the two drafters' "
          f"tau differs on {differing} of {len(taus['bf16'])} held-out blocks")
    print(f"{'arm':<5} {'context B/tok':>13} {'parts B/tok':>11} {'store MB':>9} "
          f"{'write tok/s':>11} {'read tok/s':>10}  tau (95% CI)")
    for arm, r in results["arms"].items():
        lo, hi = r["tau_ci95"]
        print(f"{arm:<5} {r['context_bytes_per_token']:>13,.1f} "
              f"{r['part_bytes_per_token']:>11,.1f} {r['bytes_on_disk'] / 1e6:>9.1f} "
              f"{r['write_tokens_per_s']:>11,.0f} {r['read_tokens_per_s']:>10,.0f}  "
              f"{r['tau']:.3f} [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
