"""Offline replay: draft blocks against the store's target states and score them.

For each batch of stored sequences, every checkpoint drafts the same blocks:
- `--mode all`: one block at every eligible anchor (dflash_train.blocks.eligible_anchors);
- `--mode replay`: the anchors live greedy decoding would visit (dflash_train.blocks.replay_anchors:
  first response token, then a + tau). Sequential within a sequence, batched across the
  sequences of a batch step by step.
A block's labels are the target's choice at a+k-1 (dflash_train.blocks.block_labels): the stored
verifier argmax, or on a sampled store (StoreMeta.sampling) the stored next token, the target's
own draw there (EvalSample.top1, set once where samples are read); its
draft is the drafter's per-slot top-k, led by what it proposes (a DFlash 2 drafter: its
selector walk, drafting.BlockDrafter.draft), and the replay's next anchor follows that draft.
Its tau is the tokens live decoding would commit there: the accepted drafts plus the target's
bonus token, unless the stored text ends inside those drafts (the end-of-turn token or the
token cap was drafted), where no bonus follows (`tokens_left`). Metrics accumulate in
`CheckpointResults`.

Offline tau equals live speculative decoding (evaluate.online: a full block every round, as
serving engines draft) only when the store holds the target's own continuation (extract
--regenerate): greedy, where the store's agreement rate says how far it does; or sampled with
a seed, equal to live sample-and-match with that seed by construction (§8a). This module never
loads the target model and never writes files.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from dflash_train.batching import padded_batches
from dflash_train.blocks import block_label_mask, block_labels, eligible_anchors, replay_anchors
from dflash_train.evaluate.damage import DamagePolicy
from dflash_train.evaluate.drafting import BlockDrafter, Draft, cat_drafts, select_rows
from dflash_train.evaluate.metrics import (
    DEFAULT_POSITION_BIN,
    Budget,
    Walk,
    agreement_counts,
    committed_lengths,
)
from dflash_train.evaluate.summary import EvalSummary
from dflash_train.evaluate.tree import DraftTree, accepted_path, grow_tree
from dflash_train.store_schema import Damage, Part, Sample, Store, read_guarded
from dflash_train.store_schema.integrity import read_by_span
from dflash_train.store_schema.part import sample_spans

Mode = Literal["replay", "all"]


@dataclass
class EvalSettings:
    """How blocks are chosen, scored and batched."""

    mode: Mode = "replay"
    """replay: the anchors live decoding visits; all: every eligible anchor."""
    tree_budgets: tuple[int, ...] = (16, 32, 64)
    """DDTree node budgets at which tree acceptance is reported (docs/reference.md §7)."""
    recall_at: tuple[int, ...] = (1, 2, 4, 8)
    """k of the per-slot top-k recall."""
    batch_tokens: int = 16384
    """Sequences per batch: count x longest <= this (at least one sequence)."""
    blocks_per_forward: int = 16
    """Blocks per sequence in one drafter forward (--mode all); bounds attention memory."""
    position_bin: int = DEFAULT_POSITION_BIN
    """Tokens per bin of tau by anchor position: bin = anchor // position_bin, the anchor's
    position counted from the start of the sequence, prompt included."""

    def top_k(self, vocab_size: int) -> int:
        """Draft ids kept per slot: enough for the largest budget and recall (<= vocab)."""
        return min(max((*self.tree_budgets, *self.recall_at, 1)), vocab_size)


@dataclass
class EvalSample:
    """One stored sequence, as replay needs it."""

    part: int
    index: int
    """Sample index within its part."""
    source_row: int
    input_ids: torch.Tensor
    """long [L]."""
    loss_mask: torch.Tensor
    """bool [L]."""
    context: torch.Tensor
    """[L, n, H] in the store's hidden dtype."""
    top1: torch.Tensor
    """long [L]: the target's choice of next token at each position: the verifier's argmax,
    or on a sampled store the stored next token (the last position repeats its own token)."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.part, self.index)

    @classmethod
    def from_sample(cls, part: int, index: int, s: Sample, sampled: bool = False
                    ) -> "EvalSample":
        """`sampled`: the store's answers are the target's draws at T > 0, so the target's
        choice at t is the token stored at t+1, not its argmax (docs/reference.md §8a)."""
        ids = s.input_ids.long()
        top1 = torch.cat([ids[1:], ids[-1:]]) if sampled else s.topk_ids[:, 0].long()
        return cls(part, index, s.source_row, ids, s.loss_mask.bool(), s.context, top1)


def sample_keys(store: Store, damage: DamagePolicy | None = None) -> list[tuple[int, int]]:
    """(part, index) of every committed sample outside damaged and unfinished parts, in
    store order."""
    damage = damage or DamagePolicy()
    return [(p.index, i) for p in store.parts() if not damage.part_is_left_out(p.index)
            for i in range(p.num_samples)]


def pick_samples(store: Store, limit: int | None, seed: int,
                 damage: DamagePolicy | None = None) -> list[tuple[int, int]] | None:
    """None (every sample) or `limit` samples uniform without replacement, in store order."""
    if limit is None:
        return None
    keys = sample_keys(store, damage)
    if limit >= len(keys):
        return None
    chosen = np.random.default_rng(seed).choice(len(keys), size=limit, replace=False)
    return [keys[i] for i in sorted(chosen.tolist())]


def read_samples(store: Store, keys: list[tuple[int, int]] | None = None,
                 damage: DamagePolicy | None = None) -> Iterator[EvalSample]:
    """The chosen samples (all when keys is None), streamed in store order. A damaged sample
    is handed to `damage` (refused, or skipped and listed) instead of being yielded."""
    damage = damage or DamagePolicy()
    if keys is None:
        for part in store.parts():
            if not damage.part_is_left_out(part.index):
                yield from _read_part(part, damage)
        return
    parts = {}
    for p, i in keys:
        if p not in parts:
            parts[p] = store.part(p)
        sample = _read_one(parts[p], i, damage)
        if sample is not None:
            yield sample


def _read_one(part: Part, i: int, damage: DamagePolicy) -> EvalSample | None:
    found = damage.known_damage(part.index, i)
    if found is None:
        sample, found = read_guarded(part.store.url, part.index, i, lambda: part.sample(i))
    if found is not None:
        damage.handle(found)
        return None
    return EvalSample.from_sample(part.index, i, sample, _sampled(part))


def _sampled(part: Part) -> bool:
    """The part's store holds sampled answers: its labels are the stored next tokens."""
    return part.store.meta.sampling is not None


def _read_part(part: Part, damage: DamagePolicy) -> Iterator[EvalSample]:
    """A part's samples, read about a shard of tokens at a time (store_schema.read_by_span:
    a span that fails is read again sample by sample, so only the damaged samples are named)."""
    def known(k: int) -> Damage | None:
        return damage.known_damage(part.index, k)

    def read_one(k: int) -> Sample | None:  # a sample already known damaged is not read
        return None if known(k) is not None else part.sample(k)

    sampled = _sampled(part)
    spans = sample_spans(np.diff(part.offsets()), part.store.shard_tokens)
    for k, sample, found in read_by_span(part.store.url, part.index, spans,
                                         lambda i, j: list(part.iter_samples(i, j)), read_one):
        found = known(k) or found
        if found is not None:
            damage.handle(found)
        else:
            yield EvalSample.from_sample(part.index, k, sample, sampled)


def padded_context(samples: list[EvalSample]) -> torch.Tensor:
    """Contexts [N, T, n, H] right-padded with zeros to the longest sample."""
    width = max(len(s.input_ids) for s in samples)
    first = samples[0].context
    out = first.new_zeros((len(samples), width, *first.shape[1:]))
    for b, s in enumerate(samples):
        out[b, : len(s.input_ids)] = s.context
    return out


ROW_NAMES = ("part", "sample", "source_row", "anchor", "tree_budget", "tau")
"""Per-block row columns: tree_budget is None for a chain's block, the node budget for a
DDTree's; tau is what that block committed."""


@dataclass
class CheckpointResults:
    """Everything measured for one checkpoint: each walk's metrics and rounds (the chain,
    and the DDTree of each budget) and the per-block rows."""

    name: str
    block_size: int
    settings: EvalSettings
    walks: dict[Budget, Walk] = field(init=False)
    """Per walk: None (the chain), then each DDTree budget."""
    rows: dict[str, list] = field(init=False)
    """Per block, in the order drafted (ROW_NAMES); `table()` orders them canonically."""

    def __post_init__(self) -> None:
        s = self.settings
        self.walks = {None: Walk(self.block_size, s.position_bin, s.recall_at)}
        self.walks |= {b: Walk(self.block_size, s.position_bin) for b in s.tree_budgets}
        self.rows = {n: [] for n in ROW_NAMES}

    def add(self, budget: Budget, blocks: list[tuple[EvalSample, int]],
            drafts: torch.Tensor | list[DraftTree], labels: torch.Tensor, valid: torch.Tensor
            ) -> list[int]:
        """Score blocks (sample, anchor) of `budget`'s walk against labels [M, B]: the
        chain's draft top-k ids [M, B, k], or one DDTree of `budget` nodes per block."""
        left, walk = tokens_left(blocks, self.block_size), self.walks[budget]
        if budget is None:
            taus = walk.stats.update(drafts, labels, valid, left).tolist()
        else:
            depth = [len(accepted_path(t, lab, ok)) for t, lab, ok in
                     zip(drafts, labels[:, 1:].tolist(), valid[:, 1:].tolist(), strict=True)]
            taus = committed_lengths(torch.tensor(depth, dtype=torch.long), left).tolist()
        walk.record([s.key for s, _ in blocks], [a for _, a in blocks], taus)
        for (s, anchor), tau in zip(blocks, taus, strict=True):
            for name, value in zip(ROW_NAMES, (s.part, s.index, s.source_row, anchor, budget,
                                               tau), strict=True):
                self.rows[name].append(value)
        return taus

    def table(self) -> dict[str, list]:
        """The per-block rows ordered by (walk, part, sample, anchor), whatever the batching;
        the chain's blocks first, then each budget's."""
        keys = list(zip((-1 if b is None else b for b in self.rows["tree_budget"]),
                        self.rows["part"], self.rows["sample"], self.rows["anchor"],
                        strict=True))
        order = sorted(range(len(keys)), key=keys.__getitem__)
        return {name: [self.rows[name][i] for i in order] for name in ROW_NAMES}

    def summary(self) -> EvalSummary:
        """Its column of the report: the chain's metrics plus each budget's DDTree rounds,
        each with its tau by anchor position."""
        return EvalSummary(self.walks)


@dataclass
class Agreement:
    """The store's agreement rate: P(stored next token == verifier argmax), assistant tokens."""

    matches: int = 0
    total: int = 0

    def add(self, s: EvalSample) -> None:
        m, t = agreement_counts(s.input_ids, s.top1, s.loss_mask)
        self.matches += m
        self.total += t

    @property
    def rate(self) -> float | None:
        return self.matches / self.total if self.total else None


def _runs(blocks: list[tuple[EvalSample, int]]) -> Iterator[tuple[EvalSample, torch.Tensor]]:
    """Consecutive blocks of one sample: (sample, anchors), so each costs one call."""
    start = 0
    while start < len(blocks):
        sample = blocks[start][0]
        stop = start
        while stop < len(blocks) and blocks[stop][0] is sample:
            stop += 1
        yield sample, torch.tensor([a for _, a in blocks[start:stop]])
        start = stop


def labels_for(blocks: list[tuple[EvalSample, int]], block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's choices as labels [M, B] (EvalSample.top1) and validity of blocks
    (sample, anchor)."""
    labels, valid = [], []
    for sample, anchors in _runs(blocks):
        lab, ok = block_labels(sample.top1[:, None], sample.loss_mask, anchors, block_size)
        labels.append(lab)
        valid.append(ok)
    return torch.cat(labels), torch.cat(valid)


def tokens_left(blocks: list[tuple[EvalSample, int]], block_size: int) -> torch.Tensor:
    """Per block (sample, anchor) [M]: the tokens the text holds after the anchor before its
    assistant turn ends, up to block_size. Live decoding ends the turn there (on its
    end-of-turn token, or at the token cap where the stored generation stopped), so a round
    at that anchor commits no more tokens than this: no bonus after drafts accepted up to
    the end. Counts position a+B too (block_label_mask of B+1 slots), which decides whether
    a fully accepted block is followed by a bonus."""
    out = []
    for sample, anchors in _runs(blocks):
        text = block_label_mask(sample.loss_mask, anchors, block_size + 1)[:, 1:]
        out.append(text.long().cumprod(dim=1).sum(dim=1))
    return torch.cat(out)


def draft_at(drafter: BlockDrafter, samples: list[EvalSample], anchors: list[torch.Tensor],
             top_k: int, blocks_per_forward: int, transitions: bool = False) -> list[Draft]:
    """Per sample, the draft [K_i, B, k] at its anchors [K_i]."""
    cache = drafter.context_cache(padded_context(samples))
    outs: list[list[Draft]] = [[] for _ in samples]
    longest = max((a.numel() for a in anchors), default=0)
    for start in range(0, longest, blocks_per_forward):
        rows = [r for r, a in enumerate(anchors) if a.numel() > start]
        chunk = [anchors[r][start : start + blocks_per_forward] for r in rows]
        width = max(c.numel() for c in chunk)
        # Short rows repeat their last anchor; those blocks are computed and dropped.
        pos = torch.stack([torch.cat([c, c[-1:].expand(width - c.numel())]) for c in chunk])
        tokens = torch.stack([samples[r].input_ids[p] for r, p in zip(rows, pos, strict=True)])
        drafted = drafter.draft(select_rows(cache, torch.tensor(rows)), pos, tokens, top_k,
                                transitions)
        for j, (r, c) in enumerate(zip(rows, chunk, strict=True)):
            outs[r].append(drafted[j, : c.numel()])
    return [cat_drafts(out, drafter.block_size, top_k) for out in outs]


def evaluate_all(drafter: BlockDrafter, samples: list[EvalSample], results: CheckpointResults,
                 settings: EvalSettings, top_k: int) -> None:
    """--mode all: one block at every eligible anchor of every sample, the chain and a DDTree
    of each budget drafted from the same pass."""
    anchors = [eligible_anchors(s.loss_mask) for s in samples]
    trees = bool(settings.tree_budgets)
    drafted = cat_drafts(draft_at(drafter, samples, anchors, top_k, settings.blocks_per_forward,
                                  trees), drafter.block_size, top_k)
    blocks = [(s, int(a)) for s, an in zip(samples, anchors, strict=True) for a in an.tolist()]
    if not blocks:
        return
    labels, valid = labels_for(blocks, drafter.block_size)
    for budget in results.walks:
        scorer(results, budget)(blocks, drafted, labels, valid)


Scorer = Callable[[list[tuple[EvalSample, int]], Draft, torch.Tensor, torch.Tensor], list[int]]
"""Scores one step's blocks (sample, anchor) from their draft [M, B, k] and labels [M, B]
into the results; returns each block's tau (the walk's next anchor is a + tau)."""


def walk_replay(drafter: BlockDrafter, samples: list[EvalSample], cache, top_k: int,
                score: Scorer, transitions: bool = False) -> None:
    """One replay walk of every sample: the anchors live decoding visits (first response
    token, then a + tau), one step of every sequence at a time."""
    taus = [1] * len(samples)
    walks = [replay_anchors(s.loss_mask, lambda _a, r=r: taus[r]) for r, s in
             enumerate(samples)]
    active = list(range(len(samples)))
    while active:
        step = []
        for r in active:
            anchor = next(walks[r], None)  # reads taus[r] of the previous step first
            if anchor is not None:
                step.append((r, anchor))
        active = [r for r, _ in step]
        if not step:
            break
        rows = torch.tensor(active)
        pos = torch.tensor([[a] for _, a in step])
        tokens = torch.stack([samples[r].input_ids[a : a + 1] for r, a in step])
        drafted = drafter.draft(select_rows(cache, rows), pos, tokens, top_k, transitions)
        blocks = [(samples[r], a) for r, a in step]
        labels, valid = labels_for(blocks, drafter.block_size)
        step_taus = score(blocks, drafted[:, 0], labels, valid)
        for (r, _), tau in zip(step, step_taus, strict=True):
            taus[r] = tau


def scorer(results: CheckpointResults, budget: Budget) -> Scorer:
    """Scores blocks into `budget`'s walk: the chain's drafts, or the DDTree of `budget`
    nodes grown from each block's draft."""
    def score(blocks, d, labels, valid):
        drafts = d.ids if budget is None else [grow_tree(d.tree_candidates(m), budget)
                                               for m in range(len(blocks))]
        return results.add(budget, blocks, drafts, labels, valid)

    return score


def evaluate_replay(drafter: BlockDrafter, samples: list[EvalSample],
                    results: CheckpointResults, top_k: int) -> None:
    """--mode replay: the chain's walk, then each budget's DDTree walk (its next anchor is
    a + its own tau, as a tree decoder moves on), all over one context cache."""
    cache = drafter.context_cache(padded_context(samples))
    for budget in results.walks:
        walk_replay(drafter, samples, cache, top_k, scorer(results, budget),
                    transitions=budget is not None)


def evaluate_offline(
    drafters: dict[str, BlockDrafter],
    samples: Iterable[EvalSample],
    settings: EvalSettings,
    on_batch: Callable[[list[EvalSample]], None] | None = None,
) -> tuple[dict[str, CheckpointResults], Agreement]:
    """Replay every checkpoint on the same samples; results per checkpoint name."""
    results = {name: CheckpointResults(name, d.block_size, settings)
               for name, d in drafters.items()}
    agreement = Agreement()
    for batch in padded_batches(samples, lambda s: len(s.input_ids), settings.batch_tokens):
        for s in batch:
            agreement.add(s)
        for name, drafter in drafters.items():
            top_k = settings.top_k(drafter.config.vocab_size)
            if settings.mode == "all":
                evaluate_all(drafter, batch, results[name], settings, top_k)
            else:
                evaluate_replay(drafter, batch, results[name], top_k)
        if on_batch is not None:
            on_batch(batch)
    return results, agreement
