"""Keyed Gumbel-max sampling: the noise is a pure function of its key, the draws follow the
tempered (and top-k / top-p restricted) softmax, and T = 0 is argmax."""

import math

import pytest
import torch

from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.sampling import (
    SamplingConfig,
    _keyed_bits,
    gumbel_noise,
    perturbed_logits,
    sample_next,
    sampling_logits,
)

LOGITS = torch.tensor([2.0, 1.5, 0.5, 0.0, -0.5, -1.0, -3.0, 1.0])
DRAWS = 20000


def _draws(cfg: SamplingConfig, logits: torch.Tensor = LOGITS, n: int = DRAWS) -> torch.Tensor:
    """Token counts over n keys: sample ids 0..n-1 at one position, all rows in one call."""
    tokens = sample_next(logits.expand(n, -1), cfg, torch.arange(n), torch.full((n,), 17))
    return torch.bincount(tokens, minlength=logits.numel())


def _chi_square_fits(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's statistic over the tokens of positive probability against its 99.9 % quantile
    (Wilson-Hilferty), so a correct sampler fails once in a thousand seeds at most."""
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    z = 3.09  # the normal's 99.9 % quantile
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < limit


def _fmix32(x: int) -> int:
    """MurmurHash3's finalizer on Python's unbounded ints: the reference for the int64 lanes."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reference_bits(seed: int, sample: int, position: int, token: int) -> int:
    key = _fmix32(_fmix32(_fmix32(seed) ^ (sample % 2**32)) ^ (position % 2**32))
    return _fmix32(key ^ _fmix32(token ^ 0x9E3779B9))


def test_the_keyed_bits_are_exact_integer_arithmetic_and_pinned():
    # exact arithmetic is what makes every device draw the same bits; pinned values keep what
    # a recorded seed means: changing the stream would silently re-draw every sampled store
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2**40, (6,), generator=gen).tolist() + [2**32 - 1, 0]
    pos = torch.randint(0, 2**34, (6,), generator=gen).tolist() + [2**32 - 1, 2**32]
    for seed in (0, 1, 2**32 - 1):
        got = _keyed_bits(seed, ids, pos, 70, torch.device("cpu")).tolist()
        assert got == [[_reference_bits(seed, i, p, t) for t in range(70)]
                       for i, p in zip(ids, pos, strict=True)]
    assert _keyed_bits(0, [0, 1], [0, 5], 4, torch.device("cpu")).tolist() == [
        [2856213345, 2571226413, 3248948688, 1895220952],
        [4236873141, 2255943566, 3983162323, 2979233627]]


def test_the_noise_is_a_pure_function_of_seed_sample_position_and_token():
    ids, pos = torch.tensor([3, 8, 3, 1_000_000]), torch.tensor([10, 10, 11, 4])
    noise = gumbel_noise(7, ids, pos, 300)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(gumbel_noise(7, ids[perm], pos[perm], 300), noise[perm])
    alone = [gumbel_noise(7, [int(i)], [int(p)], 300)[0] for i, p in zip(ids, pos, strict=True)]
    assert torch.equal(torch.stack(alone), noise)
    # a wider vocabulary extends each row, it does not reshuffle it
    assert torch.equal(gumbel_noise(7, ids, pos, 500)[:, :300], noise)
    # the same sample at another position, or another sample at the same one, is other noise
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])


def test_different_seeds_draw_different_noise_and_tokens():
    ids, pos = torch.arange(64), torch.full((64,), 5)
    assert not torch.equal(gumbel_noise(0, ids, pos, 100), gumbel_noise(1, ids, pos, 100))
    logits = torch.zeros(64, 100)
    cfg = SamplingConfig(temperature=1.0, seed=0)
    other = SamplingConfig(temperature=1.0, seed=1)
    assert (sample_next(logits, cfg, ids, pos) != sample_next(logits, other, ids, pos)).any()


def test_the_noise_is_standard_gumbel():
    g = gumbel_noise(3, torch.arange(50), torch.arange(50), 4000).flatten().double()
    assert abs(float(g.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.01
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_softmax(temperature):
    cfg = SamplingConfig(temperature=temperature, seed=11)
    assert _chi_square_fits(_draws(cfg), torch.softmax(LOGITS / temperature, -1))


def test_draws_follow_each_position_and_seed_alike():
    # one sample id, many positions: the key's other lane is as good a source of draws
    cfg = SamplingConfig(temperature=1.0, seed=123)
    n = DRAWS
    tokens = sample_next(LOGITS.expand(n, -1), cfg, torch.zeros(n), torch.arange(n))
    counts = torch.bincount(tokens, minlength=LOGITS.numel())
    assert _chi_square_fits(counts, torch.softmax(LOGITS, -1))


def test_top_k_and_top_p_never_emit_a_masked_token_and_renormalize_the_rest():
    cfg = SamplingConfig(temperature=1.0, top_k=3, seed=5)
    counts = _draws(cfg)
    assert counts[[2, 3, 4, 5, 6]].sum() == 0  # outside the 3 largest logits (ids 0, 1, 7)
    kept = torch.zeros_like(LOGITS, dtype=torch.bool)
    kept[[0, 1, 7]] = True
    assert _chi_square_fits(counts, torch.softmax(LOGITS.masked_fill(~kept, -math.inf), -1))
    probs = torch.softmax(LOGITS, -1)  # 0.39, 0.24, 0.14 (id 7), 0.09 (id 2): 0.77 by id 7
    counts = _draws(SamplingConfig(temperature=1.0, top_p=0.7, seed=5))
    assert set(counts.nonzero().flatten().tolist()) == {0, 1, 7}
    assert _chi_square_fits(counts, torch.softmax(LOGITS.masked_fill(~kept, -math.inf), -1))
    assert probs[[0, 1]].sum() < 0.7 < probs[[0, 1, 7]].sum()


def test_top_p_applies_to_what_top_k_left():
    cfg = SamplingConfig(temperature=1.0, top_k=2, top_p=0.6)
    masked = sampling_logits(LOGITS[None], cfg)[0]
    # of ids 0 and 1 renormalized (0.62, 0.38), id 0 alone reaches 0.6
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [0]


def test_temperature_zero_is_plain_argmax():
    logits = torch.randn(32, 50)
    assert torch.equal(sample_next(logits, SamplingConfig()), logits.argmax(-1))


def test_a_tiny_temperature_draws_the_argmax():
    logits = torch.randn(32, 50)
    cfg = SamplingConfig(temperature=1e-4, seed=9)
    assert torch.equal(sample_next(logits, cfg, torch.arange(32), torch.arange(32)),
                       logits.argmax(-1))


@pytest.mark.parametrize("bad, named", [
    (dict(temperature=-0.1), "temperature -0.1"), (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p 0.0"), (dict(top_p=1.5), "top_p 1.5"),
    (dict(top_k=-1), "top_k -1"), (dict(seed=-1), "seed -1"), (dict(seed=1 << 32), "seed"),
])
def test_invalid_settings_are_refused_naming_the_value(bad, named):
    with pytest.raises(TargetError, match=named):
        SamplingConfig(**bad)


def test_a_draw_needs_its_keys():
    with pytest.raises(TargetError, match="sample_ids and positions"):
        sample_next(LOGITS[None], SamplingConfig(temperature=1.0))
    with pytest.raises(TargetError, match="positions has 1 entries for 2 rows"):
        sample_next(LOGITS.expand(2, -1), SamplingConfig(temperature=1.0), [0, 1], [3])


def _full_noise(logits: torch.Tensor, cfg: SamplingConfig, ids, positions) -> torch.Tensor:
    """The reference: every token's noise computed, masked or not."""
    return sampling_logits(logits, cfg) + gumbel_noise(cfg.seed, ids, positions,
                                                       logits.shape[-1])


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0, top_k=20, seed=7),
                                 SamplingConfig(temperature=0.6, top_k=20, top_p=0.95, seed=8),
                                 SamplingConfig(temperature=0.7, top_p=0.3, seed=9)],
                         ids=["top_k20", "top_k20-top_p0.95", "top_p0.3"])
def test_noise_on_the_kept_tokens_only_draws_what_full_noise_draws(cfg):
    # a Qwen-sized vocabulary, logits with ties (bf16-like rounding), many keys
    vocab, rows = 151936, 64
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(torch.bfloat16).float()
    ids, positions = torch.arange(rows) * 7 + 3, torch.arange(rows) + 1000
    got = perturbed_logits(logits, cfg, ids, positions)
    want = _full_noise(logits, cfg, ids, positions)
    assert torch.equal(got, want)  # every element's bits, -inf included
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    drawn = [int(sample_next(logits[r : r + 1], cfg, [int(ids[r])], [p]))
             for r in range(4) for p in range(50)]
    assert drawn == [int(_full_noise(logits[r : r + 1], cfg, [int(ids[r])], [p]).argmax())
                     for r in range(4) for p in range(50)]
    assert len(set(drawn)) > 4  # 4 rows, yet more tokens: the keys draw, not one winner
