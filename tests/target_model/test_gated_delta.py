"""Gated DeltaNet over a tree: each node computes what the layer computes over its root path."""

import torch
from transformers import DynamicCache, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from dflash_train.target_model.gated_delta import is_gated_delta_layer, tree_forward, window_rows


def test_window_rows_follow_the_ancestors_then_the_cached_inputs():
    # 3 cached inputs (rows 0..2), then nodes 0..4 at rows 3..7; tree 0 -> 1 -> 3, 0 -> 2 -> 4
    rows = window_rows([-1, 0, 0, 1, 2], kernel=4, cached=3).tolist()
    assert rows == [[0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5], [2, 3, 4, 6], [2, 3, 5, 7]]


def layer_and_cache(prefix: int, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8,
                               linear_conv_kernel_dim=4, num_hidden_layers=1,
                               layer_types=["linear_attention"])
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # A_log and dt_bias as a trained layer has them, not all alike
        layer.dt_bias.normal_()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        layer(torch.randn(1, prefix, 32), cache=cache)
    return layer, cache


def test_tree_forward_equals_the_layer_over_each_root_path():
    layer, cache = layer_and_cache(prefix=5)
    assert is_gated_delta_layer(layer)
    parents = [-1, 0, 0, 1, 1, 2, 4, 6]
    hidden = torch.randn(1, len(parents), 32)
    conv = cache.layers[0].conv_states[0].clone()
    state = cache.layers[0].recurrent_states[0].clone()
    out = tree_forward(layer, hidden, parents, conv, state)
    assert torch.equal(cache.layers[0].conv_states[0], conv), "the cache is only read"
    for node in range(len(parents)):
        path, n = [], node
        while n >= 0:
            path.append(n)
            n = parents[n]
        path = path[::-1]
        cache.layers[0].conv_states[0].copy_(conv)
        cache.layers[0].recurrent_states[0].copy_(state)
        with torch.no_grad():
            want = layer(hidden[:, path], cache=cache)[0, -1]
        assert torch.allclose(out[0, node], want, rtol=1e-5, atol=1e-6), node
