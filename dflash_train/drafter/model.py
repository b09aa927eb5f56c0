"""The DFlash drafter network: one pass of blocks through its layers for train, replay, live.

Body (docs/reference.md §1): `ctx = hidden_norm(fc(concat of n target-layer features))`, then
Qwen3-style decoder layers at the target width whose keys/values are
`concat(k/v_proj(ctx), k/v_proj(block))` in EVERY layer (KV injection; the context is not
transformed by the layers and is never a query), then a final RMSNorm. Parameter names are
the published checkpoint's (`fc`, `hidden_norm`, `layers.N.*`, `norm`). A DFlash 2 drafter
(`config.kind == "dflash2"`, dflash2.py) adds in-block convolutions inside each layer and a
`candidate_selector` that `propose` walks; the pass itself is the same.

The target's `embed_tokens` and `lm_head` are borrowed, frozen: attached as non-persistent
buffers, so they are never in the state_dict, never trained, never saved.

Init (`reset_parameters`): HF's (linears ~ N(0, 0.02), norms at 1) except the final norm, which
starts at 1/sqrt(hidden) (`FinalNormInit`, why there).

`decode_blocks` is that one pass, over the projected context (training `forward`) or over a
context KV cache (`extend_context`; replay at any anchors, live `draft_block` at its end).
Blocks never see each other, so the multi-block forward may run them in chunks
(`chunk_blocks`), each recomputed in backward: activation memory then follows the chunk, not
the batch, and no value changes. Off CUDA the default attention (`split`) scores each block
slot against the keys it may see only (split_attention.py), not every block's keys.

This module never reads files or builds datasets; it never decides which tokens are
anchors or what the labels are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint

from dflash_train.blocks import IGNORE_LABEL, draft_topk
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.masks import (
    BlockLayout,
    context_mask,
    context_span,
    dense_mask,
    flex_block_mask,
    own_block_mask,
)
from dflash_train.drafter.split_attention import split_attention

AttentionBackend = Literal["auto", "flex", "dense", "split"]
KeysValues = tuple[torch.Tensor, torch.Tensor]
Attend = Callable[[torch.Tensor, KeysValues, KeysValues], torch.Tensor]
"""attend(queries, context (keys, values), the blocks' own (keys, values)) -> outputs."""
FinalNormInit = Literal["unit", "ones"]
"""How a new drafter's final norm weight starts (`reset_parameters`).

unit (the default): every channel at 1/sqrt(hidden), so a slot's output starts as a unit
vector and no logit starts further from 0 than the norm of its lm_head row: the first loss is
near ln V. ones: HF's init, every channel at 1. Why it matters: a fresh drafter's residual
stream is still mostly its block's input embeddings (its layers' outputs start small), the
mask token's on every slot but the anchor, and a real target's embedding rows share one large
common direction (SmolLM2-135M: rows of norm ~3.2, their mean of norm 2.2). At 1 a slot's
output has norm sqrt(hidden) and points mostly along the mask row (cosine 0.6 on SmolLM2),
so its logits spread with a std of ~11 there and the first loss is 57-81 nats (ln V: 10.8,
or 8.3 over a 4,096-word draft vocabulary), which the first steps only unlearn. The scale
is positive and the same for every channel, so a fresh drafter's drafts (each slot's argmax,
or DFlash 2's walk over them) are the same under both; only the probabilities, and so the
loss, differ."""
FINAL_NORM_INITS: tuple[FinalNormInit, ...] = ("unit", "ones")
PROPOSE_CHUNK_BLOCKS = 64
"""Blocks whose full logits [S, V] `propose` holds at once (64 x 15 x 248K fp32 is ~1 GB)."""
SAVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Precisions a drafter's draft-vocabulary lm_head rows may have been written at."""

_compiled_flex: Callable | None = None


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., S, head_dim] for integer positions [..., S] (HF / neox layout)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, S, d] by cos/sin [N or 1, S, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Block queries over injected context keys plus the block's own keys."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim)

    def keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values [N, kv_heads, S, d] of hidden states x [N, S, H]."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(
        self,
        x: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
    ) -> torch.Tensor:
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        q = apply_rope(q, *rope)
        out = attend(q, context_kv, self.keys_values(x, rope))
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """Qwen3 SwiGLU feed-forward."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; the context enters the attention un-normed by this
    layer's input_layernorm (it was normed once by hidden_norm). A DFlash 2 layer wraps its
    attention and its MLP each in an in-block convolution (dflash2.py); the context is not
    convolved."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.attention_conv = self.mlp_conv = None
        if config.kind == "dflash2":
            def conv() -> GroupedDynamicCausalConv:
                return GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size,
                                                config.conv_group_size, config.block_size)
            self.attention_conv, self.mlp_conv = conv(), conv()

    def forward(
        self,
        x: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
        context_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: blocks [N, K*B, H]. context: the context's cached (keys, values); or, with
        context_rope, the projected context [N, S, H] whose keys/values this layer computes
        here, inside its own call, where FSDP has gathered its weights."""
        if context_rope is not None:
            context = self.self_attn.keys_values(context, context_rope)
        attn = functools.partial(self.self_attn, context_kv=context, rope=rope, attend=attend)
        x = x + _convolved(self.attention_conv, attn, self.input_layernorm(x))
        return x + _convolved(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


def _convolved(conv: GroupedDynamicCausalConv | None, sublayer: Callable, x: torch.Tensor
               ) -> torch.Tensor:
    """sublayer(x), or with a DFlash 2 conv: finish(sublayer(prepare(x)))."""
    if conv is None:
        return sublayer(x)
    x, delta = conv.prepare(x)
    return conv.finish(sublayer(x), delta)


@dataclass
class ContextCache:
    """Per-layer context keys/values of the live forward, positions 0 .. length-1."""

    keys: list[torch.Tensor] = field(default_factory=list)
    """Per layer [N, kv_heads, length, head_dim], already normed and rotated."""
    values: list[torch.Tensor] = field(default_factory=list)
    """Per layer [N, kv_heads, length, head_dim]."""
    length: int = 0
    """Context positions held; the next block's anchor is at this position."""


class DFlashDrafter(nn.Module):
    """The DFlash drafter. Borrowed target rows via `attach_target_head`."""

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: torch.Tensor | None = None,
        lm_head: torch.Tensor | None = None,
        *,
        final_norm_init: FinalNormInit = "unit",
    ):
        super().__init__()
        config.validate()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_context_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.candidate_selector = None
        if config.kind == "dflash2":
            self.candidate_selector = CandidateSelector(h, config.vocab_size,
                                                        config.selector_rank,
                                                        config.selector_top_k,
                                                        config.selector_codebooks)
        self.register_buffer("target_embed_tokens", None, persistent=False)
        self.register_buffer("target_lm_head", None, persistent=False)
        self.register_buffer("draft_ids", None)
        self.register_buffer("draft_lm_head", None)
        if config.draft_vocab_size is not None:
            # Placeholders until set_draft_vocab (training) or load_state_dict (a checkpoint).
            self.draft_ids = torch.arange(config.draft_vocab_size)
            self.draft_lm_head = torch.zeros(config.draft_vocab_size, h)
        self.gradient_checkpointing = False
        """Recompute each layer in backward instead of keeping its activations (training)."""
        self.chunk_blocks: int | None = None
        """Most blocks (summed over the sequences) one pass through the layers takes; a
        forward of more runs them in chunks, each recomputed in backward when it needs
        gradients, so activation memory follows this, not the batch. None: all at once.
        Not under FSDP2: it gathers weights per layer call, so ranks would have to agree on
        their number of chunks."""
        self.reset_parameters(final_norm=final_norm_init)
        if embed_tokens is not None or lm_head is not None:
            self.attach_target_head(embed_tokens, lm_head)

    def reset_parameters(self, std: float = 0.02, final_norm: FinalNormInit = "unit") -> None:
        """HF-style init: linears ~ N(0, std), norms at 1, the final norm as `final_norm`
        says (FinalNormInit); then DFlash 2's convs as the identity and its selector's
        pairwise term 0 (dflash2.py), so a fresh DFlash 2 drafter computes what the DFlash
        one with the same backbone weights computes."""
        if final_norm not in FINAL_NORM_INITS:
            raise DrafterError(f"final_norm {final_norm!r}: must be one of "
                               f"{', '.join(FINAL_NORM_INITS)}")
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if final_norm == "unit":
            with torch.no_grad():
                self.norm.weight.fill_(self.config.hidden_size ** -0.5)
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_parameters()
            elif isinstance(module, CandidateSelector):
                module.reset_parameters(std)

    def attach_target_head(
        self, embed_tokens: torch.Tensor | None, lm_head: torch.Tensor | None
    ) -> None:
        """Borrow the target's frozen [vocab, hidden] embedding and lm_head rows.

        Pass the same tensor twice for a target with tied embeddings.
        """
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, weight in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if weight is None:
                raise DrafterError(f"attach_target_head: {name} is missing")
            if tuple(weight.shape) != want:
                raise DrafterError(
                    f"target {name} has shape {tuple(weight.shape)}, the drafter needs {want}"
                )
        self.target_embed_tokens = embed_tokens.detach()
        self.target_lm_head = lm_head.detach()
        if self.draft_ids is not None:
            self._take_draft_rows()

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft over these target ids [draft_vocab_size] (distinct, in the vocabulary): the
        drafter's lm_head becomes the target's rows at them (attached now or later)."""
        ids = check_draft_ids(target_ids, self.config)
        self.draft_ids = ids.to(self.fc.weight.device)
        if self.target_lm_head is not None:
            self._take_draft_rows(check=False)

    def _take_draft_rows(self, check: bool = True) -> None:
        """draft_lm_head := the attached target's rows at draft_ids. A loaded checkpoint's rows
        must be those rows (at its stored precision): other ones were taken from another
        target's lm_head. All zeros is the placeholder of a drafter never given its map."""
        rows = self.target_lm_head.index_select(0, self.draft_ids.to(self.target_lm_head.device))
        held = self.draft_lm_head
        if check and held is not None and not held.is_meta and bool(held.any()):
            held = held.to(rows.device)
            # the rows rounded to the precision they were saved at, then loaded at another
            if not any(torch.equal(held, rows.to(d).to(held.dtype)) for d in SAVED_DTYPES):
                raise DrafterError("the drafter's lm_head rows (its draft vocabulary's) are not "
                                   "this target's lm_head rows at its d2t ids: it was trained "
                                   "for another target")
        self.draft_lm_head = rows

    @property
    def head_weight(self) -> torch.Tensor:
        """The [draft_vocab, H] rows the drafter's logits are over: the borrowed lm_head, or
        its draft-vocabulary rows."""
        if self.target_lm_head is None:
            raise DrafterError("no target lm_head attached; call attach_target_head first")
        return self.target_lm_head if self.draft_ids is None else self.draft_lm_head

    def draft_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k fp32 log-probs and target ids [..., k'] of final-norm hidden states [..., H]
        over the drafter's head (blocks.draft_topk): over a draft vocabulary the softmax is
        over its rows, as vLLM's is with the other logits -inf."""
        logp, ids = draft_topk(hidden, self.head_weight.to(hidden.dtype), k)
        return logp, self.to_target_ids(ids)

    def to_target_ids(self, draft: torch.Tensor) -> torch.Tensor:
        """Target ids of draft-vocabulary ids (the same ids without a draft vocabulary)."""
        if self.draft_ids is None:
            return draft
        return self.draft_ids.to(draft.device)[draft]

    def to_draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target-id labels as draft ids; IGNORE_LABEL stays, and so becomes every label
        outside the draft vocabulary: a miss the drafter cannot make."""
        if self.draft_ids is None:
            return labels
        table = torch.full((self.config.vocab_size,), IGNORE_LABEL, dtype=torch.long,
                           device=labels.device)
        table[self.draft_ids.to(labels.device)] = torch.arange(self.config.draft_vocab_size,
                                                               device=labels.device)
        return torch.where(labels >= 0, table[labels.clamp(min=0)], labels)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.target_embed_tokens is None:
            raise DrafterError("no target embed_tokens attached; call attach_target_head first")
        return F.embedding(ids, self.target_embed_tokens).to(self.fc.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the borrowed lm_head (callers may chunk `hidden` to bound memory)."""
        return F.linear(hidden, self.head_weight.to(hidden.dtype))

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                chunk_blocks: int = PROPOSE_CHUNK_BLOCKS) -> torch.Tensor:
        """Greedy drafts [..., S] of a block's slots 1..S (hidden [..., S, H] after the
        final norm) whose anchor tokens are anchor_ids [...]: each slot's argmax logit, or
        for DFlash 2 the selector's walk from the anchor over each slot's top candidates.
        `chunk_blocks` blocks' [S, V] logits at a time."""
        flat, anchors = hidden.reshape(-1, *hidden.shape[-2:]), anchor_ids.reshape(-1)
        drafts = []
        for start in range(0, flat.shape[0], chunk_blocks):
            h = flat[start:start + chunk_blocks]
            logits = self.logits(h)
            if self.candidate_selector is None:
                drafts.append(self.to_target_ids(logits.argmax(-1)))
            else:
                drafts.append(self.candidate_selector.walk(
                    h, logits, anchors[start:start + chunk_blocks], self.target_embed_tokens))
        if not drafts:
            return flat.new_zeros(flat.shape[:-1], dtype=torch.long).reshape(hidden.shape[:-1])
        return torch.cat(drafts).reshape(hidden.shape[:-1])

    def project_context(self, context: torch.Tensor) -> torch.Tensor:
        """ctx = hidden_norm(fc(features)); features [N, T, n, H] or [N, T, n*H]."""
        if context.dim() == 4:
            context = context.flatten(2)
        want = self.fc.in_features
        if context.dim() != 3 or context.shape[-1] != want:
            raise DrafterError(
                f"context features have shape {tuple(context.shape)}; expected [N, T, "
                f"{self.config.num_context_features}, {self.config.hidden_size}] or [N, T, {want}]"
            )
        return self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def forward(
        self,
        context: torch.Tensor,
        context_lengths: torch.Tensor,
        block_ids: torch.Tensor,
        anchors: torch.Tensor,
        attention: AttentionBackend = "auto",
    ) -> torch.Tensor:
        """Hidden states after the final norm, [N, K, B, H], of K blocks per sequence.

        context: [N, T, n, H] target features (padded to T); context_lengths: [N] valid
        positions; block_ids: [N, K, B] = [anchor token, MASK...] per block; anchors: [N, K]
        positions of the anchor tokens. Block k sees context < anchors[:, k] and itself
        (masks.py). Padding blocks may use any anchor and are simply ignored by the caller.
        attention: "flex" (flex_attention, compiled on CUDA; on CPU eager and forward
        only), "dense" (SDPA with a bool mask over every key, the reference), "split"
        (each slot scored against only the context and own-block keys it may see),
        "auto" = flex on CUDA, split elsewhere. Compiled flex recompiles per distinct
        (T, K): pad batches to a few fixed shapes. Blocks never see each other, so
        `chunk_blocks` may split them into chunks of `decode_blocks` without changing any value.
        """
        self._check_blocks(block_ids, anchors)  # before slicing, which could hide a mismatch
        n, k = block_ids.shape[:2]
        ctx = self.project_context(context)
        rows, cols = chunk_shape(n, k, self.chunk_blocks)
        if (rows, cols) == (n, k):
            return self.decode_blocks(ctx, context_lengths, block_ids, anchors, attention)
        # Only a chunk's inputs stay for backward, which runs it again. torch's checkpoint
        # would build a graph per chunk and drop it: its small autograd nodes then sit in the
        # holes of the chunk's freed activations, and glibc took fresh heap for every chunk
        # (peak RSS 1.5-1.7x).
        recompute = torch.is_grad_enabled()
        trainable = [p for p in self.parameters() if p.requires_grad] if recompute else []
        rows_out = []
        for r in range(0, n, rows):
            seqs, parts = slice(r, r + rows), []
            for c in range(0, k, cols):
                run = functools.partial(self.decode_blocks,
                                        context_lengths=context_lengths[seqs],
                                        block_ids=block_ids[seqs, c:c + cols],
                                        anchors=anchors[seqs, c:c + cols], attention=attention)
                parts.append(_Recomputed.apply(run, ctx[seqs], *trainable) if recompute
                             else run(ctx[seqs]))
            rows_out.append(torch.cat(parts, dim=1))
        return torch.cat(rows_out, dim=0)

    def _check_blocks(self, block_ids: torch.Tensor, anchors: torch.Tensor) -> None:
        if block_ids.dim() != 3 or block_ids.shape[2] != self.config.block_size:
            raise DrafterError(f"blocks have shape {tuple(block_ids.shape)}; expected [N, K, "
                               f"{self.config.block_size}] (this drafter's block_size)")
        if anchors.shape != block_ids.shape[:2]:
            raise DrafterError(f"anchors shape {tuple(anchors.shape)} != blocks "
                               f"{tuple(block_ids.shape[:2])}")

    def decode_blocks(
        self,
        context: torch.Tensor | ContextCache,
        context_lengths: torch.Tensor | None,
        block_ids: torch.Tensor,
        anchors: torch.Tensor,
        attention: AttentionBackend = "auto",
    ) -> torch.Tensor:
        """Hidden states after the final norm, [N, K, B, H], of blocks [N, K, B] at anchors
        [N, K]: the one pass through the layers that training, replay and live drafting share.

        context: the projected context [N, T, H] (training: each layer computes its keys and
        values inside its own call, where FSDP has gathered its weights and checkpointing
        recomputes them), or a ContextCache of them (replay, live drafting). context_lengths:
        [N] valid positions; None: all of them. attention: as in `forward`.
        """
        self._check_blocks(block_ids, anchors)
        n, k, b = block_ids.shape
        if attention == "auto":
            attention = "flex" if block_ids.device.type == "cuda" else "split"
        if attention not in _ATTENDS:
            raise DrafterError(f"attention must be one of auto, {', '.join(_ATTENDS)}; "
                               f"got {attention!r}")
        t, per_layer, context_rope = self._layer_contexts(context)
        if context_lengths is None:
            context_lengths = torch.full((n,), t, device=anchors.device, dtype=torch.long)
        layout = BlockLayout.build(anchors, context_lengths, t, b)
        x = self._embed(block_ids).flatten(1, 2)  # [N, K*B, H]
        rope = self._rope(layout.query_positions(), x.dtype)
        attends: dict[tuple[bool, int | None], Attend] = {}
        for i, (layer, layer_context) in enumerate(zip(self.layers, per_layer, strict=True)):
            rule = (self.config.layer_is_causal(i), self.config.layer_window(i))
            if rule not in attends:
                attends[rule] = _ATTENDS[attention](layout, *rule)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, layer_context, rope, attends[rule], context_rope,
                               use_reentrant=False)
            else:
                x = layer(x, layer_context, rope, attends[rule], context_rope)
        return self.norm(x).view(n, k, b, -1)

    def _layer_contexts(self, context: torch.Tensor | ContextCache):
        """(T, what each layer's attention reads of the context, the context's rope): a
        cache's keys/values per layer and no rope, or the projected context with its rope."""
        if isinstance(context, ContextCache):
            if not context.length:
                raise DrafterError("drafting needs at least one context position in the cache")
            return context.length, list(zip(context.keys, context.values, strict=True)), None
        t = context.shape[1]
        rope = self._rope(torch.arange(t, device=context.device)[None], context.dtype)
        return t, [context] * len(self.layers), rope

    def forward_logits(self, *args, **kwargs) -> torch.Tensor:
        """`forward` then the borrowed lm_head: [N, K, B, vocab]."""
        return self.logits(self(*args, **kwargs))

    @torch.no_grad()
    def extend_context(self, cache: ContextCache, features: torch.Tensor) -> None:
        """Live decoding: append target features of the next committed positions
        ([N, t, n, H]) to the cache, at positions cache.length .. cache.length+t-1."""
        ctx = self.project_context(features)
        positions = torch.arange(cache.length, cache.length + ctx.shape[1], device=ctx.device)
        rope = self._rope(positions[None], ctx.dtype)
        kvs = [layer.self_attn.keys_values(ctx, rope) for layer in self.layers]
        if cache.length:
            kvs = [(torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2))
                   for k0, v0, (k, v) in zip(cache.keys, cache.values, kvs, strict=True)]
        cache.keys, cache.values = [k for k, _ in kvs], [v for _, v in kvs]
        cache.length += ctx.shape[1]

    @torch.no_grad()
    def draft_block(self, cache: ContextCache, block_ids: torch.Tensor) -> torch.Tensor:
        """Live decoding: hidden states [N, B, H] of one block anchored at cache.length."""
        anchors = torch.full((block_ids.shape[0], 1), cache.length, device=block_ids.device)
        # Dense: one block per row over a short cache is cheap, and it is the reference.
        return self.decode_blocks(cache, None, block_ids[:, None], anchors, "dense")[:, 0]


def check_draft_ids(ids: torch.Tensor, config: DrafterConfig) -> torch.Tensor:
    """`ids` as a drafter's draft vocabulary: long [draft_vocab_size], distinct target ids."""
    want = config.draft_vocab_size
    if want is None:
        raise DrafterError("this drafter has no draft vocabulary (draft_vocab_size unset)")
    ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dim() != 1 or ids.numel() != want:
        raise DrafterError(f"a draft vocabulary is {want} integer target ids; got "
                           f"{tuple(ids.shape)} {ids.dtype}")
    ids = ids.long()
    outside = ids[(ids < 0) | (ids >= config.vocab_size)]
    if outside.numel():
        raise DrafterError(f"draft vocabulary id {int(outside[0])} is outside the target's "
                           f"vocabulary of {config.vocab_size}")
    if torch.unique(ids).numel() != ids.numel():
        raise DrafterError("the draft vocabulary names a target id twice")
    return ids


def dflash2_from(model: DFlashDrafter, **fields) -> DFlashDrafter:
    """A DFlash 2 drafter (DrafterConfig `fields` set, kind dflash2) whose backbone is a copy
    of DFlash drafter `model`'s weights and whose additions are at their identity init: it
    computes what `model` computes and its walk picks `model`'s argmax (a warm start)."""
    if model.config.kind != "dflash":
        raise DrafterError(f"a warm start takes a DFlash drafter, got kind {model.config.kind}")
    config = dataclasses.replace(model.config, **{**fields, "kind": "dflash2"})
    out = DFlashDrafter(config).to(model.fc.weight.dtype)
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    added = [k for k in missing if ".attention_conv." not in k and ".mlp_conv." not in k
             and not k.startswith("candidate_selector.")]
    if added or unexpected:  # cannot happen for two drafters of one backbone
        raise DrafterError(f"warm start: backbone weights differ ({added + unexpected})")
    if model.target_embed_tokens is not None:
        out.attach_target_head(model.target_embed_tokens, model.target_lm_head)
    return out


class _Recomputed(torch.autograd.Function):
    """run(context) with no graph in forward; backward runs it again to differentiate it
    with respect to the context and the given parameters (their grads flow on to their
    AccumulateGrad nodes, where DDP's hooks are)."""

    @staticmethod
    def forward(ctx, run, context, *params):
        ctx.run = run
        device = context.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device),
                        torch.is_autocast_enabled(device))
        ctx.save_for_backward(context, *params)
        return run(context)

    @staticmethod
    def backward(ctx, grad):
        context, *params = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            context = context.detach().requires_grad_(ctx.needs_input_grad[1])
            out = ctx.run(context)
        wanted = [t for t, needed in zip([context, *params], ctx.needs_input_grad[1:],
                                         strict=True) if needed]
        got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return None, *(next(got) if needed else None for needed in ctx.needs_input_grad[1:])


def chunk_shape(n: int, k: int, most_blocks: int | None) -> tuple[int, int]:
    """(sequences, blocks per sequence) of one chunk of an [n, k] forward that runs at most
    `most_blocks` blocks at once: all sequences, fewer of their blocks; one block of fewer
    sequences when even that is too many."""
    if most_blocks is None or n * k <= most_blocks:
        return n, k
    cols = max(1, most_blocks // n)
    return min(n, max(1, most_blocks // cols)), cols


def _cat_keys(context_kv: KeysValues, block_kv: KeysValues) -> KeysValues:
    """Keys and values in the key order of masks.py: [context | block_0 | ... | block_K-1]."""
    return (torch.cat([context_kv[0], block_kv[0]], dim=2),
            torch.cat([context_kv[1], block_kv[1]], dim=2))


def _dense_attend(layout: BlockLayout, causal: bool, window: int | None) -> Attend:
    """One SDPA over the context and every block's keys under the dense mask (the reference
    every other path is tested against)."""
    mask = dense_mask(layout, causal, window)

    def attend(q, context_kv, block_kv):
        k, v = _cat_keys(context_kv, block_kv)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return attend


def _split_attend(layout: BlockLayout, causal: bool, window: int | None) -> Attend:
    """The dense result without its masked work: each slot is scored against the context
    keys some query of the batch may see and its own block's B keys only. The dense path
    also scores every other block's keys, [K*B, K*B] per head, all of them masked."""
    n, k = layout.anchors.shape
    b = layout.block_size
    start, stop = context_span(layout, window)
    hide_ctx = ~context_mask(layout, causal, window, (start, stop))[:, None, None]
    hide_own = ~own_block_mask(layout, causal, window)[:, None, None]

    def attend(q, context_kv, block_kv):
        kv_heads, d = context_kv[0].shape[1], q.shape[-1]
        q = q.view(n, kv_heads, -1, k, b, d)  # grouped-query heads as [kv heads, group]
        kc, vc = (t[:, :, start:stop] for t in context_kv)
        kb, vb = (t.view(n, kv_heads, 1, k, b, d) for t in block_kv)
        out = split_attention(q, kc, vc, kb, vb, hide_ctx, hide_own)
        return out.flatten(1, 2).flatten(2, 3)

    return attend


def _flex_attend(layout: BlockLayout, causal: bool, window: int | None) -> Attend:
    block_mask = flex_block_mask(layout, causal, window)
    run = flex_attention
    if layout.anchors.device.type == "cuda":
        # Eager flex materialises the full score matrix; only the compiled kernel is fused.
        global _compiled_flex
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        run = _compiled_flex

    def attend(q, context_kv, block_kv):
        k, v = _cat_keys(context_kv, block_kv)
        return run(q, k, v, block_mask=block_mask, enable_gqa=True)

    return attend


_ATTENDS: dict[str, Callable[[BlockLayout, bool, int | None], Attend]] = {
    "dense": _dense_attend, "split": _split_attend, "flex": _flex_attend,
}
