"""benchmarks/target_layer_init.py copies exactly the target layers it names."""

import pytest
import torch

from benchmarks.target_layer_init import copy_target_layers
from dflash_train.drafter import DFlashDrafter
from dflash_train.drafter.config import DrafterConfig

LLAMA_LAYER = {  # a Llama decoder layer's tensors at the tiny drafter's shape (no q/k norm)
    "self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
    "self_attn.v_proj.weight": (16, 32), "self_attn.o_proj.weight": (32, 32),
    "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
    "mlp.down_proj.weight": (32, 64), "input_layernorm.weight": (32,),
    "post_attention_layernorm.weight": (32,)}


def tiny_drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(
        hidden_size=32, vocab_size=50, intermediate_size=64, target_layer_ids=[0, 1],
        num_target_layers=6, mask_token_id=49, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, block_size=4))


def llama_weights(layers: int) -> dict[str, torch.Tensor]:
    weights = {f"model.layers.{i}.{name}": torch.randn(shape)
               for i in range(layers) for name, shape in LLAMA_LAYER.items()}
    return {**weights, "model.norm.weight": torch.randn(32)}


def test_drafter_layer_i_is_target_layer_first_plus_i_and_the_rest_stays_seeded():
    model, weights = tiny_drafter(), llama_weights(6)
    seeded = {k: v.clone() for k, v in model.state_dict().items()}
    kept = copy_target_layers(model, weights, 3, final_norm=False)
    state = model.state_dict()
    for i in range(2):
        for name in LLAMA_LAYER:
            assert torch.equal(state[f"layers.{i}.{name}"], weights[f"model.layers.{3 + i}.{name}"])
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight",
                 "layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"):
        assert torch.equal(state[name], seeded[name]) and name in kept
    copy_target_layers(model, weights, 3, final_norm=True)
    assert torch.equal(model.state_dict()["norm.weight"], weights["model.norm.weight"])


def test_a_target_of_another_width_is_refused_by_name():
    weights = llama_weights(2)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.randn(48, 32)
    with pytest.raises(SystemExit, match=r"model.layers.1.mlp.up_proj.weight is \(48, 32\)"):
        copy_target_layers(tiny_drafter(), weights, 0, final_norm=False)
