"""Filling this rank's parts of the store with an ExtractRun.

The store is created (or reopened) under the `create` claim, rank 0 commits the frozen rows
as one unit under the `frozen` claim, then each of my parts is filled under its own claim in
three steps: what is already written (where the part resumes), what is generated (the rows
still to do, answered ahead during the previous part's forward or now), and what is written
now (forward batches handed to the background writer). The rules:
- a complete part is skipped; an incomplete one resumes at PartWriter.next_row, with the
  batches it would have had in an uninterrupted run (committed samples give the lengths of
  the rows already done), so the arrays come out bit-identical;
- with servers, the first part is checked for agreement with the target before any later
  part is asked for; from then on the next part is generated during this part's forward.
Never knows zarr paths: the store is reached only through dflash_train.store_schema.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch
from tqdm import tqdm

from dflash_train.extract.ahead import GenerationAhead
from dflash_train.extract.claims import exclusive as _exclusive
from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.plan import PartPlan, plan_batches
from dflash_train.extract.prepare import (
    Counts,
    Item,
    apply_length_policy,
    prompt_fits,
    regenerate_items,
    render_rows,
    shrink_total,
)
from dflash_train.extract.run import ExtractPlan, ExtractRun, ExtractSummary
from dflash_train.extract.server_generate import check_agreement
from dflash_train.extract.writer import FLUSH_SHARDS, BackgroundWriter
from dflash_train.store_schema import (
    PartWriter,
    Sample,
    Store,
    StoreError,
    create_store,
    open_store,
)
from dflash_train.store_schema.frozen import frozen_written, write_frozen
from dflash_train.target_model.capture import forward_states
from dflash_train.target_model.generate_capture import TokenStates
from dflash_train.target_model.loading import Target
from dflash_train.target_model.verifier import verifier_topk


@dataclass
class Bars:
    """The progress bars of one rank: generated tokens (--regenerate), forwarded tokens."""

    generate: tqdm | None
    forward: tqdm

    def close(self) -> None:
        for bar in (self.generate, self.forward):
            if bar is not None:
                bar.close()


@dataclass(kw_only=True)
class _Filling:
    """What a rank holds while it fills its parts."""

    store: Store
    bars: Bars
    writer: BackgroundWriter
    """Appends a batch's samples while the next batch's forward runs."""
    ahead: GenerationAhead | None
    """With servers: the next part's answers, generated during this part's forward."""
    summary: ExtractSummary


def fill_store(run: ExtractRun) -> ExtractSummary:
    """Create or reopen the store, copy the frozen rows, extract my parts."""
    plan = run.plan
    store = _create_store(run)
    fill = _Filling(store=store, bars=_bars(plan), writer=BackgroundWriter(),
                    ahead=GenerationAhead() if run.servers else None,
                    summary=ExtractSummary(plan.cfg.out, bytes_per_token=plan.bytes_per_token))
    try:
        _fill_parts(run, fill)
    finally:
        fill.bars.close()
        fill.writer.close()
    fill.summary.store_complete = _complete(plan.cfg.out)
    return fill.summary


def _create_store(run: ExtractRun) -> Store:
    """The store at --out, created or reopened (create_store refuses one made differently);
    rank 0 then commits the frozen rows, unless a run before it did."""
    cfg = run.plan.cfg
    with _exclusive(cfg.out, "create", wait=True):
        store = create_store(cfg.out, run.meta, shard_tokens=cfg.shard_tokens)
    if run.plan.rank == 0:
        with _exclusive(cfg.out, "frozen", wait=True):
            _write_frozen_rows(store, run.target, run.plan.tokenizer_files)
    return store


def _write_frozen_rows(store: Store, target: Target, tok_files: dict[str, bytes]) -> None:
    """Copy embed_tokens, lm_head, final norm, the target's config and the tokenizer as one
    unit, unless a run before this one committed it (store_schema.frozen)."""
    # The drafter is sized from the target's config (heads, MLP width, RoPE), not its weights.
    files = {"target": {"config.json": target.model.config.to_json_string().encode()},
             "tokenizer": tok_files}
    if frozen_written(store, files):
        return
    norm = target.decoder.norm
    # the norm's effective scale (1 + w for Qwen3.5's zero-centred norm, w for Qwen3/Llama):
    # a constant input of size 1e3 makes eps negligible, so norm(x) is the scale itself
    probe = torch.full((target.info.hidden_size,), 1e3, device=target.device)
    with torch.inference_mode():
        scale = norm(probe.float()).float()
    write_frozen(store, {"embed_tokens": target.decoder.embed_tokens.weight,
                         "lm_head": target.lm_head.weight, "final_norm": scale}, files)


def _bars(plan: ExtractPlan) -> Bars:
    """Bars over the rows' token budgets; each total shrinks as rows turn out shorter (eos
    before max-new-tokens, truncation) or already committed, so rate and ETA stay true."""
    cfg, where = plan.cfg, f"rank {plan.rank}/{plan.world}"
    return Bars(
        generate=tqdm(total=cfg.max_new_tokens * len(plan.scanned), unit="tok",
                      unit_scale=True, disable=not cfg.progress, desc=f"generate {where}",
                      position=0) if cfg.regenerate else None,
        forward=tqdm(total=sum(plan.budgets.values()), unit="tok", unit_scale=True,
                     disable=not cfg.progress, desc=f"extract {where}",
                     position=1 if cfg.regenerate else 0))


def _fill_parts(run: ExtractRun, fill: _Filling) -> None:
    """Extract each of my parts under its claim; with servers, check their answers agree with
    the target after the first part, and generate each later part ahead."""
    mine = run.plan.mine
    for n, part in enumerate(mine):
        # not during the first part: its agreement check must refuse another model's
        # server before any later part is asked for
        following = mine[n + 1] if fill.ahead and 0 < n < len(mine) - 1 else None
        with _exclusive(run.plan.cfg.out, f"part-{part.index:05d}", wait=False):
            _extract_part(run, fill, part, partial(_generate_ahead, run, fill, following))
            fill.writer.wait()  # the claim must outlive the part's last write
        if run.servers and n == 0:  # another model's answers: refused after one part, not all
            check_agreement(fill.store, run.servers)


def _extract_part(run: ExtractRun, fill: _Filling, part: PartPlan,
                  start_next: Callable[[], None]) -> None:
    """Write the samples of `part` still missing: what is already written says where to
    resume, the rows after it get their items (answers generated ahead, or now), and those
    are forwarded and written now. `start_next` starts the next part's generation once this
    part's answers are in, so that it runs during this part's forward."""
    part_writer = fill.store.part_writer(part.index, part.row_start, part.row_stop,
                                         FLUSH_SHARDS)
    if part_writer.complete:
        start_next()
        _count_complete(run.plan, fill, part)
        return
    first = part_writer.next_row
    done = _committed_lengths(fill.store, part) if first > part.row_start else []
    todo = _items_to_write(run, fill, part, first)
    start_next()
    _write_now(run, fill, part_writer, done, todo)
    fill.summary.parts_done.append(part.index)


def _count_complete(plan: ExtractPlan, fill: _Filling, part: PartPlan) -> None:
    """A part an earlier run completed: reported as such, its budget taken off the bars."""
    fill.summary.parts_already_complete.append(part.index)
    shrink_total(fill.bars.forward, plan.budget(part))
    prompts = sum(row in plan.budgets for row in range(part.row_start, part.row_stop))
    shrink_total(fill.bars.generate, prompts * plan.cfg.max_new_tokens)


def _committed_lengths(store: Store, part: PartPlan) -> list[tuple[int, int]]:
    """(source row, length) of the samples a previous run committed to `part`."""
    p = store.part(part.index)
    return list(zip(p.sources().tolist(), p.sample_lengths().tolist(), strict=True))


def _items_to_write(run: ExtractRun, fill: _Filling, part: PartPlan, first: int
                    ) -> list[Item]:
    """The part's rows from `first` on, rendered (or prompts answered, with regenerate), as
    the length policy keeps them; the summary counts what it skipped or cut, and the forward
    bar loses the budget no kept item will use."""
    plan = run.plan
    if plan.cfg.regenerate:
        items, counts = _answered(run, fill, part, first)
    else:
        rows = range(first, part.row_stop)
        items, counts = render_rows(plan.source, plan.tokenizer, rows, plan.cfg), Counts()
    kept = [k for i in items if (k := apply_length_policy(i, plan.cfg, counts)) is not None]
    shrink_total(fill.bars.forward, plan.budget(part) - sum(len(i.input_ids) for i in kept))
    fill.summary.count(counts, plan.source)
    return kept


def _answered(run: ExtractRun, fill: _Filling, part: PartPlan, first: int
              ) -> tuple[list[Item], Counts]:
    """Prompt + answer of the part's rows from `first` on, generated ahead (during the
    previous part's forward) or now; and the prompts of those rows that leave no room to
    generate, counted."""
    plan, counts = run.plan, Counts()
    prompts = _part_prompts(plan, part)
    for p in prompts:  # count only the skips of rows this run still has to do
        if p.row >= first:
            prompt_fits(p, plan.cfg, counts)
    items = fill.ahead.take(part.index, first) if fill.ahead else None
    if items is None:
        items = _generate(run, fill, _fitting(prompts, plan.cfg), first)
    return items, counts


def _part_prompts(plan: ExtractPlan, part: PartPlan) -> list[Item]:
    """Every prompt of the part, not only the rows still to do, so that generation batches
    equal an uninterrupted run's."""
    return render_rows(plan.source, plan.tokenizer, range(part.row_start, part.row_stop),
                       plan.cfg)


def _fitting(prompts: list[Item], cfg: ExtractConfig) -> list[Item]:
    """The prompts that leave room to generate."""
    return [k for p in prompts if (k := prompt_fits(p, cfg, Counts())) is not None]


def _generate(run: ExtractRun, fill: _Filling, prompts: list[Item], first: int) -> list[Item]:
    """Prompt + answer of each of `prompts` from row `first` on: by the servers, or the
    target itself."""
    plan = run.plan
    return regenerate_items(run.target, plan.tokenizer, prompts, plan.cfg, first,
                            fill.bars.generate, run.servers,
                            plan.layer_ids if plan.captures_in_generation else None)


def _generate_ahead(run: ExtractRun, fill: _Filling, part: PartPlan | None) -> None:
    """Start the servers on `part`'s rows still to do, unless it is complete (or None). Its
    claim is not held yet: _extract_part uses what is generated only for rows still missing
    then."""
    if part is None:
        return
    try:
        committed = fill.store.part(part.index)
        first = None if committed.complete else committed.next_row()
    except StoreError:  # not started (or its creation torn): nothing committed
        first = part.row_start
    if first is None:
        return
    fitting = _fitting(_part_prompts(run.plan, part), run.plan.cfg)
    fill.ahead.start(part.index, first, lambda: _generate(run, fill, fitting, first))


def _write_now(run: ExtractRun, fill: _Filling, part_writer: PartWriter,
               done: list[tuple[int, int]], todo: list[Item]) -> None:
    """Forward `todo` and hand its samples to the background writer batch by batch, batched
    over done + todo exactly as an uninterrupted run would batch this part."""
    lengths = [n for _, n in done] + [len(i.input_ids) for i in todo]
    for batch in plan_batches(lengths, run.plan.cfg.batch_tokens):
        if batch[-1] < len(done):
            continue
        items = [todo[i - len(done)] if i >= len(done) else None for i in batch]
        if all(i is None or i.states is not None for i in items):  # states kept in generation
            samples = [_sample(run, i, i.states) for i in items if i is not None]
            for i in items:
                if i is not None:
                    i.states = None  # the writer holds them now; the part's list need not
        else:
            samples = _forward_batch(run, items, [lengths[i] for i in batch])
        fill.writer.append(part_writer, samples)
        tokens = sum(len(s) for s in samples)
        fill.summary.samples += len(samples)
        fill.summary.tokens += tokens
        fill.bars.forward.update(tokens)
    fill.writer.finish(part_writer)


def _forward_batch(run: ExtractRun, items: list[Item | None], lengths: list[int]
                   ) -> list[Sample]:
    """Samples for the not-yet-committed items of one batch.

    Committed rows in the batch (None items) are re-run with placeholder tokens of their
    stored length only so that the batch's shape equals the uninterrupted run's.
    """
    target, layer_ids = run.target, run.plan.layer_ids
    input_ids, attention = _padded(items, lengths)
    context, final = forward_states(target.decoder, layer_ids, input_ids.to(target.device),
                                    attention.to(target.device))
    valid = attention.bool().to(target.device)
    ids, logits, lse = verifier_topk(final[valid], target.lm_head, run.plan.cfg.top_k)
    offsets = [0, *accumulate(lengths)]
    return [_sample(run, item, TokenStates(context[b, :lengths[b]], ids[lo:hi], logits[lo:hi],
                                           lse[lo:hi]))
            for b, (item, lo, hi) in enumerate(zip(items, offsets, offsets[1:], strict=False))
            if item is not None]


def _sample(run: ExtractRun, item: Item, states: TokenStates) -> Sample:
    """The stored sample of `item`, its states checked finite where they are (on the GPU:
    microseconds; on the host a float copy of a 4096-token sample at 27B width took longer
    than its share of the forward)."""
    _check_finite(states.context, states.topk_logits, states.lse, run.plan.layer_ids,
                  run.plan.source.where(item.row))
    return Sample(
        input_ids=torch.tensor(item.input_ids, dtype=torch.int32),
        loss_mask=torch.tensor(item.loss_mask, dtype=torch.bool),
        context=_owned_on_host(states.context), topk_ids=states.topk_ids.cpu(),
        topk_logits=states.topk_logits.cpu(), lse=states.lse.cpu(), source_row=item.row,
    )


def _owned_on_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host in storage of its own: a view of a padded batch (even on a CPU target)
    would keep the whole batch alive in the writer's buffer until its next flush."""
    owned = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if t.device.type == "cpu" and owned else t.to("cpu", copy=True)


def _padded(items: list[Item | None], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask [batch, longest], right-padded; a None item's tokens are
    zeros of its length."""
    input_ids = torch.zeros((len(items), max(lengths)), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for b, (item, n) in enumerate(zip(items, lengths, strict=True)):
        if item is not None:
            input_ids[b, :n] = torch.tensor(item.input_ids)
        attention[b, :n] = 1
    return input_ids, attention


def _check_finite(context: torch.Tensor, topk_logits: torch.Tensor, lse: torch.Tensor,
                  layer_ids: list[int], where: str) -> None:
    """Refuse a sample whose captured states [n, layers, H] or verifier logits hold NaN/Inf."""
    bad = ~torch.isfinite(context)
    if bad.any():
        t, j, _ = bad.nonzero()[0].tolist()
        raise ExtractError(f"{where}: NaN/Inf in layer {layer_ids[j]}'s state at token {t}; "
                           "stopping (nothing of this sample was written)")
    if not torch.isfinite(lse).all() or not torch.isfinite(topk_logits).all():
        raise ExtractError(f"{where}: NaN/Inf in the verifier logits; stopping")


def _complete(out: str) -> bool:
    try:
        store = open_store(out)
        store.read_files("tokenizer")  # a store made before the frozen record: its last file
        return store.complete
    except StoreError:
        return False
