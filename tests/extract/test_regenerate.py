"""--regenerate stores the target's own greedy continuation, so offline replay is exact."""

import io
import json

import pytest
import torch
from conftest import build_tokenizer, make_chats, run_extract_cfg, store_samples, write_jsonl
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from dflash_train.extract.data import to_chat
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.render import render_prompt
from dflash_train.store_schema import open_store, validate
from dflash_train.target_model.generation import continuations

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


def test_every_decoding_step_reports_its_tokens_and_what_ended_rows_free(qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    prompts = [[5, 9, 12], [7, 8], [30, 31, 32, 33]]
    # an eos the model emits: the first row's second greedy token, so a row ends early
    eos = _greedy(model, prompts[0], 2, eos=-1)[1]
    steps = []
    news = continuations(model, prompts, max_new_tokens=NEW, eos_ids=[eos], pad_id=0,
                         on_step=lambda n, freed: steps.append((n, freed)))
    assert news == [_greedy(model, p, NEW, eos) for p in prompts]
    assert len(steps) == max(len(n) for n in news)
    assert [n for n, _ in steps] == [sum(len(new) > s for new in news)
                                     for s in range(len(steps))]
    assert sum(freed for _, freed in steps) == sum(NEW - len(new) for new in news) > 0


class _Recorded(tqdm):
    made: list = []

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = False
        super().__init__(*args, file=io.StringIO(), **kwargs)
        self.updates = 0
        _Recorded.made.append(self)

    def update(self, n=1):
        self.updates += 1
        return super().update(n)


def test_the_bars_count_generated_and_extracted_tokens_up_to_their_true_totals(
        qwen3_dir, chats_jsonl, tmp_path, monkeypatch):
    from dflash_train.extract import fill

    monkeypatch.setattr(fill, "tqdm", _Recorded)
    _Recorded.made = []
    out = str(tmp_path / "hs.zarr")
    run_extract_cfg(qwen3_dir, chats_jsonl, out, regenerate=True, max_new_tokens=NEW,
                    batch_tokens=128)
    generate, forward = _Recorded.made
    samples = store_samples(out)
    generated = sum(int(s.loss_mask.sum()) for s in samples)
    assert generate.n == generate.total == generated
    assert generate.updates >= NEW  # step by step, not once per batch
    assert forward.n == forward.total == sum(len(s) for s in samples)
    # a re-run finds every part complete: nothing left to count, no bar left waiting
    _Recorded.made = []
    run_extract_cfg(qwen3_dir, chats_jsonl, out, regenerate=True, max_new_tokens=NEW,
                    batch_tokens=128)
    assert [(b.n, b.total) for b in _Recorded.made] == [(0, 0), (0, 0)]
