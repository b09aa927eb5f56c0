"""Read one epoch of a store through the loader in a fresh process; print the peak RSS (KB).

python -m tests.train.loader_rss URL
"""

import resource
import sys

from dflash.train.data import LoaderConfig, StoreLoader


def main(url: str) -> None:
    cfg = LoaderConfig(batch_tokens=2048, shuffle_buffer_tokens=4096, prefetch_batches=2)
    tokens = sum(b.num_tokens for b in StoreLoader([url], cfg).epoch(0) if b is not None)
    print(tokens, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


if __name__ == "__main__":
    main(sys.argv[1])
