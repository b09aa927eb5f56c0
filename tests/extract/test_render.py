"""The loss mask marks exactly the assistant tokens, for any chat the template renders."""

import pytest
from conftest import build_tokenizer, make_chats

from dflash_train.extract.data import to_chat
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.render import render_chat, render_prompt


def _expected(tokenizer, chat):
    """Ids and mask built piece by piece from the template's known layout (independent of
    the prefix-diff rule): header and separator are prompt, content + <|im_end|> is the
    assistant's when the role is."""
    ids, mask = [], []

    def piece(text, is_assistant):
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(part)
        mask.extend([is_assistant] * len(part))

    for m in chat:
        piece(f"<|im_start|>{m['role']}\n", False)
        piece(m["content"] + "<|im_end|>", m["role"] == "assistant")
        piece("\n", False)
    return ids, mask


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_loss_mask_marks_exactly_the_assistant_tokens(tokenizer):
    rows = make_chats(24, seed=3)
    assert any(len(r.get("messages", [])) > 3 for r in rows)  # multi-turn chats are covered
    for i, row in enumerate(rows):
        chat = to_chat(row, f"row {i}")
        got = render_chat(tokenizer, chat, thinking=False, where=f"row {i}")
        ids, mask = _expected(tokenizer, chat)
        assert got.input_ids == ids
        assert got.loss_mask == mask


def test_prompt_response_pair_renders_like_the_equivalent_chat(tokenizer):
    pair = to_chat({"prompt": "hello cat", "response": "yes no"}, "pair")
    chat = to_chat({"messages": [{"role": "user", "content": "hello cat"},
                                 {"role": "assistant", "content": "yes no"}]}, "chat")
    assert render_chat(tokenizer, pair, thinking=False, where="a") == \
        render_chat(tokenizer, chat, thinking=False, where="b")


def test_template_that_never_renders_assistant_turns_is_an_error(tokenizer):
    broken = build_tokenizer(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = to_chat({"prompt": "hello", "response": "fine"}, "x")
    with pytest.raises(ExtractError, match="data.jsonl:line 7.*loss mask all zero"):
        render_chat(broken, chat, thinking=False, where="data.jsonl:line 7")


def test_chat_without_assistant_turn_is_an_error(tokenizer):
    chat = to_chat({"messages": [{"role": "user", "content": "hello"}]}, "x")
    with pytest.raises(ExtractError, match="row 4: the chat has no assistant turn"):
        render_chat(tokenizer, chat, thinking=False, where="row 4")


def test_prompt_is_every_turn_before_the_last_assistant_turn(tokenizer):
    chat = to_chat(make_chats(2, seed=0)[1], "x")  # row 1 is a two-round chat
    ids = render_prompt(tokenizer, chat, thinking=False, where="x")
    full = render_chat(tokenizer, chat, thinking=False, where="x")
    start = max(i for i, m in enumerate(full.loss_mask) if m)
    while full.loss_mask[start - 1]:
        start -= 1
    # the prompt is the full chat up to where the last assistant turn's tokens begin
    assert ids == full.input_ids[:start]
