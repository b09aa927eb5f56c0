"""The buffered generation cache: transformers' generate computes with it, bit for bit, what
it computes with its own DynamicCache (the same keys and values in the same order), on the
attention-only and the hybrid tiny targets; extract's generation uses it; it refuses to
overflow, crops as transformers' own layer does, and gives way to a cache implementation
the model's generation config names."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from dflash_train.assets.tiny import save_qwen3, save_qwen3_5
from dflash_train.target_model import generation
from dflash_train.target_model.generation import continuations, left_padded
from dflash_train.target_model.kv_buffer import BufferedLayer, buffered_cache
from dflash_train.target_model.loading import load_target

PROMPTS = [[5, 9, 12, 40, 41], [7, 8], [30, 31, 32, 33, 34, 35, 36], [60, 2, 61], [90]]
NEW = 12


@pytest.fixture(scope="module", params=["attention", "hybrid"])
def model(request, tmp_path_factory):
    save = save_qwen3 if request.param == "attention" else save_qwen3_5
    path = save(tmp_path_factory.mktemp(request.param))
    return load_target(path, device="cpu", dtype=torch.float32, load_as="causal-lm",
                       progress=False).model


def _logits(model, cache, do_sample: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids, mask, _ = left_padded(PROMPTS, 0)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                         do_sample=do_sample, temperature=1.0 if do_sample else None,
                         top_p=None, top_k=None, pad_token_id=0, eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True, cache=cache)
    return out.sequences, list(out.logits)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_generate_computes_the_same_logits_as_with_its_own_cache(model, do_sample):
    width = max(map(len, PROMPTS))
    cache = buffered_cache(model, width + NEW)
    assert any(isinstance(layer, BufferedLayer) for layer in cache.layers)
    want_ids, want = _logits(model, None, do_sample)
    got_ids, got = _logits(model, cache, do_sample)
    # generate fed the prompt and every new token but the last through the buffers
    assert {layer.filled for layer in cache.layers if isinstance(layer, BufferedLayer)} == {
        width + NEW - 1}
    assert torch.equal(got_ids, want_ids)
    assert len(got) == len(want) == NEW
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_continuations_generate_through_the_buffer(model, monkeypatch):
    made = []

    def spy(model, capacity):
        made.append(buffered_cache(model, capacity))
        return made[-1]

    monkeypatch.setattr(generation, "buffered_cache", spy)
    answers = continuations(model, PROMPTS, max_new_tokens=NEW, eos_ids=[], pad_id=0)
    assert [len(a) for a in answers] == [NEW] * len(PROMPTS)
    layers = [layer for layer in made[0].layers if isinstance(layer, BufferedLayer)]
    # the prompt and every new token but the last were fed
    assert layers and {layer.filled for layer in layers} == {max(map(len, PROMPTS)) + NEW - 1}


def test_it_refuses_to_overflow_and_crops_as_dynamic_layer_does():
    layer, plain = BufferedLayer(capacity=3), DynamicLayer()
    kv = torch.arange(16.0).reshape(1, 2, 2, 4)
    for cache in (layer, plain):
        cache.update(kv, kv)
        cache.crop(0)
        cache.crop(-1)
        cache.update(kv[:, :, :1] + 100, kv[:, :, :1] + 100)
    assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)
    with pytest.raises(RuntimeError, match="3 it was sized for"):
        layer.update(kv, kv)
    with pytest.raises(ValueError):
        layer.crop(1)
    with pytest.raises(NotImplementedError, match="no beams"):
        layer.reorder_cache(torch.tensor([0]))


def test_a_model_asking_for_its_own_cache_implementation_gets_it(model, monkeypatch):
    monkeypatch.setattr(model.generation_config, "cache_implementation", "static")
    assert buffered_cache(model, 8) is None
