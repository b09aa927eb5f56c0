"""GGUF targets: a tiny Llama written as a real GGUF file loads to exactly the model its
dequantized weights make as safetensors; its identity is the file's content hash."""

import hashlib
import shutil

import pytest
import torch
from conftest import run_extract_cfg

from dflash_train.assets.tiny import build_tokenizer, make_chats
from dflash_train.extract.errors import ExtractError
from dflash_train.store_schema import open_store
from dflash_train.target_model.capture import forward_states
from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.loading import (
    load_target,
    load_target_config,
    load_tokenizer,
    target_info,
)
from tests.extract.tiny_gguf import LLAMA, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(GGUF file, safetensors checkpoint of the same weights)."""
    root = tmp_path_factory.mktemp("gguf")
    (root / "model").mkdir()
    path = write_tiny_gguf(root / "model" / "tiny.gguf", hf_dir=root / "hf")
    return path, str(root / "hf")


def _load(path: str):
    return load_target(path, device="cpu", dtype=torch.float32, load_as="causal-lm",
                       progress=False)


@torch.no_grad()
def test_gguf_target_equals_its_weights_loaded_from_safetensors(tiny):
    gguf_path, hf_dir = tiny
    a, b = _load(gguf_path), _load(hf_dir)
    assert a.model.config.model_type == "llama" and a.model.config.tie_word_embeddings
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0  # a padded row too
    ctx_a, final_a = forward_states(a.decoder, [0, 1, 2], ids, mask)
    ctx_b, final_b = forward_states(b.decoder, [0, 1, 2], ids, mask)
    assert torch.equal(ctx_a, ctx_b) and torch.equal(final_a, final_b)
    assert torch.equal(a.lm_head(final_a), b.lm_head(final_b))
    assert torch.equal(a.model(ids).logits, b.model(ids).logits)


def test_gguf_tokenizer_renders_and_encodes_chats_as_the_original(tiny):
    gguf_tok, original = load_tokenizer(tiny[0]), build_tokenizer()
    for row in make_chats(6):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["response"]}]
        texts = [t.apply_chat_template(messages, tokenize=False) for t in (gguf_tok, original)]
        assert texts[0] == texts[1]
        assert (gguf_tok(texts[0], add_special_tokens=False)["input_ids"]
                == original(texts[1], add_special_tokens=False)["input_ids"])
    assert gguf_tok.eos_token == "<|im_end|>"


def test_identity_is_the_file_and_its_content_hash_whichever_way_it_is_named(tiny):
    gguf_path, _ = tiny
    digest = hashlib.sha256(open(gguf_path, "rb").read()).hexdigest()
    by_file = target_info(gguf_path, load_target_config(gguf_path))
    by_dir = target_info(str(tiny[0]).rsplit("/", 1)[0], load_target_config(gguf_path))
    assert by_file == by_dir
    assert by_file.revision == f"gguf-sha256:{digest}" and by_file.name_or_path == gguf_path
    assert by_file.weights_sha256 == digest  # the same whole-file hash, not a sampled one
    assert (by_file.model_type, by_file.num_hidden_layers, by_file.hidden_size,
            by_file.vocab_size) == ("llama", 4, 64, LLAMA["vocab_size"])
    with pytest.raises(TargetError, match="--revision v1 names a hub revision"):
        target_info(gguf_path, load_target_config(gguf_path), revision="v1")


def test_a_gguf_swapped_in_at_the_same_path_is_another_target(tiny, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copy(tiny[0], model)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(f'{{"prompt": "{w} cat", "response": "yes {w}"}}\n'
                            for w in ("red", "blue", "big")))
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(str(model), str(data), out)
    first = open_store(out).meta.target
    write_tiny_gguf(model, seed=1)  # same architecture, other weights, same path
    with pytest.raises(ExtractError, match=r"was extracted from other weights than --model "
                       r".*model\.gguf \(weights fingerprint [0-9a-f]{12}\.\.\. != "):
        run_extract_cfg(str(model), str(data), out)
    assert open_store(out).meta.target == first
    again = run_extract_cfg(tiny[0], str(data), out)  # the original bytes, at another path
    assert again.parts_already_complete == [0] and again.parts_done == []

    from dflash_train.evaluate.errors import EvalError
    from dflash_train.evaluate.online import load_online_target

    with pytest.raises(EvalError, match=r"revision: --model gguf-sha256:\w+, store gguf-sha256"):
        load_online_target(str(model), open_store(out).meta, device="cpu")


def test_a_llama_store_gets_a_mask_token_its_vocabulary_holds(tiny, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"prompt": "hello cat", "response": "yes"}\n')
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(tiny[0], str(data), out)
    meta = open_store(out).meta
    # no mask token, no published id for llama, no spare row (the GGUF's tokens fill the
    # vocabulary): the last special token that no chat renders, one of the unused ones
    tok = load_tokenizer(tiny[0])
    mask = meta.extra["mask_token_id"]
    assert mask == LLAMA["vocab_size"] - 1 and tok.convert_ids_to_tokens(mask) == "<|unused_13|>"
    assert meta.target.model_type == "llama" and meta.target.revision.startswith("gguf-sha256:")


def test_ambiguous_or_fake_gguf_paths_are_refused(tiny, tmp_path):
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(tiny[0], two / "a.gguf")
    shutil.copy(tiny[0], two / "b.gguf")
    with pytest.raises(TargetError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        load_target_config(str(two))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(TargetError, match="fake.gguf: not a GGUF file"):
        load_target_config(str(fake))
