"""Chunked top-k / log-sum-exp equal the full-vocab computation."""

import torch
from torch import nn

from dflash_train.target_model.verifier import verifier_topk


def test_chunked_topk_and_lse_equal_full_vocab():
    torch.manual_seed(0)
    head = nn.Linear(32, 1000, bias=False)
    h = torch.randn(37, 32)
    ids, logits, lse = verifier_topk(h, head, 8, vocab_chunk=96, token_chunk=10)
    full = head(h)
    ref = full.topk(8)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref.indices)
    assert torch.equal(ids[:, 0].long(), full.argmax(-1))
    torch.testing.assert_close(logits, ref.values)
    torch.testing.assert_close(lse, full.logsumexp(-1))


def test_equal_logits_rank_the_lower_id_first_like_argmax():
    head = nn.Linear(4, 10, bias=False)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[3] = 1.0
        head.weight[7] = 1.0
    ids, _, _ = verifier_topk(torch.ones(1, 4), head, 2, vocab_chunk=4)
    assert ids.tolist() == [[3, 7]]
