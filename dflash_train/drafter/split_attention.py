"""Block attention that scores only the keys a block may see, with a recomputing backward.

Every query of a block sees some context positions and some slots of its own block, never
another block (masks.py). `split_attention` scores the two key sets apart, [K, B, S] and
[K, B, B] per head instead of the dense [K*B, S + K*B], and takes one softmax over both
without joining them (a join copies the scores each time). Its backward recomputes the
probabilities from the saved log-sum-exp instead of keeping them (flash-attention style), so
what stays for backward is the size of q, k, v and the output. Grouped-query heads broadcast
over the key heads; keys are never repeated. This module never decides who sees whom; the
caller passes the masks.
"""

import functools

import torch


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 or wider: softmax statistics of bf16 scores are kept in fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scores(x, ctx, own):
    """x [N, kv, g, K, B, d] scored against the context rows ctx [N, kv, S, d] ([..., K, B, S])
    and its own block's rows own [N, kv, 1, K, B, d] ([..., K, B, B]). Every query of a key
    head meets the context rows in one matmul, [g K B, d] x [d, S], so the rows are not
    repeated per group head."""
    on_ctx = (x.flatten(2, 4) @ ctx.transpose(-1, -2)).view(*x.shape[:5], ctx.shape[-2])
    return on_ctx, x @ own.transpose(-1, -2)


def _apply(w_ctx, w_own, ctx, own, dtype):
    """Weights on the context [..., K, B, S] and on the own block [..., K, B, B] applied to
    the context rows [N, kv, S, d] and the own block's [N, kv, 1, K, B, d]."""
    on_ctx = (w_ctx.to(dtype).flatten(2, 4) @ ctx).view(*w_ctx.shape[:5], ctx.shape[-1])
    return on_ctx + w_own.to(dtype) @ own


def _apply_t(w_ctx, w_own, x):
    """w^T x summed over the heads of a group: the context rows' [N, kv, S, d] (the matmul
    sums the group) and the own block's [N, kv, 1, K, B, d] share of a gradient."""
    ctx = w_ctx.to(x.dtype).flatten(2, 4).transpose(-1, -2) @ x.flatten(2, 4)
    own = w_own.to(x.dtype).transpose(-1, -2) @ x
    return ctx, own.sum(2, keepdim=True)


def _probabilities(q, kc, kb, hide_ctx, hide_own, shift=None):
    """exp(masked scores - shift) on the context and on the own block; without `shift`, the
    row maximum over both (a slot sees at least one key, so it is finite), also returned."""
    on_ctx, on_own = (_wide(s).masked_fill_(hide, float("-inf"))
                      for s, hide in zip(_scores(q, kc, kb), (hide_ctx, hide_own), strict=True))
    if shift is None:
        shift = on_own.amax(-1, keepdim=True)
        if on_ctx.shape[-1]:  # amax refuses an empty context
            shift = torch.maximum(shift, on_ctx.amax(-1, keepdim=True))
    return on_ctx.sub_(shift).exp_(), on_own.sub_(shift).exp_(), shift


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kc, vc, kb, vb, hide_ctx, hide_own):
        q = (q * q.shape[-1] ** -0.5).contiguous()
        p_ctx, p_own, peak = _probabilities(q, kc, kb, hide_ctx, hide_own)
        total = p_ctx.sum(-1, keepdim=True) + p_own.sum(-1, keepdim=True)
        out = (_wide(_apply(p_ctx, p_own, vc, vb, q.dtype)) / total).to(q.dtype)
        ctx.save_for_backward(q, kc, vc, kb, vb, hide_ctx, hide_own, out,
                              total.log_().add_(peak))
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, kc, vc, kb, vb, hide_ctx, hide_own, out, lse = ctx.saved_tensors  # q scaled
        p_ctx, p_own, _ = _probabilities(q, kc, kb, hide_ctx, hide_own, shift=lse)
        d_out = d_out.contiguous()
        d_vc, d_vb = _apply_t(p_ctx, p_own, d_out)
        # d score = p * (d p - sum_j p_j d p_j), with sum_j p_j d p_j = d_out . out
        rowdot = (_wide(d_out) * _wide(out)).sum(-1, keepdim=True)
        # the score gradients cast to q's dtype once, for both matmuls that take them
        d_ctx, d_own = (_wide(s).sub_(rowdot).mul_(p).to(q.dtype)
                        for s, p in zip(_scores(d_out, vc, vb), (p_ctx, p_own), strict=True))
        d_kc, d_kb = _apply_t(d_ctx, d_own, q)
        d_q = _apply(d_ctx, d_own, kc, kb, q.dtype) * q.shape[-1] ** -0.5
        return d_q, d_kc, d_vc, d_kb, d_vb, None, None


def split_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kb: torch.Tensor,
                    vb: torch.Tensor, hide_ctx: torch.Tensor, hide_own: torch.Tensor
                    ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the context keys and the own block's keys jointly.

    q [N, kv, g, K, B, d] (g query heads per key head); context kc, vc [N, kv, S, d]; own
    kb, vb [N, kv, 1, K, B, d]; hide_ctx [N, 1, 1, K, B, S] and hide_own [N, 1, 1, K, B, B]
    True where a slot may NOT attend (each slot must see at least one key). Returns
    [N, kv, g, K, B, d]. Under autocast every input is cast to its dtype first (the scores
    and softmax stay fp32), as autocast would cast a matmul."""
    device = q.device.type
    tensors = (q, kc, vc, kb, vb)
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    with torch.autocast(device, enabled=False):
        return _SplitAttention.apply(*(t.to(dtype) for t in tensors), hide_ctx, hide_own)
