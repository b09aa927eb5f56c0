"""What extract leaves for train and eval: the target's config and the mask token id."""

import json
from pathlib import Path

import pytest
from conftest import VOCAB_SIZE, run_extract_cfg

from dflash_train.extract.errors import ExtractError
from dflash_train.store_schema import open_store


def test_store_carries_the_target_config_and_mask_token(qwen3_dir, chats_jsonl, tmp_path):
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, chats_jsonl, out, mask_token_id=333)
    store = open_store(out)
    config = json.loads(store.read_files("target")["config.json"])
    expected = json.loads((Path(qwen3_dir) / "config.json").read_text())
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
        assert config[key] == expected[key], key
    assert store.meta.extra["mask_token_id"] == 333


def test_mask_token_outside_the_vocabulary_is_refused(qwen3_dir, chats_jsonl, tmp_path):
    with pytest.raises(ExtractError, match=f"outside the target vocabulary \\(size {VOCAB_SIZE}"):
        run_extract_cfg(qwen3_dir, chats_jsonl, str(tmp_path / "hs.zarr"),
                        mask_token_id=VOCAB_SIZE)
    assert not (tmp_path / "hs.zarr").exists()


@pytest.mark.parametrize("regenerate", [False, True], ids=["forward", "kept-in-generation"])
def test_buffered_samples_do_not_hold_their_batch(regenerate, qwen3_dir, chats_jsonl, tmp_path,
                                                  monkeypatch):
    from dflash_train.extract.writer import BackgroundWriter

    seen = []
    append = BackgroundWriter.append

    def spy(self, writer, samples):
        seen.extend(samples)
        append(self, writer, samples)

    monkeypatch.setattr(BackgroundWriter, "append", spy)
    run_extract_cfg(qwen3_dir, chats_jsonl, str(tmp_path / "hs.zarr"), batch_tokens=400,
                    **({"regenerate": True, "max_new_tokens": 6} if regenerate else {}))
    assert len(seen) == 14
    for s in seen:  # each sample owns exactly its own bytes, not a slice of a padded batch
        assert s.context.untyped_storage().nbytes() == s.context.numel() * s.context.element_size()
