"""The loader's memory is bounded by its configuration, not by the store's size."""

import subprocess
import sys
from pathlib import Path

import torch

from dflash_train.store_schema import create_store
from tests.store_schema.conftest import make_meta, random_sample

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 1024  # 3 layers x 1024 x bf16 = 6 KB per token


def _store(url: str, samples: int) -> int:
    meta = make_meta(num_parts=1, hidden_size=HIDDEN)
    store = create_store(url, meta, shard_tokens=1024)
    writer = store.part_writer(0, 0, samples)
    gen = torch.Generator().manual_seed(0)
    one = random_sample(200, 0, gen, hidden=HIDDEN)
    for row in range(samples):  # the same tensors under new rows: cheap to make, real to read
        one.source_row = row
        writer.append(one)
    writer.finish()
    return samples * 200


def _peak_rss_kb(url: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-m", "tests.train.loader_rss", url], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=True)
    tokens, rss = out.stdout.split()
    return int(tokens), int(rss)


def test_peak_rss_on_a_10x_store_stays_within_1_2x(tmp_path):
    small, large = str(tmp_path / "1x.zarr"), str(tmp_path / "10x.zarr")
    small_tokens, large_tokens = _store(small, 40), _store(large, 400)  # 48 MB and 480 MB
    tokens_1x, rss_1x = _peak_rss_kb(small)
    tokens_10x, rss_10x = _peak_rss_kb(large)
    assert (tokens_1x, tokens_10x) == (small_tokens, large_tokens)  # every token was read
    assert rss_10x <= 1.2 * rss_1x, (rss_1x, rss_10x)
