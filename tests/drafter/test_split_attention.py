"""split_attention against softmax attention written out over the same keys, in float64."""

import torch

from dflash_train.drafter.split_attention import split_attention

N, KV, G, K, B, S, D = 2, 2, 3, 3, 4, 5, 8


def _inputs(seed: int, dtype=torch.float64, context: int = S):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, KV, G, K, B, D, generator=gen, dtype=dtype)
    kc, vc = (torch.randn(N, KV, context, D, generator=gen, dtype=dtype) for _ in "kv")
    kb, vb = (torch.randn(N, KV, 1, K, B, D, generator=gen, dtype=dtype) for _ in "kv")
    hide = torch.rand(N, 1, 1, K, B, context + B, generator=gen) < 0.5
    hide[..., torch.arange(B), context + torch.arange(B)] = False  # every slot sees itself
    return [t.requires_grad_() for t in (q, kc, vc, kb, vb)], hide.split([context, B], -1)


def _reference(q, kc, vc, kb, vb, hide):
    """Each query against its own key list: the context rows, then its block's rows."""
    out, hide = torch.zeros_like(q), torch.cat(hide, -1)
    for n, h, g, k, b in torch.cartesian_prod(*map(torch.arange, q.shape[:5])).tolist():
        keys = torch.cat([kc[n, h], kb[n, h, 0, k]])
        values = torch.cat([vc[n, h], vb[n, h, 0, k]])
        scores = keys @ q[n, h, g, k, b] / D**0.5
        weights = scores.masked_fill(hide[n, 0, 0, k, b], float("-inf")).softmax(-1)
        out[n, h, g, k, b] = weights @ values
    return out


def _assert_matches_reference(inputs, hide):
    """Output and every input's gradient equal the longhand reference's (float64)."""
    got = split_attention(*inputs, *hide)
    want = _reference(*inputs, hide)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    d_out = torch.randn_like(got)
    grads = torch.autograd.grad(got, inputs, d_out)
    expected = torch.autograd.grad(want, inputs, d_out)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_split_attention_is_softmax_attention_over_the_visible_keys():
    _assert_matches_reference(*_inputs(0))


def test_split_attention_passes_gradcheck():
    inputs, hide = _inputs(1)
    assert torch.autograd.gradcheck(lambda *t: split_attention(*t, *hide), inputs, fast_mode=True)


def test_an_empty_context_leaves_only_the_own_block():
    (q, kc, vc, kb, vb), hide = _inputs(2, context=0)
    got = split_attention(q, kc, vc, kb, vb, *hide)
    torch.testing.assert_close(got, _reference(q, kc, vc, kb, vb, hide), rtol=1e-12, atol=1e-12)
    got.sum().backward()
    assert torch.isfinite(q.grad).all() and kc.grad.shape == kc.shape


def test_bf16_autocast_keeps_the_softmax_in_fp32_and_stays_close():
    (q, kc, vc, kb, vb), hide = _inputs(3, dtype=torch.float32)
    want = split_attention(q, kc, vc, kb, vb, *hide)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = split_attention(q, kc, vc, kb, vb, *hide)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
    got.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_a_slot_may_see_none_of_its_own_block():
    inputs, (hide_ctx, hide_own) = _inputs(4)
    hide_ctx, hide_own = hide_ctx.clone(), hide_own.clone()
    hide_own[..., ::2, :] = True  # every other slot sees only context keys
    hide_ctx[..., 0] = False  # and each slot sees the first one at least
    _assert_matches_reference(inputs, (hide_ctx, hide_own))
