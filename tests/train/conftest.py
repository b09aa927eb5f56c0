"""A small synthetic store whose verifier follows a learnable rule, for the train tests.

Tokens follow x[t+1] = (5 x[t] + 3) mod V, the verifier's argmax at t is x[t+1], and the
context features at t are a fixed random code of x[t]. A drafter that learns the rule predicts
every slot of a block from its anchor token alone.
"""

import json

import pytest
import torch

from dflash_train.store_schema import Sample, create_store
from tests.store_factory import store_meta

VOCAB, HIDDEN, LAYERS, TOP_K, MASK = 64, 32, 2, 4, 63


def next_token(x: torch.Tensor) -> torch.Tensor:
    return (5 * x + 3) % (VOCAB - 1)  # never produces MASK


def build_store(url: str, rows: int = 24, parts: int = 2, seed: int = 0, name: str = "tiny",
                unfinished: int = 0, weights: str | None = None,
                tied_embedding: torch.Tensor | None = None, first_sample: int = 0):
    """`unfinished`: the last parts are written but never finished (extraction cut short);
    `weights`: the target's weights fingerprint (None: a store made before them);
    `tied_embedding`: [VOCAB, HIDDEN] rows the target uses as both its embedding and its
    lm_head (None: two random matrices);
    `first_sample`: where the sequences start (rows r of stores with different
    first_sample hold other token ids, up to 63 apart: a store of other prompts)."""
    meta = store_meta(
        target={"name_or_path": name, "model_type": "qwen3", "num_hidden_layers": 4,
                "hidden_size": HIDDEN, "vocab_size": VOCAB, "config_sha256": "c" * 64,
                "weights_sha256": weights},
        tokenizer={"sha256": "t" * 64},
        source={"paths": ["synthetic"], "sha256": ["s" * 64], "max_length": 256,
                "regenerated": True, "num_rows": rows},
        context_layer_ids=[1, 2], top_k=TOP_K, hidden_dtype="float32", num_parts=parts,
        extra={"mask_token_id": MASK},
    )
    store = create_store(url, meta, shard_tokens=64)
    gen = torch.Generator().manual_seed(seed)
    code = torch.randn(VOCAB, LAYERS, HIDDEN, generator=gen)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    if tied_embedding is not None:
        embed = head = tied_embedding
    store.write_target_rows(embed, head, torch.ones(HIDDEN))
    target_cfg = {"model_type": "qwen3", "hidden_size": HIDDEN, "vocab_size": VOCAB,
                  "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
                  "rope_theta": 10000.0}
    store.write_files("target", {"config.json": json.dumps(target_cfg).encode()})
    per_part = rows // parts
    for p in range(parts):
        writer = store.part_writer(p, p * per_part, (p + 1) * per_part)
        for row in range(p * per_part, (p + 1) * per_part):
            n = row + first_sample
            length = 20 + (n * 7) % 30
            x = torch.empty(length, dtype=torch.long)
            x[0] = n % (VOCAB - 1)
            for t in range(1, length):
                x[t] = next_token(x[t - 1])
            top1 = next_token(x)
            others = torch.stack([(top1 + j) % VOCAB for j in range(1, TOP_K)], 1)
            logits = torch.linspace(5.0, 1.0, TOP_K).expand(length, TOP_K).contiguous()
            mask = torch.ones(length, dtype=torch.bool)
            mask[:4] = False  # a "prompt"
            writer.append(Sample(
                input_ids=x.int(), loss_mask=mask, context=code[x],
                topk_ids=torch.cat([top1[:, None], others], 1).int(), topk_logits=logits,
                lse=torch.full((length,), 6.0), source_row=row))
        if p < parts - unfinished:
            writer.finish()
    return store


def smollm2_like_rows(seed: int = 0) -> torch.Tensor:
    """[VOCAB, HIDDEN] rows with SmolLM2-135M's embedding geometry: norm ~3.2, of which a
    direction shared by every row has norm 2.2 (drafter.model.FinalNormInit)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(HIDDEN, generator=gen)
    own = torch.randn(VOCAB, HIDDEN, generator=gen)
    return 2.2 * shared / shared.norm() + 2.3 * own / HIDDEN**0.5


@pytest.fixture(scope="session")
def synthetic_store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("synthetic") / "hs.zarr")
    build_store(url)
    return url
