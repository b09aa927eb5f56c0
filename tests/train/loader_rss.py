"""Read one epoch of a store through the loader in a fresh process; print the peak RSS (KB).

python -m tests.train.loader_rss URL
"""

import sys
from pathlib import Path

from dflash_train.train.data import StoreLoader
from dflash_train.train.loader_config import LoaderConfig


def peak_rss_kb() -> int:
    """This process's own peak RSS. Not ru_maxrss: Linux carries the parent's peak across
    fork + exec into it, so a child of a big process would report its parent's memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(url: str) -> None:
    cfg = LoaderConfig(batch_tokens=2048, shuffle_buffer_tokens=4096, prefetch_batches=2)
    tokens = sum(b.num_tokens for b in StoreLoader([url], cfg).epoch(0) if b is not None)
    print(tokens, peak_rss_kb())


if __name__ == "__main__":
    main(sys.argv[1])
