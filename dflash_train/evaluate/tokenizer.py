"""The tokenizer kept inside the store (written by extract), for decoding shown blocks.

Never encodes anything that feeds a metric: eval works on stored token ids only.
"""

import tempfile
from pathlib import Path

from dflash_train.store_schema import Store
from dflash_train.store_schema.layout import FILES_GROUP


def store_tokenizer(store: Store):
    """The store's tokenizer, or None when the store holds no tokenizer files; a damaged one
    is a StoreError naming the file (not silently no decoded text)."""
    if not any(p.startswith(f"{FILES_GROUP}/tokenizer/") for p in store.frozen_paths()):
        return None
    files = store.read_files("tokenizer")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)
