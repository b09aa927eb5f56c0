"""The verifier's top-k next-token logits and log-sum-exp, in vocab chunks; a few rows' full
logits (`head_logits`) for a sampled draw.

Owns the logits = lm_head(final_norm(last layer)) computation. The full [tokens, vocab]
logits are never materialised: at a 248K vocab they would dwarf the hidden states, so the
vocab is walked in chunks keeping a running top-k and a running log-sum-exp. Logits are
computed in the model's dtype (as the target computes them when serving) and reduced in fp32.
"""

import torch
from torch import nn

VOCAB_CHUNK = 32768
"""Vocab rows per lm_head chunk."""
TOKEN_CHUNK = 4096
"""Tokens per chunk: with VOCAB_CHUNK bounds one fp32 logits block to 512 MiB."""


def verifier_topk(hidden: torch.Tensor, lm_head: nn.Linear, k: int, *,
                  vocab_chunk: int = VOCAB_CHUNK, token_chunk: int = TOKEN_CHUNK
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids (int32, argmax first), their logits (fp32) and lse (fp32) for [N, H] states."""
    ids, logits, lse = [], [], []
    for t0 in range(0, hidden.shape[0], token_chunk):
        i, v, s = _topk_one(hidden[t0:t0 + token_chunk], lm_head, k, vocab_chunk)
        ids.append(i)
        logits.append(v)
        lse.append(s)
    return torch.cat(ids).to(torch.int32), torch.cat(logits), torch.cat(lse)


def head_logits(hidden: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
    """Full logits float32 [N, V] of a few states [N, H]: what a draw at T > 0 needs (the
    keyed Gumbel-max reads every token's logit). Computed in the model's dtype and then
    widened, as generate hands them to its logits processors; for the rows asked only."""
    return nn.functional.linear(hidden, lm_head.weight, lm_head.bias).float()


def _topk_one(h: torch.Tensor, lm_head: nn.Linear, k: int, vocab_chunk: int):
    weight, bias = lm_head.weight, lm_head.bias
    vocab = weight.shape[0]
    best_v = torch.full((h.shape[0], 0), float("-inf"), device=h.device)
    best_i = torch.zeros((h.shape[0], 0), dtype=torch.long, device=h.device)
    lse = torch.full((h.shape[0],), float("-inf"), device=h.device)
    for v0 in range(0, vocab, vocab_chunk):
        w = weight[v0:v0 + vocab_chunk]
        b = None if bias is None else bias[v0:v0 + vocab_chunk]
        chunk = nn.functional.linear(h, w, b).float()
        lse = torch.logaddexp(lse, torch.logsumexp(chunk, dim=-1))
        cv, ci = chunk.topk(min(k, chunk.shape[-1]), dim=-1)
        # topk orders ties arbitrarily; argmax takes the lowest id. Order each chunk's picks by
        # id, put earlier chunks (lower ids) first, then a stable sort by value keeps ties in
        # id order
        by_id = ci.argsort(dim=-1)
        merged_v = torch.cat([best_v, cv.gather(-1, by_id)], dim=-1)
        merged_i = torch.cat([best_i, ci.gather(-1, by_id) + v0], dim=-1)
        top_v, pos = merged_v.sort(dim=-1, descending=True, stable=True)
        best_v, best_i = top_v[:, :k], merged_i.gather(-1, pos[:, :k])
    return best_i, best_v, lse
