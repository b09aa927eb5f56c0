"""The tokenizer kept inside the store (written by extract), for decoding shown blocks.

Never encodes anything that feeds a metric: eval works on stored token ids only.
"""

import tempfile
from pathlib import Path

from dflash.store_schema import Store, StoreError


def store_tokenizer(store: Store):
    """The store's tokenizer, or None when the store holds no tokenizer files."""
    try:
        files = store.read_files("tokenizer")
    except StoreError:
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)
