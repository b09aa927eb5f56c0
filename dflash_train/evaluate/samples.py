"""The held-out samples `dflash eval` reads, and what a sample says of a block drafted in it.

`EvalSample` is one stored sequence as evaluation needs it: its tokens, loss mask, context
features and the target's choice of next token at each position (`top1`: the verifier's
argmax, or on a sampled store the stored next token; set here, once, where samples are read).
`sample_keys`, `pick_samples` and `read_samples` choose and stream them from a store, a
damaged one handed to a DamagePolicy. A block is a (sample, anchor): `labels_for` gives its
labels (dflash_train.blocks.block_labels over `top1`) and `tokens_left` the tokens its text
holds after the anchor, which bound what live decoding can commit there.

Offline replay, `--online`, `--served`, the results and training's validation all read these.
This module never loads a model and never writes the store.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dflash_train.blocks import block_label_mask, block_labels
from dflash_train.evaluate.damage import DamagePolicy
from dflash_train.store_schema import Damage, Part, Sample, Store, read_guarded
from dflash_train.store_schema.integrity import read_by_span
from dflash_train.store_schema.part import sample_spans


@dataclass
class EvalSample:
    """One stored sequence, as evaluation needs it."""

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


def _by_sample(blocks: list[tuple[EvalSample, int]]) -> Iterator[tuple[EvalSample, torch.Tensor]]:
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
    for sample, anchors in _by_sample(blocks):
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
    for sample, anchors in _by_sample(blocks):
        text = block_label_mask(sample.loss_mask, anchors, block_size + 1)[:, 1:]
        out.append(text.long().cumprod(dim=1).sum(dim=1))
    return torch.cat(out)
