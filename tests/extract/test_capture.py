"""Stored states and verifier outputs equal an independent, unbatched forward of the target."""

import json

import pytest
import torch
from conftest import run_extract_cfg, save_qwen3, store_samples
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.extract.errors import ExtractError
from dflash_train.store_schema import open_store, validate


def _close(stored: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 rounding differs between a padded batch and a lone sequence (the hybrid's chunked
    # linear attention pads to other widths; in fp64 the two agree to 1e-14), so the bound is
    # relative to the tensor's scale; a wrong layer or a padding leak is off by O(scale)
    scale = ref.abs().max().item()
    torch.testing.assert_close(stored, ref, atol=2e-5 * scale, rtol=0)


def _independent(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_fixture", ["qwen3_dir", "qwen3_5_dir"])
def test_stored_context_and_top1_equal_an_unbatched_forward(model_fixture, chats_jsonl,
                                                            tmp_path, request):
    model_dir = request.getfixturevalue(model_fixture)
    out = str(tmp_path / "hs.zarr")
    # a small token budget: batches of 2-5 rows of different lengths, so padding is exercised
    run_extract_cfg(model_dir, chats_jsonl, out, layers="0,1,2", batch_tokens=96)
    samples = store_samples(out)
    assert len(samples) == sum(1 for line in open(chats_jsonl) if line.strip())
    model = _independent(model_dir)
    for s in samples:
        with torch.no_grad():
            ref = model(s.input_ids.long()[None], output_hidden_states=True)
        hs = [h[0] for h in ref.hidden_states]
        # id k is HF hidden_states[k + 1]
        for j, k in enumerate((0, 1, 2)):
            _close(s.context[:, j], hs[k + 1])
        logits = ref.logits[0].float()
        assert torch.equal(s.topk_ids[:, 0].long(), logits.argmax(-1))
        _close(s.topk_logits, logits.topk(s.topk_ids.shape[1]).values)
        _close(s.lse, logits.logsumexp(-1))
    assert validate(out) == []


def test_causal_lm_and_multimodal_wrapper_give_identical_stores(qwen3_5_dir, chats_jsonl,
                                                                tmp_path):
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    run_extract_cfg(qwen3_5_dir, chats_jsonl, a, load_as="causal-lm")
    run_extract_cfg(qwen3_5_dir, chats_jsonl, b, load_as="multimodal")
    sa, sb = store_samples(a), store_samples(b)
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa, sb, strict=True):
        for name in ("input_ids", "loss_mask", "context", "topk_ids", "topk_logits", "lse"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
    assert open_store(a).meta.mismatches(open_store(b).meta) == []


def test_store_carries_frozen_rows_tokenizer_and_provenance(qwen3_5_dir, chats_jsonl, tmp_path):
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_5_dir, chats_jsonl, out)
    store = open_store(out)
    model = _independent(qwen3_5_dir)
    rows = store.target_rows()
    assert torch.equal(rows["embed_tokens"], model.model.embed_tokens.weight)
    assert torch.equal(rows["lm_head"], model.lm_head.weight)
    # the stored norm is the effective scale: rms-normalised x times it is the final norm
    x = torch.randn(3, 64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    torch.testing.assert_close(ref * rows["final_norm"], model.model.norm(x))
    # the stored tokenizer alone reproduces the stored token ids
    for name, data in store.read_files("tokenizer").items():
        (tmp_path / "tok").mkdir(exist_ok=True)
        (tmp_path / "tok" / name).write_bytes(data)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    first = json.loads(open(chats_jsonl).readline())["messages"]
    text = tokenizer.apply_chat_template(first, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == store_samples(out)[0].input_ids.tolist()
    meta = store.meta
    assert meta.target.model_type == "qwen3_5" and meta.target.num_hidden_layers == 4
    assert meta.context_layer_ids == [0, 1, 2] and meta.top_k == 16
    assert meta.created_with.kernels == "attention=sdpa linear_attention=torch"
    assert meta.source.num_rows == 14 and not meta.source.regenerated


def test_nan_in_a_captured_state_stops_the_run_naming_the_sample(chats_jsonl, tmp_path):
    model_dir = tmp_path / "nan-model"
    save_qwen3(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(model_dir)
    with pytest.raises(ExtractError, match=r"chats.jsonl:line 1 \(row 0\): NaN/Inf in layer 1"):
        run_extract_cfg(str(model_dir), chats_jsonl, str(tmp_path / "hs.zarr"))
