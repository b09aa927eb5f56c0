"""Block attention that scores only the keys a block may see, with a recomputing backward.

Every query of a block sees some context positions and some slots of its own block, never
another block (masks.py). `split_attention` scores the two key sets apart, [K, B, S] and
[K, B, B] per head instead of the dense [K*B, S + K*B], and takes one softmax over both. Its
backward recomputes the probabilities from the saved log-sum-exp instead of keeping them
(flash-attention style), so what stays for backward is the size of q, k, v and the output.
Grouped-query heads broadcast over the key heads; keys are never repeated. This module
never decides who sees whom; the caller passes the masks.
"""

import functools

import torch


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 or wider: softmax statistics of bf16 scores are kept in fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _pair(x, ctx, own):
    """[..., K, B, S + B] of x @ ctx^T over the context and x @ own^T over the own block."""
    on_ctx = (x.flatten(3, 4) @ ctx.transpose(-1, -2)).unflatten(3, x.shape[3:5])
    return torch.cat([on_ctx, x @ own.transpose(-1, -2)], dim=-1)


def _apply(w, ctx, own, dtype):
    """w [..., K, B, S + B] applied to the context rows [S, d] and the own block's [B, d]."""
    w = w.to(dtype)
    span = ctx.shape[-2]
    on_ctx = (w[..., :span].flatten(3, 4) @ ctx).unflatten(3, w.shape[3:5])
    return on_ctx + w[..., span:] @ own


def _apply_t(w, x, span):
    """w^T x summed over the heads of a group: the context keys' [..., S, d] and the own
    block's [..., K, B, d] share of a gradient."""
    w = w.to(x.dtype)
    ctx = w[..., :span].flatten(3, 4).transpose(-1, -2) @ x.flatten(3, 4)
    own = w[..., span:].transpose(-1, -2) @ x
    return ctx.sum(2, keepdim=True), own.sum(2, keepdim=True)


def _probabilities(q, kc, kb, hide, shift=None):
    """exp(masked scores - shift); without `shift` also returns the row maximum used."""
    scores = _wide(_pair(q, kc, kb)).masked_fill_(hide, float("-inf"))
    peak = scores.amax(-1, keepdim=True) if shift is None else shift
    return scores.sub_(peak).exp_(), peak


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kc, vc, kb, vb, hide):
        q = q * q.shape[-1] ** -0.5
        p, peak = _probabilities(q, kc, kb, hide)
        total = p.sum(-1, keepdim=True)
        out = (_wide(_apply(p, vc, vb, q.dtype)) / total).to(q.dtype)
        ctx.save_for_backward(q, kc, vc, kb, vb, hide, out, total.log_().add_(peak))
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, kc, vc, kb, vb, hide, out, lse = ctx.saved_tensors  # q already scaled
        p, _ = _probabilities(q, kc, kb, hide, shift=lse)
        d_out = d_out.contiguous()
        d_vc, d_vb = _apply_t(p, d_out, kc.shape[-2])
        # d score = p * (d p - sum_j p_j d p_j), with sum_j p_j d p_j = d_out . out
        rowdot = (_wide(d_out) * _wide(out)).sum(-1, keepdim=True)
        d_s = _wide(_pair(d_out, vc, vb)).sub_(rowdot).mul_(p)
        d_kc, d_kb = _apply_t(d_s, q, kc.shape[-2])
        d_q = _apply(d_s, kc, kb, q.dtype) * q.shape[-1] ** -0.5
        return d_q, d_kc, d_vc, d_kb, d_vb, None


def split_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kb: torch.Tensor,
                    vb: torch.Tensor, hide: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the context keys and the own block's keys jointly.

    q [N, kv, g, K, B, d] (g query heads per key head); context kc, vc [N, kv, 1, S, d]; own
    kb, vb [N, kv, 1, K, B, d]; hide [N, 1, 1, K, B, S + B] True where a slot may NOT
    attend, context keys first (each slot must see at least one key). Returns
    [N, kv, g, K, B, d]. Under autocast every input is cast to its dtype first (the scores
    and softmax stay fp32), as autocast would cast a matmul."""
    device = q.device.type
    tensors = (q, kc, vc, kb, vb)
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    with torch.autocast(device, enabled=False):
        return _SplitAttention.apply(*(t.to(dtype) for t in tensors), hide)
