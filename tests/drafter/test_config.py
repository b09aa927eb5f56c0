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


def test_default_mask_token_prefers_tokenizer_then_published_then_a_spare_row_or_token():
    from dflash_train.drafter.config import default_mask_token_id

    # the tokenizer's own mask token wins, then the published id for the model type
    assert default_mask_token_id("qwen3", 151936, 7, tokenizer_size=151669) == 7
    assert default_mask_token_id("qwen3", 151936, None, tokenizer_size=151669) == 151669
    # any other padded vocabulary: the first row past the tokenizer (z-lab's added token)
    assert default_mask_token_id("mistral", 32768, None, tokenizer_size=32000) == 32000
    # no spare row (SmolLM2, Llama 3): the last special token no chat renders
    assert default_mask_token_id("llama", 49152, None, tokenizer_size=49152,
                                 spare_special_ids=[3, 9, 16]) == 16
    # spare ids past the model's rows are not tokens it can embed
    assert default_mask_token_id("llama", 100, None, tokenizer_size=101,
                                 spare_special_ids=[5, 100]) == 5
    assert default_mask_token_id("llama", 100, None, tokenizer_size=100) is None


def test_a_llama_target_lends_its_grouped_query_heads_to_the_drafter():
    from dflash_train.train.config import ModelConfig
    from dflash_train.train.drafter_shape import shape_drafter

    smollm2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
               "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
               "max_position_embeddings": 8192, "tie_word_embeddings": True}
    cfg = shape_drafter(smollm2, 16, [1, 7, 14, 20, 27], ModelConfig())
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (576, 1536, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.layer_types == ["full_attention"] * cfg.num_hidden_layers
    assert cfg.num_target_layers == 30 and cfg.mask_token_id == 16
