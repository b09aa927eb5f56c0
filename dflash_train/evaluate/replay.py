"""Offline replay: draft blocks against the store's target states and score them.

For each batch of stored sequences, every checkpoint drafts the same blocks:
- `--mode all`: one block at every eligible anchor (dflash_train.blocks.eligible_anchors);
- `--mode replay`: the anchors live greedy decoding would visit (dflash_train.blocks.replay_anchors:
  first response token, then a + tau). Sequential within a sequence, batched across the
  sequences of a batch step by step.
A block's labels are the target's choice at a+k-1 (dflash_train.blocks.block_labels): the stored
verifier argmax, or on a sampled store (StoreMeta.sampling) the stored next token, the target's
own draw there (EvalSample.top1, set once where samples are read: samples.py); its
draft is the drafter's per-slot top-k, led by what it proposes (a DFlash 2 drafter: its
selector walk, drafting.BlockDrafter.draft), and the replay's next anchor follows that draft.
Its tau is the tokens live decoding would commit there: the accepted drafts plus the target's
bonus token, unless the stored text ends inside those drafts (the end-of-turn token or the
token cap was drafted), where no bonus follows (samples.tokens_left). Metrics accumulate in
results.CheckpointResults.

This module is the walk and the drafting it scores: the samples (samples.py), the settings
(config.EvalSettings) and the results (results.py) have homes of their own.

Offline tau equals live speculative decoding (evaluate.online: a full block every round, as
serving engines draft) only when the store holds the target's own continuation (extract
--regenerate): greedy, where the store's agreement rate says how far it does; or sampled with
a seed, equal to live sample-and-match with that seed by construction (§8a). This module never
loads the target model and never writes files.
"""

from collections.abc import Callable, Iterable

import torch

from dflash_train.batching import padded_batches
from dflash_train.blocks import eligible_anchors, replay_anchors
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.drafting import BlockDrafter, Draft, cat_drafts, select_rows
from dflash_train.evaluate.metrics import Budget
from dflash_train.evaluate.results import Agreement, CheckpointResults
from dflash_train.evaluate.samples import EvalSample, labels_for
from dflash_train.evaluate.tree import grow_tree


def padded_context(samples: list[EvalSample]) -> torch.Tensor:
    """Contexts [N, T, n, H] right-padded with zeros to the longest sample."""
    width = max(len(s.input_ids) for s in samples)
    first = samples[0].context
    out = first.new_zeros((len(samples), width, *first.shape[1:]))
    for b, s in enumerate(samples):
        out[b, : len(s.input_ids)] = s.context
    return out


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
