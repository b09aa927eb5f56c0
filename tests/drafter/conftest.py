"""Tiny drafters built in-process: hidden 64, 4 q heads / 2 kv heads of 16, vocab 100."""

import pytest
import torch

from dflash_train.drafter import DFlashDrafter, DrafterConfig, build_block_ids

VOCAB = 100
HIDDEN = 64
MASK_ID = 99
N_FEATURES = 3


def tiny_config(**overrides) -> DrafterConfig:
    fields = dict(
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        intermediate_size=128,
        target_layer_ids=[1, 3, 5],
        num_target_layers=8,
        mask_token_id=MASK_ID,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        block_size=4,
    )
    fields.update(overrides)
    return DrafterConfig(**fields)


def tiny_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    """A randomly initialised tiny drafter with its borrowed head attached, in eval mode."""
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    embed = torch.randn(VOCAB, HIDDEN)
    head = torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5
    # std 0.2 (not the 0.02 training init) so attention is far from uniform, and the final
    # norm at 1 (not 1/sqrt(hidden)), so every visibility change moves the logits well
    # above float32 noise.
    model = DFlashDrafter(config, embed_tokens=embed, lm_head=head)
    model.reset_parameters(std=0.2, final_norm="ones")
    return model.eval()


def random_batch(model: DFlashDrafter, seed: int, n: int = 2, t: int = 24, k: int = 4,
                 lengths: list[int] | None = None):
    """Context features, valid lengths, block ids and anchors for n sequences of k blocks.

    Anchors are distinct and drawn from 1 .. length-1 of each sequence.
    """
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    lengths = lengths or [t] * n
    features = torch.randn(n, t, cfg.num_context_features, cfg.hidden_size, generator=gen)
    tokens = torch.randint(0, VOCAB - 1, (n, t), generator=gen)
    anchors = torch.stack([
        1 + torch.randperm(length - 1, generator=gen)[:k] for length in lengths
    ])
    ids = build_block_ids(torch.gather(tokens, 1, anchors), cfg.mask_token_id, cfg.block_size)
    return features, torch.tensor(lengths), ids, anchors


@pytest.fixture
def model() -> DFlashDrafter:
    return tiny_drafter()


DFLASH2 = dict(kind="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8,
               selector_top_k=5)
"""A tiny DFlash 2 shape: 4 conv groups of 16 channels, released kernel size, rank 8, top 5."""


def tiny_dflash2(seed: int = 0, **overrides) -> DFlashDrafter:
    """tiny_drafter of kind dflash2, its convs and selector moved well off their identity
    init (base kernels and codebooks ~ N(0, 0.5) around it, projections ~ N(0, 0.2)), so the
    convs mix slots and the selector's pairwise term reorders candidates (factorised
    codebooks: their factors, scaled so that E W is about as large)."""
    model = tiny_drafter(seed, **{**DFLASH2, **overrides})
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "kernel_projection" in name or "hidden_projection" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
            elif "base_kernel" in name or "codebook" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.5)
            elif name.endswith("_factor"):  # A = E W: E's rows have norm ~ sqrt(HIDDEN)
                param.add_(torch.randn(param.shape, generator=gen) * 0.5 / HIDDEN**0.5)
    return model
