"""benchmarks/roofline_decode.py: the live round's FLOP formula against a counted cached
forward, and the drafter bytes it charges against what a draft reads."""

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from benchmarks.roofline_decode import _drafter_weights, verify_flops
from benchmarks.roofline_parts import CountedFlops
from dflash_train.evaluate.drafting import BlockDrafter
from tests.evaluate.conftest import random_drafter


def test_verify_flops_equal_the_count_of_a_block_forward_over_a_cache_and_one_head_row():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300,
                         num_hidden_layers=3, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model.model(input_ids=torch.randint(0, 300, (1, 20)), cache=cache,
                    use_cache=True)
        with CountedFlops() as counted:
            out = model.model(input_ids=torch.randint(0, 300, (1, 16)), cache=cache,
                              use_cache=True)
            model.lm_head(out.last_hidden_state[:, :1])
    assert sum(counted.by_dtype.values()) == verify_flops(model, 16, 20)


def _with_head(model):
    vocab = model.config.vocab_size
    model.attach_target_head(torch.randn(vocab, 64), torch.randn(vocab, 64))
    return model


def test_a_draft_is_charged_the_drafters_weights_but_not_the_targets_tables():
    model = _with_head(random_drafter(seed=0))
    own = sum(p.nbytes for p in model.parameters())
    others = sum(b.nbytes for n, b in model.named_buffers() if not n.startswith("target_"))
    # no draft vocabulary: the target's whole head is read, its embedding by rows
    assert _drafter_weights(BlockDrafter(model)) == own + others + model.target_lm_head.nbytes


def test_a_draft_over_a_draft_vocabulary_reads_its_rows_not_the_targets_head():
    model = random_drafter(seed=0, draft_vocab_size=8)
    model.set_draft_vocab(torch.arange(8) * 3)
    _with_head(model)
    own = sum(p.nbytes for p in model.parameters())
    want = own + model.draft_lm_head.nbytes + model.draft_ids.nbytes
    assert model.draft_lm_head.shape == (8, 64)
    assert _drafter_weights(BlockDrafter(model)) == want
