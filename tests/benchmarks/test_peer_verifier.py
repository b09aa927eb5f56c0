"""benchmarks/peer/verifier.py: speculators' verifier directory from a store's frozen rows, with
the final norm's weight in the convention of the target's own norm class."""

import json

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.peer.verifier import EXPECTED_HEAD, write_verifier, zero_centred_norm
from dflash_train.assets.embedded import target_dir
from dflash_train.store_schema import StoreError, open_store
from tests.train.conftest import build_store


def test_norm_conventions_are_read_from_transformers_norm_classes():
    qwen35 = json.loads((target_dir() / "config.json").read_text())  # Qwen3.5: x * (1 + w)
    assert zero_centred_norm(qwen35)
    tiny = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "intermediate_size": 64, "vocab_size": 64}
    assert not zero_centred_norm(tiny)  # Qwen3: x * w
    assert not zero_centred_norm(dict(tiny, model_type="llama"))


def test_the_directory_holds_the_store_rows_config_and_the_weight_of_its_gain(tmp_path):
    url = str(tmp_path / "hs.zarr")
    build_store(url, rows=2, parts=1)  # a qwen3 target: the weight is the gain itself
    store = open_store(url, "r+")
    rows = store.target_rows()
    gain = torch.linspace(0.5, 2.0, rows["lm_head"].shape[1])
    store.write_target_rows(rows["embed_tokens"], rows["lm_head"], gain)
    out = write_verifier(store, tmp_path / "verifier")
    weights = load_file(str(out / "model.safetensors"))
    assert sorted(weights) == ["lm_head.weight", "model.embed_tokens.weight",
                               "model.norm.weight"]
    assert torch.equal(weights["lm_head.weight"], rows["lm_head"])
    assert torch.equal(weights["model.embed_tokens.weight"], rows["embed_tokens"])
    assert torch.equal(weights["model.norm.weight"], gain)
    assert json.loads((out / "config.json").read_text()) == \
        json.loads(store.read_files("target")["config.json"])
    expected = load_file(str(out / EXPECTED_HEAD))
    assert torch.equal(expected["final_norm"], gain)
    assert torch.equal(expected["lm_head"], rows["lm_head"].float())
    with pytest.raises(StoreError, match="already exists"):
        write_verifier(store, out)
