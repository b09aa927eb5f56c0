"""The one StoreMeta builder of the tests: a fixture names only the fields its test is about.

Every other field gets a fixed filler (a made-up hash, a "synthetic" source), so a new field
of StoreMeta or one of its parts is added here once instead of in every fixture.
"""

from dataclasses import replace

import torch

from dflash_train.store_schema import CreatedWith, SourceInfo, StoreMeta, TargetInfo, TokenizerInfo


def store_meta(*, target: dict | None = None, tokenizer: dict | None = None,
               source: dict | None = None, created_with: dict | None = None,
               **fields) -> StoreMeta:
    """A valid StoreMeta; `target`, `tokenizer`, `source` and `created_with` override fields of
    those parts, the other keywords fields of StoreMeta itself (context_layer_ids, top_k, ...)."""
    parts = {
        "target": TargetInfo(name_or_path="tiny", revision=None, model_type="qwen3_5",
                             num_hidden_layers=8, hidden_size=16, vocab_size=97,
                             config_sha256="0" * 64),
        "tokenizer": TokenizerInfo(sha256="1" * 64, chat_template_sha256=None,
                                   enable_thinking=False),
        "source": SourceInfo(paths=["x.jsonl"], sha256=["2" * 64], max_length=4096,
                             regenerated=False, num_rows=1000),
        "created_with": CreatedWith(dflash="test", torch=torch.__version__, transformers="-",
                                    device="cpu", kernels="torch"),
    }
    overrides = {"target": target, "tokenizer": tokenizer, "source": source,
                 "created_with": created_with}
    for name, changed in overrides.items():
        parts[name] = replace(parts[name], **(changed or {}))
    return StoreMeta(**parts, **({"context_layer_ids": [1, 3, 5], "top_k": 4,
                                  "hidden_dtype": "bfloat16", "num_parts": 2} | fields))
