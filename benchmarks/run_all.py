"""Every CPU benchmark of issue 8 in one run, printed as ONE table of side-by-side ratios.

    python -m benchmarks.run_all [--quick] [--markdown] [--threads 1] [--dir /tmp]

  1 write     part writer vs raw write + fsync; MB/s per core; compression on real states
  2 read      loader (shuffled) vs raw sequential read and vs per-sample safetensors
  3 memory    loader peak RSS, 10x store vs 1x store
  4 extract   run_extract vs the bare forward of the same batches, broken down
  5 eval      offline replay vs --online vs a naive per-block loop
  6 size      bytes per token by codec, real and synthetic; lossless codecs keep eval metrics
  8 engines   zarr-python default pipeline vs zarrs, and tensorstore, on the same store
(7, the GPU script, is benchmarks/gpu.py.) Synthetic states are n = 5 x H = 5120 bf16; real
ones come from the embedded tiny target. Ratios are the result: absolute times on a shared
machine are noise. Under 10 minutes on 2 cores; --quick is a smoke run of a minute or two.
"""

import argparse
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import (
    codec_sizes,
    eval_speed,
    extract_overhead,
    loader_memory,
    store_io,
    zarr_backends,
)
from benchmarks.driver import package_errors_as_one_line
from benchmarks.embedded_stores import EmbeddedSettings, extract, first_rows, fit_drafter
from benchmarks.report import Row, format_markdown, format_table


@dataclass
class Sizes:
    """How big each section runs."""

    synthetic_tokens: int = 16384
    """Tokens of synthetic 5 x 5120 bf16 states (items 1, 2, 6, 8)."""
    embedded: EmbeddedSettings = None  # type: ignore[assignment]
    """Prompts extracted from the embedded target (items 1, 4, 5, 6)."""
    fit_steps: int = 20
    """Training steps of the drafter the eval sections score."""
    naive_blocks: int = 48
    """Blocks timed in the naive per-block eval loop."""
    rss_samples: int = 16
    """1024-token samples in the 1x memory store (5 x 1024 bf16: 10 KB per token): 4 batches,
    so even the 1x store fills the prefetch queue (with 1-2 batches the ratio measured how
    full the pipeline got, not how memory scales)."""


FULL = Sizes(synthetic_tokens=16384, embedded=EmbeddedSettings(train_prompts=192))
QUICK = Sizes(synthetic_tokens=2048, fit_steps=4, naive_blocks=8, rss_samples=2,
              embedded=EmbeddedSettings(train_prompts=8, held_out_prompts=3, max_new_tokens=16))


def run(sizes: Sizes, root: Path, echo) -> list[Row]:
    rows: list[Row] = []
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        echo(f"  {name}: {time.perf_counter() - clock:.0f} s")
        clock = time.perf_counter()

    context = store_io.synthetic_hidden(sizes.synthetic_tokens, 5, 5120)
    rows += store_io.bench(context, root)
    lap("store I/O (items 1, 2, 6 synthetic)")
    rows += zarr_backends.bench(root, str(root / "hs.zarr"),
                                store_io._meta(5, 5120, sizes.synthetic_tokens),
                                store_io.samples(context), context.numel() * 2)
    del context
    lap("engines (item 8)")
    rows += loader_memory.bench(root, sizes.rss_samples, 5, 1024)
    lap("memory (item 3)")

    s = sizes.embedded
    rows += extract_overhead.bench(root, s)
    real = str(root / "overhead.zarr")  # the train prompts, as extracted just now
    rows += codec_sizes.real_compression(real) + codec_sizes.real_sizes_in_memory(real)
    lap("extract (item 4) and real sizes")

    held = str(root / "held_out.zarr")
    extract(first_rows("held_out", s.held_out_prompts, root / "held_out.jsonl"), held, s,
            regenerate=True)
    checkpoint = fit_drafter(held, root / "run", sizes.fit_steps)
    lap("held-out store and drafter")
    eval_rows, _ = eval_speed.bench(held, checkpoint, sizes.naive_blocks)
    rows += eval_rows
    lap("eval (item 5)")
    rows += codec_sizes.bench(root, held, checkpoint)
    lap("codecs and tau (item 6)")
    return sorted(rows, key=lambda r: r.item.split()[0])  # stable: keeps order within items


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes (a minute or two)")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the model sections (1: steadier under load)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where temp stores go")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-", dir=args.dir))
    start = time.perf_counter()
    try:
        rows = run(sizes, root, echo=print)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ndflash benchmarks{' (--quick)' if args.quick else ''}, "
          f"{time.strftime('%Y-%m-%d')}, {platform.machine()} x {_cores()} cores, torch threads "
          f"{args.threads}, {time.perf_counter() - start:.0f} s\n")
    print(format_table(rows))
    if args.markdown:
        print("\n" + format_markdown(rows))


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
