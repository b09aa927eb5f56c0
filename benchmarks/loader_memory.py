"""Loader memory: peak RSS reading one epoch of a 1x and a 10x store, each in a fresh process.

The reading process is tests/train/loader_rss.py (the loader-memory test's own probe), so the
benchmark and the test read the same way; it reports its own VmHWM, not ru_maxrss, which
Linux carries from this big parent across fork + exec. Stores repeat one synthetic sample
under new source rows: cheap to write, real to read. Not a test.
"""

import subprocess
import sys
from pathlib import Path

from benchmarks.report import Row
from benchmarks.store_io import SAMPLE_TOKENS, samples, synthetic_hidden, synthetic_meta

REPO = Path(__file__).resolve().parents[1]
GOAL = 1.1


def write_repeated_store(url: str, count: int, layers: int, hidden: int) -> int:
    """A one-part store of `count` copies of one 1024-token sample; returns its tokens."""
    from dflash_train.store_schema import create_store

    one = samples(synthetic_hidden(SAMPLE_TOKENS, layers, hidden))[0]
    store = create_store(url, synthetic_meta(layers, hidden, count * SAMPLE_TOKENS))
    writer = store.part_writer(0, 0, count)
    for row in range(count):
        one.source_row = row
        writer.append(one)
    writer.finish()
    return count * SAMPLE_TOKENS


def peak_rss_kb(url: str) -> tuple[int, int]:
    """(tokens read, peak RSS in KB) of one epoch read in a fresh process."""
    out = subprocess.run([sys.executable, "-m", "tests.train.loader_rss", url], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=True)
    tokens, hwm = out.stdout.split()
    return int(tokens), int(hwm)


def bench(root: Path, samples_1x: int, layers: int, hidden: int) -> list[Row]:
    small, large = str(root / "rss-1x.zarr"), str(root / "rss-10x.zarr")
    want = (write_repeated_store(small, samples_1x, layers, hidden),
            write_repeated_store(large, 10 * samples_1x, layers, hidden))
    # the median of 3 fresh processes per store, taking turns: one peak moves by ~10 % with
    # thread timing (how full the prefetch queue is when the decode threads peak)
    runs = [(peak_rss_kb(small), peak_rss_kb(large)) for _ in range(3)]
    (t1, rss1), (t10, rss10) = (sorted(r[i] for r in runs)[1] for i in (0, 1))
    assert (t1, t10) == want, f"the loader read {(t1, t10)} tokens of {want}"
    ratio = rss10 / rss1
    mb = [n * layers * hidden * 2 / 1e6 for n in want]
    return [Row("3 memory", "loader peak RSS, 10x store / 1x store",
                f"{ratio:.2f}x ({rss10 / 1024:.0f} vs {rss1 / 1024:.0f} MiB; stores "
                f"{mb[1]:.0f} vs {mb[0]:.0f} MB of context)", f"<= {GOAL}x", ratio <= GOAL)]
