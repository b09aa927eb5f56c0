"""The whole dflash pipeline on a tiny random-weight Qwen3.5 hybrid target, on CPU.

    python examples/tiny_pipeline.py [--out tiny_pipeline] [--epochs 8]

Builds the target and 64 chats in process (no download), then runs the same commands a user
runs on a real model, printing each one: extract (with --regenerate, so the stored responses
are the target's own greedy output), store info / validate, train, log summary, eval of an
early and the final checkpoint on a held-out store, export.
"""

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from dflash_train.assets.tiny import build_tokenizer, make_chats, save_qwen3_5, write_jsonl


def run(*args: str) -> None:
    cmd = ["dflash", *args]
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "dflash_train", *args])
    if result.returncode != 0:
        sys.exit(f"step failed (exit {result.returncode}): {shlex.join(cmd)}")
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tiny_pipeline", help="Working directory.")
    parser.add_argument("--epochs", type=int, default=8, help="Drafter training epochs.")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    target = out / "target"
    if not (target / "config.json").is_file():
        save_qwen3_5(target, seed=0)
        print(f"built a tiny random Qwen3.5 hybrid target in {target}")
    chats = write_jsonl(out / "chats.jsonl", make_chats(64, seed=1))
    held_out_chats = write_jsonl(out / "held_out.jsonl", make_chats(16, seed=2))
    mask = build_tokenizer().convert_tokens_to_ids("<|mask|>")
    store, held_out = str(out / "hs.zarr"), str(out / "held_out.zarr")
    run_dir = out / "run"

    for data, url in ((chats, store), (held_out_chats, held_out)):
        run("extract", "--model", str(target), "--data", data, "--out", url, "--device", "cpu",
            "--regenerate", "--max-new-tokens", "48", "--mask-token-id", str(mask),
            "--rows-per-part", "16", "--shard-tokens", "256")
    run("store", "info", store)
    run("store", "validate", store)
    run("train", "--store", store, "--out", str(run_dir), "--layers", "1",
        "--epochs", str(args.epochs), "--batch-tokens", "1024", "--anchors-per-seq", "32",
        "--lr", "3e-3", "--set", "run.checkpoint_every=2", "--set", "run.keep_checkpoints=1000",
        "--set", "run.log_every=5")
    run("log", "summary", str(run_dir), "--ranges", "4")
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    run("eval", "--store", held_out, str(checkpoints[0]), str(checkpoints[-1]),
        "--out", str(out / "eval"))
    run("export", str(checkpoints[-1]), str(out / "drafter"), "--overwrite")
    print(f"\nDone. Store {store}, run {run_dir}, exported drafter {out / 'drafter'}.")
    print("On a real target: dflash extract --model Qwen/Qwen3.6-27B --data chats.jsonl "
          "--out hs.zarr, then dflash train --store hs.zarr.")


if __name__ == "__main__":
    main()
