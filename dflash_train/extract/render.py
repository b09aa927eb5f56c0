"""Chats -> token ids and an exact assistant-token loss mask, through the tokenizer's template.

The mask is derived from the template itself, so it works for any chat template (Qwen's carry
no {% generation %} tags): for each assistant turn i, the text rendered for turns < i with the
generation prompt must be a prefix of the full text, and so must the text rendered through
turn i; the characters between them (trailing whitespace dropped: the separator after the
end-of-turn token is never generated) are that turn's. Tokens starting inside such a span are
assistant tokens. A template that rewrites earlier turns (e.g. drops old reasoning) leaves
those turns unmarked; they are not what the model generates. Never touches a model.
"""

from dataclasses import dataclass

from dflash_train.extract.data import Chat
from dflash_train.extract.errors import ExtractError


@dataclass
class Rendered:
    """One chat as the target sees it."""

    input_ids: list[int]
    loss_mask: list[bool]
    """True on assistant tokens (the ones the drafter learns to predict)."""


def _template(tokenizer, messages: Chat, *, generation_prompt: bool, thinking: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt,
        enable_thinking=thinking,
    )


def assistant_spans(tokenizer, chat: Chat, *, thinking: bool) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the character spans of its assistant turns."""
    full = _template(tokenizer, chat, generation_prompt=False, thinking=thinking)
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        before = _template(tokenizer, chat[:i], generation_prompt=True, thinking=thinking)
        through = _template(tokenizer, chat[: i + 1], generation_prompt=False, thinking=thinking)
        if not (through.startswith(before) and full.startswith(through)):
            continue
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return full, spans


def render_chat(tokenizer, chat: Chat, *, thinking: bool, where: str) -> Rendered:
    """Token ids and loss mask of a whole chat; ExtractError if no token is an assistant's."""
    if not any(m["role"] == "assistant" for m in chat):
        raise ExtractError(f"{where}: the chat has no assistant turn to learn from")
    try:
        text, spans = assistant_spans(tokenizer, chat, thinking=thinking)
    except ExtractError:
        raise
    except Exception as e:  # jinja raises its own types for a template that rejects the chat
        raise ExtractError(f"{where}: the chat template failed: {e}") from e
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    if not any(mask):
        raise ExtractError(
            f"{where}: the chat template marks no assistant tokens (loss mask all zero); "
            "the template must render assistant turns after its generation prompt"
        )
    return Rendered(list(enc["input_ids"]), mask)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: its longest vocabulary entry (byte-level
    BPE spells each byte as one character, SentencePiece each character as one, so no token
    decodes to more characters than its entry has)."""
    return max(map(len, tokenizer.get_vocab()))


def chat_within(chat: Chat, max_chars: int) -> tuple[Chat, bool]:
    """(`chat` cut after `max_chars` characters of content, whether anything was cut).

    With max_chars = (max_length + 16) x longest_token_chars, the first max_length tokens of
    the cut chat are those of the whole one: they cover at most max_length x that many
    characters, all before the cut. So a row's cost is bounded by max_length, not by its
    size, and a cut chat is always longer than max_length (the length policy then truncates
    or skips it as it would the whole)."""
    kept, used = [], 0
    for message in chat:
        room = max_chars - used
        if len(message["content"]) > room:
            if room > 0:
                kept.append({**message, "content": message["content"][:room]})
            return kept, True
        kept.append(message)
        used += len(message["content"])
    return kept, False


def prompt_chat(chat: Chat) -> Chat:
    """The turns before the last assistant turn (all turns if the chat ends with another)."""
    last = max((i for i, m in enumerate(chat) if m["role"] == "assistant"), default=None)
    return chat if last is None or last < len(chat) - 1 else chat[:last]


def render_prompt(tokenizer, chat: Chat, *, thinking: bool, where: str) -> list[int]:
    """Token ids of `chat`'s prompt followed by the template's generation prompt."""
    prompt = prompt_chat(chat)
    if not prompt:
        raise ExtractError(f"{where}: nothing before the assistant turn to use as a prompt")
    try:
        text = _template(tokenizer, prompt, generation_prompt=True, thinking=thinking)
    except Exception as e:  # jinja raises its own types for a template that rejects the chat
        raise ExtractError(f"{where}: the chat template failed: {e}") from e
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
