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


def topk_of_logits(logits: torch.Tensor, k: int, *, vocab_chunk: int = VOCAB_CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verifier_topk's three for logits already computed [N, V] (generate's, for example),
    ties ordered the same way."""
    best = _empty_topk(logits.shape[0], logits.device)
    for v0 in range(0, logits.shape[-1], vocab_chunk):
        best = _merged(best, logits[:, v0:v0 + vocab_chunk].float(), v0, k)
    ids, values, lse = best
    return ids.to(torch.int32), values, lse


def _topk_one(h: torch.Tensor, lm_head: nn.Linear, k: int, vocab_chunk: int):
    weight, bias = lm_head.weight, lm_head.bias
    best = _empty_topk(h.shape[0], h.device)
    for v0 in range(0, weight.shape[0], vocab_chunk):
        w = weight[v0:v0 + vocab_chunk]
        b = None if bias is None else bias[v0:v0 + vocab_chunk]
        best = _merged(best, nn.functional.linear(h, w, b).float(), v0, k)
    return best


def _empty_topk(rows: int, device: torch.device):
    return (torch.zeros((rows, 0), dtype=torch.long, device=device),
            torch.full((rows, 0), float("-inf"), device=device),
            torch.full((rows,), float("-inf"), device=device))


def _merged(best, chunk: torch.Tensor, v0: int, k: int):
    """The running (top-k ids, values, lse) with the logits of vocab rows v0.. merged in."""
    best_i, best_v, lse = best
    lse = torch.logaddexp(lse, torch.logsumexp(chunk, dim=-1))
    cv, ci = chunk.topk(min(k, chunk.shape[-1]), dim=-1)
    # topk orders ties arbitrarily; argmax takes the lowest id. Order each chunk's picks by
    # id, put earlier chunks (lower ids) first, then a stable sort by value keeps ties in
    # id order
    by_id = ci.argsort(dim=-1)
    merged_v = torch.cat([best_v, cv.gather(-1, by_id)], dim=-1)
    merged_i = torch.cat([best_i, ci.gather(-1, by_id) + v0], dim=-1)
    top_v, pos = merged_v.sort(dim=-1, descending=True, stable=True)
    return merged_i.gather(-1, pos[:, :k]), top_v[:, :k], lse
