"""Rows of one part -> token ids and loss masks ready for the forward, in row order.

Owns the max-length policy and the regeneration step. The policy: a sample longer than
max_length is truncated (or, with overlong="skip", skipped); a row left with no assistant
token within max_length -- in particular one whose prompt alone is that long -- is skipped.
Skips are never errors for one row: they are counted and named in the run's summary
(pipeline.py refuses a run in which every row is skipped). Batch plans here depend only on the
part's rows, never on where a previous run stopped (see plan.py), so generation and forward
batches are the same in a resumed run as in an uninterrupted one.
"""

from dataclasses import dataclass, field

from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.data import ChatSource
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.plan import plan_batches
from dflash_train.extract.render import (
    chat_within,
    longest_token_chars,
    prompt_chat,
    render_chat,
    render_prompt,
)
from dflash_train.extract.server_generate import Ask, Server, server_continuations
from dflash_train.target_model.generate_capture import (
    StatesToKeep,
    TokenStates,
    generate_with_states,
)
from dflash_train.target_model.generation import continuations, eos_token_ids
from dflash_train.target_model.loading import Target


@dataclass
class Item:
    """One sample to extract."""

    row: int
    input_ids: list[int]
    loss_mask: list[bool]
    states: TokenStates | None = None
    """What the target computed at every token while generating it (ExtractConfig.capture);
    None: the capture forward computes it."""


@dataclass
class Counts:
    """What the length policy did, for the end-of-run summary."""

    truncated: int = 0
    skipped_overlong: int = 0
    skipped_no_assistant: int = 0
    """Samples whose assistant tokens all lie beyond max_length."""
    skipped_rows: list[int] = field(default_factory=list)
    """Source rows of every skipped sample, in order."""

    def add(self, other: "Counts") -> None:
        self.truncated += other.truncated
        self.skipped_overlong += other.skipped_overlong
        self.skipped_no_assistant += other.skipped_no_assistant
        self.skipped_rows += other.skipped_rows


def apply_length_policy(item: Item, cfg: ExtractConfig, counts: Counts) -> Item | None:
    """Truncate or skip an overlong item; None when nothing is left to learn from."""
    if len(item.input_ids) <= cfg.max_length:
        return item
    if cfg.overlong == "skip":
        counts.skipped_overlong += 1
        counts.skipped_rows.append(item.row)
        return None
    n = cfg.max_length
    cut = Item(item.row, item.input_ids[:n], item.loss_mask[:n],
               None if item.states is None else item.states.first(n))
    if not any(cut.loss_mask):
        counts.skipped_no_assistant += 1
        counts.skipped_rows.append(item.row)
        return None
    counts.truncated += 1
    return cut


def prompt_fits(item: Item, cfg: ExtractConfig, counts: Counts) -> Item | None:
    """With regenerate: a prompt of max_length tokens or more leaves no room for a single
    generated token, so it is skipped before any generation is spent on it."""
    if len(item.input_ids) < cfg.max_length:
        return item
    counts.skipped_no_assistant += 1
    counts.skipped_rows.append(item.row)
    return None


def render_rows(source: ChatSource, tokenizer, rows: range, cfg: ExtractConfig) -> list[Item]:
    """Rendered chats (or, with regenerate, prompts with an empty mask) for `rows`.

    A chat is cut to what its first max_length tokens can hold before it is rendered
    (render.chat_within), so one huge row costs what max_length allows."""
    items = []
    max_chars = (cfg.max_length + 16) * longest_token_chars(tokenizer)
    for row in rows:
        chat, where = source.chat(row), source.where(row)
        if cfg.regenerate:
            chat, _ = chat_within(prompt_chat(chat), max_chars)
            ids = render_prompt(tokenizer, chat, thinking=cfg.enable_thinking, where=where)
            items.append(Item(row, ids, [False] * len(ids)))
            continue
        chat, cut = chat_within(chat, max_chars)
        if cut and not any(m["role"] == "assistant" for m in chat):
            # every assistant token lies past max_length: the length policy skips the row
            ids = render_prompt(tokenizer, chat, thinking=cfg.enable_thinking, where=where)
            items.append(Item(row, ids, [False] * len(ids)))
            continue
        r = render_chat(tokenizer, chat, thinking=cfg.enable_thinking, where=where)
        items.append(Item(row, r.input_ids, r.loss_mask))
    return items


def regenerate_items(target: Target, tokenizer, prompts: list[Item], cfg: ExtractConfig,
                     first_row: int, bar=None, servers: list[Server] | None = None,
                     capture_layers: list[int] | None = None) -> list[Item]:
    """Prompt + the target's continuation (greedy, or drawn per cfg.sampling keyed by the
    prompt's source row) for every prompt whose row >= first_row, in row order;
    generated by `servers` (checked to serve the target, ids checked against its vocabulary)
    when given, else by the target, which with `capture_layers` also keeps those layers'
    states and its top-k at every token (Item.states).

    Generation batches take the part's prompts shortest first: prompts are left-padded to the
    longest of their batch, and similar lengths waste little of that (the order depends on the
    part's prompts only, so a resumed run generates in the same batches). `bar` (a tqdm bar)
    counts generated tokens; its total is the token budget and shrinks by what rows that end
    early, or batches done before, will never generate.
    """
    if cfg.max_new_tokens < 1:
        raise ExtractError("--max-new-tokens must be >= 1 with --regenerate")
    eos = eos_token_ids(target.model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [0])[0]
    if servers:
        return _served_items(servers, prompts, cfg, first_row, eos, target.info.vocab_size,
                             bar)
    order = sorted(prompts, key=lambda p: (len(p.input_ids), p.row))
    lengths = [len(p.input_ids) + cfg.max_new_tokens for p in order]
    made: dict[int, Item] = {}
    for batch in plan_batches(lengths, cfg.batch_tokens):
        chosen = [order[i] for i in batch]
        if max(p.row for p in chosen) < first_row:
            shrink_total(bar, len(chosen) * cfg.max_new_tokens)  # committed by an earlier run
            continue
        how = dict(max_new_tokens=cfg.max_new_tokens, eos_ids=eos, pad_id=pad,
                   sampling=cfg.sampling, sample_ids=[p.row for p in chosen],
                   on_step=None if bar is None else _counter(bar))
        prompt_ids = [p.input_ids for p in chosen]
        if capture_layers:
            news = generate_with_states(target, prompt_ids,
                                        StatesToKeep(capture_layers, cfg.top_k), **how)
        else:
            news = [(new, None) for new in continuations(target.model, prompt_ids, **how)]
        for p, (new, states) in zip(chosen, news, strict=True):
            if p.row >= first_row:
                made[p.row] = Item(p.row, p.input_ids + new,
                                   [False] * len(p.input_ids) + [True] * len(new), states)
    return [made[row] for row in sorted(made)]


def _served_items(servers: list[Server], prompts: list[Item], cfg: ExtractConfig,
                  first_row: int, eos: list[int], vocab_size: int, bar) -> list[Item]:
    """Each request stands alone, so unlike the built-in batches only the rows still to do
    are sent."""
    todo = [p for p in prompts if p.row >= first_row]
    shrink_total(bar, (len(prompts) - len(todo)) * cfg.max_new_tokens)

    def on_done(tokens: int) -> None:
        shrink_total(bar, cfg.max_new_tokens - tokens)
        if bar is not None:
            bar.update(tokens)

    news = server_continuations(servers, [(p.row, p.input_ids) for p in todo],
                                Ask(cfg.max_new_tokens, eos, vocab_size, cfg.sampling),
                                in_flight=cfg.server_requests, timeout=cfg.server_timeout,
                                on_done=on_done)
    return [Item(p.row, p.input_ids + news[p.row],
                 [False] * len(p.input_ids) + [True] * len(news[p.row])) for p in todo]


def shrink_total(bar, tokens: int) -> None:
    """Take from a bar's total what will never be counted."""
    if bar is not None and tokens:
        bar.total -= tokens
        bar.refresh()


def _counter(bar):
    def on_step(generated: int, freed: int) -> None:
        shrink_total(bar, freed)
        bar.update(generated)

    return on_step
