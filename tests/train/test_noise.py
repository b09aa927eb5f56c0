"""Noise goes on the fc input only, at the configured scale, and never reaches labels."""

import math

import pytest
import torch

from dflash_train.blocks import BlockError, block_labels, sample_anchors
from dflash_train.train.loss import slot_weights
from dflash_train.train.noise import (
    RELATIVE_STD_MAX,
    NoiseConfig,
    add_context_noise,
    context_layer_rms,
    noise_std_at,
)

N_LAYERS, H = 3, 64


def _context(seed: int, tokens: int = 200, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # layers at very different scales, as real target layers are
    scales = torch.tensor([0.5, 4.0, 30.0])[:, None]
    return (torch.randn(tokens, N_LAYERS, H, generator=gen) * scales).to(dtype)


def _sample(seed: int, length: int = 120):
    gen = torch.Generator().manual_seed(seed)
    return {
        "context": _context(seed, length),
        "verifier_topk_ids": torch.randint(0, 500, (length, 4), generator=gen),
        "loss_mask": torch.rand(length, generator=gen) < 0.8,
    }


def _labels_and_weights(sample, anchors):
    labels, valid = block_labels(sample["verifier_topk_ids"], sample["loss_mask"], anchors)
    return labels, valid, slot_weights(valid)


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_noise_never_reaches_labels(kind):
    sample = _sample(0)
    anchors = sample_anchors(sample["loss_mask"], 32, torch.Generator().manual_seed(0))
    before = _labels_and_weights(sample, anchors)
    rms = context_layer_rms(sample["context"])
    for seed in range(5):
        for std in [0.0, 0.05, 1.0, RELATIVE_STD_MAX]:
            clean = sample["context"].clone()
            noised = add_context_noise(
                sample["context"],
                rms,
                NoiseConfig(kind=kind, std=std),
                torch.Generator().manual_seed(seed),
            )
            sample_after = dict(sample, context=noised)
            after = _labels_and_weights(sample_after, anchors)
            for x, y in zip(before, after, strict=True):
                assert torch.equal(x, y)
            assert torch.equal(sample["context"], clean)  # input untouched
            assert std == 0.0 or not torch.equal(noised, clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_is_never_modified_and_dtype_is_kept(dtype):
    context = _context(1, dtype=dtype)
    original = context.clone()
    out = add_context_noise(
        context, context_layer_rms(context), NoiseConfig(std=0.5), torch.Generator().manual_seed(0)
    )
    assert torch.equal(context, original)
    assert out.dtype == dtype and out.shape == context.shape
    assert out.data_ptr() != context.data_ptr()


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_relative_noise_scales_with_each_layer_rms(kind):
    context = _context(2, tokens=4000)
    rms = context_layer_rms(context)
    std = 0.1
    out = add_context_noise(
        context, rms, NoiseConfig(kind=kind, std=std), torch.Generator().manual_seed(1)
    )
    delta = out - context  # [T, n, H]
    for layer in range(N_LAYERS):
        got = delta[:, layer].std().item()
        assert got == pytest.approx(std * rms[layer].item(), rel=0.03)


def test_absolute_noise_ignores_layer_scale():
    context = _context(3, tokens=4000)
    out = add_context_noise(
        context,
        None,
        NoiseConfig(kind="gaussian", std=0.2, absolute=True),
        torch.Generator().manual_seed(2),
    )
    per_layer = (out - context).transpose(0, 1).reshape(N_LAYERS, -1).std(-1)
    torch.testing.assert_close(per_layer, torch.full((N_LAYERS,), 0.2), rtol=0.03, atol=0)


def test_uniform_noise_is_bounded_and_gaussian_is_not():
    context = torch.zeros(5000, N_LAYERS, H)
    cfg = dict(std=1.0, absolute=True)
    uni = add_context_noise(
        context, None, NoiseConfig(kind="uniform", **cfg), torch.Generator().manual_seed(3)
    )
    gau = add_context_noise(
        context, None, NoiseConfig(kind="gaussian", **cfg), torch.Generator().manual_seed(3)
    )
    bound = math.sqrt(3.0)
    assert uni.abs().max() <= bound
    assert uni.abs().max() > 0.99 * bound
    assert gau.abs().max() > 3.0


def test_same_seed_repeats_and_another_seed_differs():
    context = _context(4)
    rms = context_layer_rms(context)

    def noise(seed):
        return add_context_noise(context, rms, NoiseConfig(), torch.Generator().manual_seed(seed))

    assert torch.equal(noise(5), noise(5))
    assert not torch.equal(noise(5), noise(6))


def test_none_kind_and_zero_std_return_an_equal_copy():
    context = _context(5)
    for cfg in [NoiseConfig(kind="none", std=1.0), NoiseConfig(std=0.0)]:
        out = add_context_noise(context, None, cfg, torch.Generator())
        assert torch.equal(out, context) and out.data_ptr() != context.data_ptr()


def test_linear_schedule_moves_std_from_start_to_end_then_holds():
    cfg = NoiseConfig(std=0.1, std_end=0.0, schedule_steps=100)
    assert noise_std_at(cfg, 0) == pytest.approx(0.1)
    assert noise_std_at(cfg, 50) == pytest.approx(0.05)
    assert noise_std_at(cfg, 100) == pytest.approx(0.0)
    assert noise_std_at(cfg, 10_000) == pytest.approx(0.0)
    assert noise_std_at(NoiseConfig(std=0.3), 10_000) == 0.3
    assert noise_std_at(NoiseConfig(kind="none", std=0.3), 0) == 0.0


def test_scheduled_std_is_what_gets_applied():
    context = torch.zeros(4000, N_LAYERS, H)
    cfg = NoiseConfig(kind="gaussian", std=1.0, std_end=3.0, schedule_steps=10, absolute=True)
    out = add_context_noise(context, None, cfg, torch.Generator().manual_seed(0), step=5)
    assert out.std().item() == pytest.approx(2.0, rel=0.02)


def test_context_layer_rms_matches_a_direct_computation():
    context = _context(6).reshape(4, 50, N_LAYERS, H)  # extra leading dims are fine
    rms = context_layer_rms(context)
    for layer in range(N_LAYERS):
        direct = context[..., layer, :].pow(2).mean().sqrt()
        assert rms[layer].item() == pytest.approx(direct.item(), rel=1e-5)


def test_bad_inputs_are_refused_with_a_reason():
    raw = torch.zeros(10, N_LAYERS, H, dtype=torch.int16)
    with pytest.raises(BlockError, match="floating"):
        add_context_noise(raw, None, NoiseConfig(absolute=True), torch.Generator())
    with pytest.raises(BlockError, match="layer_rms"):
        add_context_noise(_context(7), torch.ones(2), NoiseConfig(), torch.Generator())
    with pytest.raises(BlockError):
        NoiseConfig(kind="laplace")
    with pytest.raises(BlockError):
        NoiseConfig(std=-1.0)
    with pytest.raises(BlockError, match="schedule_steps"):
        NoiseConfig(std_end=0.0)
