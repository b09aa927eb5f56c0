"""DrafterConfig: the layer-id formula, target-derived defaults, the published 27B shape."""

from dataclasses import replace

import pytest

from dflash_train.drafter import DrafterConfig, DrafterError, default_target_layer_ids

from .conftest import tiny_config


def test_default_layer_ids_match_reference_examples():
    # docs/reference.md §2: Qwen3.5/3.6-27B (64 layers) and Qwen3-8B (36 layers), n = 5.
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_default_layer_ids_follow_the_formula_for_many_shapes():
    for layers in range(8, 100):
        for n in range(2, 7):
            want = [round(1 + i * (layers - 4) / (n - 1)) for i in range(n)]
            assert default_target_layer_ids(layers, n) == want
        assert default_target_layer_ids(layers, 1) == [layers // 2]


def test_default_layer_ids_round_ties_like_zlab():
    # L = 7, n = 5: 1 + 3i/4 hits 2.5 at i = 2; z-lab's round() gives 2, not 3.
    assert default_target_layer_ids(7, 5) == [1, 2, 2, 3, 4]


def test_for_target_copies_width_vocab_and_uses_formula():
    target = {"hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 151936,
              "num_hidden_layers": 36, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 40960}
    cfg = DrafterConfig.for_target(target, mask_token_id=151669)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (4096, 12288, 151936)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert cfg.num_target_layers == 36
    assert cfg.rope_theta == 1e6
    assert cfg.layer_types == ["full_attention"] * 5
    assert cfg.block_size == 16


def test_for_target_reads_text_config_and_rope_parameters():
    # Qwen3.5/3.6 multimodal configs nest the text model and its RoPE base.
    target = {"text_config": {"hidden_size": 5120, "intermediate_size": 17408,
                              "vocab_size": 248320, "num_hidden_layers": 64,
                              "rope_parameters": {"rope_theta": 10000000}}}
    cfg = DrafterConfig.for_target(target, mask_token_id=248070,
                                   layer_types=["sliding_attention"] * 4 + ["full_attention"],
                                   sliding_window=2048)
    # The target dict gives no max_position_embeddings; everything else is the preset.
    preset = DrafterConfig.qwen3_6_27b()
    assert replace(cfg, max_position_embeddings=preset.max_position_embeddings) == preset


def test_qwen3_6_27b_preset_is_the_published_shape():
    cfg = DrafterConfig.qwen3_6_27b()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (5120, 32, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.rope_theta) == (128, 17408, 1e7)
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg.sliding_window == 2048
    assert cfg.mask_token_id == 248070
    assert cfg.target_layer_ids == [1, 16, 31, 46, 61]
    assert [cfg.layer_is_causal(i) for i in range(5)] == [True] * 4 + [False]


def test_is_causal_overrides_every_layer():
    cfg = tiny_config(is_causal=False)
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, False]
    cfg = tiny_config(is_causal=True)
    assert [cfg.layer_is_causal(i) for i in range(2)] == [True, True]


@pytest.mark.parametrize("field, value, words", [
    ("layer_types", ["full_attention"], "layer_types has 1"),
    ("sliding_window", None, "sliding_window"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("target_layer_ids", [1, 8], "target_layer_ids [8]"),
    ("mask_token_id", 100, "mask_token_id"),
    ("block_size", 1, "block_size"),
])
def test_invalid_config_names_the_field(field, value, words):
    with pytest.raises(DrafterError, match=words.replace("[", r"\[").replace("]", r"\]")):
        tiny_config(**{field: value})


def test_describe_names_the_layer_mix_and_heads():
    line = DrafterConfig.qwen3_6_27b().describe()
    assert line.startswith("5 layers (4 sliding (window 2048) + 1 full), 32 query / 8 kv heads")
    assert "target layers [1, 16, 31, 46, 61]" in line
