"""--regenerate stores the target's own greedy continuation, so offline replay is exact."""

import json

import pytest
import torch
from conftest import build_tokenizer, make_chats, run_extract_cfg, store_samples, write_jsonl
from transformers import AutoModelForCausalLM

from dflash_train.extract.data import to_chat
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.render import render_prompt
from dflash_train.store_schema import open_store, validate

NEW = 6


def _greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    """Plain greedy decoding without a cache: the independent expectation."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt):]


@pytest.mark.parametrize("model_fixture", ["qwen3_dir", "qwen3_5_dir"])
def test_regenerated_samples_are_the_targets_greedy_continuations(model_fixture, chats_jsonl,
                                                                  tmp_path, request):
    model_dir = request.getfixturevalue(model_fixture)
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(model_dir, chats_jsonl, out, regenerate=True, max_new_tokens=NEW,
                    batch_tokens=128)
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [line for line in open(chats_jsonl) if line.strip()]
    samples = store_samples(out)
    assert [s.source_row for s in samples] == list(range(len(rows)))
    for s in samples:
        chat = to_chat(json.loads(rows[s.source_row]), "row")
        prompt = render_prompt(tokenizer, chat, thinking=False, where="row")
        new = _greedy(model, prompt, NEW, tokenizer.eos_token_id)
        assert s.input_ids.tolist() == prompt + new
        assert s.loss_mask.tolist() == [False] * len(prompt) + [True] * len(new)
        # the verifier agrees with every stored next token after the prompt: replay is live
        tail = slice(len(prompt) - 1, len(s) - 1)
        assert torch.equal(s.topk_ids[tail, 0], s.input_ids[len(prompt):])
    meta = open_store(out).meta
    assert meta.source.regenerated and meta.extra["max_new_tokens"] == NEW
    assert validate(out) == []


def test_regenerate_with_a_different_budget_is_refused(qwen3_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_chats(3))
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, data, out, regenerate=True, max_new_tokens=3)
    with pytest.raises(ExtractError, match="max_new_tokens"):
        run_extract_cfg(qwen3_dir, data, out, regenerate=True, max_new_tokens=4)
