"""`store info`'s share of answer tokens equal to the stored forward's top-1 at the token
before, against a longhand count over the samples, for any read window."""

import json
import random

import pytest
import torch
from click.testing import CliRunner

from dflash_train.store_schema import open_store
from dflash_train.store_schema.command import store
from dflash_train.store_schema.info import top1_agreement
from tests.evaluate.conftest import synthetic_sample, write_synthetic_store


def _samples(seed: int = 0) -> list:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    samples = []
    for row in range(6):
        n = rng.randint(2, 12)
        ids = [rng.randrange(5) for _ in range(n)]
        mask = [rng.random() < 0.7 for _ in range(n)]  # the first token's too: no predictor
        # the forward's top-1 predicts the next token about half the time
        top1 = [ids[t + 1] if t + 1 < n and rng.random() < 0.5 else rng.randrange(5)
                for t in range(n)]
        samples.append(synthetic_sample(ids, mask, top1, row, gen))
    return samples


def _longhand(samples) -> tuple[int, int]:
    agree = total = 0
    for s in samples:
        for t in range(1, len(s)):
            if s.loss_mask[t]:
                total += 1
                agree += int(s.input_ids[t] == s.topk_ids[t - 1, 0])
    return agree, total


@pytest.mark.parametrize("window", [1, 2, 5, 1 << 18])
def test_agreement_equals_a_longhand_count_for_any_window(tmp_path, window):
    samples = _samples()
    url = write_synthetic_store(str(tmp_path / "s.zarr"), samples, regenerated=True)
    agree, total = top1_agreement(open_store(url), window=window)
    assert (agree, total) == _longhand(samples)
    assert 0 < agree < total


def test_info_reports_it_for_regenerated_stores_only(tmp_path):
    samples = _samples(1)
    agree, total = _longhand(samples)
    regen = write_synthetic_store(str(tmp_path / "r.zarr"), samples, regenerated=True)
    plain = write_synthetic_store(str(tmp_path / "p.zarr"), samples, regenerated=False)
    out = CliRunner().invoke(store, ["info", regen]).output
    assert f"top-1 agree    {agree:,} of {total:,} regenerated tokens" in out
    assert json.loads(CliRunner().invoke(store, ["info", regen, "--json"]).output)[
        "top1_agreement"] == [agree, total]
    assert "top-1 agree" not in CliRunner().invoke(store, ["info", plain]).output


def test_info_still_describes_a_regenerated_store_whose_token_bytes_are_damaged(tmp_path):
    url = write_synthetic_store(str(tmp_path / "r.zarr"), _samples(2), regenerated=True)
    chunk = next(p for p in (tmp_path / "r.zarr" / "parts").glob("*/input_ids/c/*")
                 if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    result = CliRunner().invoke(store, ["info", url])
    assert result.exit_code == 0, result.output
    assert "top-1 agree    n/a: a token array cannot be read" in result.output
    assert "dflash store validate" in result.output
