"""benchmarks/peer/convert.py: a speculators DFlash checkpoint becomes a drafter directory our
loader reads, with the same weights and our layer numbering. The checkpoint is written here
the way speculators 0.9.0 saves one (config layout copied from a real save), no speculators."""

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.peer.convert import convert
from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.model import DFlashDrafter

HIDDEN, VOCAB = 32, 64


def speculators_config(**changes) -> dict:
    layer = {"model_type": "qwen3", "hidden_size": HIDDEN, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
             "layer_types": ["full_attention", "full_attention"], "sliding_window": None,
             "vocab_size": VOCAB, "attention_bias": False, "hidden_act": "silu",
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    raw = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
           "aux_hidden_state_layer_ids": [2, 3], "block_size": 16, "draft_vocab_size": VOCAB,
           "mask_token_id": 63, "sample_from_anchor": False,
           "sliding_window_non_causal": False, "transformer_layer_config": layer}
    for key, value in changes.items():
        (layer if key in layer else raw)[key] = value
    return raw


def write_checkpoint(directory, raw: dict) -> dict[str, torch.Tensor]:
    """A speculators-style checkpoint of a random drafter; returns its bf16 weights."""
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=HIDDEN, vocab_size=VOCAB, intermediate_size=64,
                           target_layer_ids=[1, 2], num_target_layers=None, mask_token_id=63,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, rope_theta=10000.0)
    weights = {k: v.to(torch.bfloat16).contiguous()
               for k, v in DFlashDrafter(config).state_dict().items()}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return weights


def test_a_speculators_checkpoint_loads_as_our_drafter_with_its_weights(tmp_path):
    weights = write_checkpoint(tmp_path / "spec", speculators_config())
    with pytest.raises(DrafterError):  # the reason the conversion exists
        load_drafter(tmp_path / "spec")
    convert(tmp_path / "spec", tmp_path / "ours", num_target_layers=6)
    model = load_drafter(tmp_path / "ours")
    assert model.config.target_layer_ids == [1, 2]  # speculators' ids minus one
    assert model.config.num_target_layers == 6
    assert model.config.mask_token_id == 63 and model.config.block_size == 16
    assert model.config.layer_types == ["full_attention", "full_attention"]
    assert model.config.rope_theta == 10000.0
    state = model.state_dict()
    assert set(state) == set(weights)
    assert all(state[k].dtype == torch.bfloat16 and torch.equal(state[k], v)
               for k, v in weights.items())


@pytest.mark.parametrize("change, message", [
    ({"sample_from_anchor": True}, "sample_from_anchor"),
    ({"draft_vocab_size": 32}, "reduced draft vocabulary"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
     "sliding-window layers"),
])
def test_checkpoints_our_forward_would_compute_differently_are_refused(tmp_path, change,
                                                                       message):
    write_checkpoint(tmp_path / "spec", speculators_config(**change))
    with pytest.raises(DrafterError, match=message):
        convert(tmp_path / "spec", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_weights_of_another_shape_are_refused(tmp_path):
    write_checkpoint(tmp_path / "spec", speculators_config(intermediate_size=48))
    with pytest.raises(DrafterError, match=r"model.safetensors: size mismatch for "
                                           r"layers\.\d\.mlp"):
        convert(tmp_path / "spec", tmp_path / "ours")
