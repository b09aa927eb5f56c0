"""A store's summary for people: what it holds, how big it is, how far extraction got."""

from dataclasses import dataclass

import numpy as np
from zarr.core.sync import sync

from dflash_train.store_schema.errors import StoreError
from dflash_train.store_schema.layout import SAMPLE_ARRAYS, part_path, token_arrays
from dflash_train.store_schema.meta import StoreMeta
from dflash_train.store_schema.store import Store


@dataclass
class StoreSummary:
    """Counts and sizes of a store (committed data only)."""

    samples: int
    tokens: int
    parts_planned: int
    parts_complete: int
    parts_incomplete: list[int]
    parts_missing: list[int]
    """Planned parts not started (no part group, or one whose creation a crash cut short)."""
    parts_damaged: list[int]
    """Parts whose metadata cannot be read: neither counted nor sized; `store validate`."""
    frozen_damaged: list[str]
    """Target rows or carried files whose metadata is torn or whose chunks are missing
    (checksums are validate's: info reads no data)."""
    frozen_unfinished: bool
    """The frozen unit (target rows, config, tokenizer) is not all written: its writing was
    cut short or is under way (frozen.py); readers refuse the store until extract ends it."""
    bytes_on_disk: int
    """Every object in the store, target rows and tokenizer included."""
    part_bytes_on_disk: int
    """Objects of the readable parts."""
    part_tokens_on_disk: int
    """Tokens the readable parts' arrays hold: the committed ones, and, in a part being
    written, those of whole shards already written ahead of their commit record."""
    logical_part_bytes: int
    """Uncompressed size of those tokens' arrays."""
    context_bytes_on_disk: int = 0
    """Objects of the readable parts' context (with an fp8 store's scales)."""

    @property
    def bytes_per_token(self) -> float | None:
        """Stored bytes per token of the readable parts; None while they hold none."""
        if not self.part_tokens_on_disk:
            return None
        return self.part_bytes_on_disk / self.part_tokens_on_disk

    @property
    def context_bytes_per_token(self) -> float | None:
        """Stored context bytes per token (fp8 scales included); None while there is none."""
        if not self.part_tokens_on_disk:
            return None
        return self.context_bytes_on_disk / self.part_tokens_on_disk

    @property
    def compression_ratio(self) -> float | None:
        """Uncompressed / stored size of the readable parts; None while they hold no token."""
        if not (self.part_tokens_on_disk and self.part_bytes_on_disk and self.logical_part_bytes):
            return None
        return self.logical_part_bytes / self.part_bytes_on_disk


def answers_description(meta: StoreMeta) -> str:
    """Whose answers the store holds and how they were drawn, for `store info`: the
    dataset's, the target's greedy ones, or the target's sampled at a temperature and seed
    (by our keyed sampler, or by a server's own stream)."""
    if not meta.source.regenerated:
        return "the dataset's (not regenerated)"
    s = meta.sampling
    if s is None:
        return "the target's, greedy"
    drawn = (f"sampled by a server at {sampling_settings(s)}, a seed per request from seed "
             f"{s['seed']}: in-distribution only (no live decode draws these tokens again)"
             if meta.server_drawn else
             f"sampled at {sampling_settings(s)} with seed {s['seed']}")
    return f"the target's, {drawn}"


def sampling_settings(s: dict) -> str:
    """A store's sampling settings (StoreMeta.sampling) as its reports write them."""
    top_p = "off" if s["top_p"] == 1 else s["top_p"]
    return f"temperature {s['temperature']} (top-p {top_p}, top-k {s['top_k'] or 'off'})"


def summarize(store: Store) -> StoreSummary:
    zstore = store.root.store
    prefix = store.root.path
    damaged = store.unreadable_parts()
    parts, held = [], []
    names = [a.name for a in token_arrays(store.meta.context_dtype)]
    for p in store.parts():
        try:
            for name in names + list(SAMPLE_ARRAYS):
                p.array(name)
            # The context array's length is what the writer has sized and written (it grows
            # before the data lands); every token array of a part has the same length.
            held.append(p.array("context").shape[0])
            parts.append(p)
        except StoreError:  # an array's metadata is torn: damaged, like a torn part
            damaged.append(p.index)
    per_token = _bytes_per_token(parts[0]) if parts else 0
    present = {p.index for p in parts} | set(damaged)
    return StoreSummary(
        samples=sum(p.num_samples for p in parts),
        tokens=sum(p.num_tokens for p in parts),
        parts_planned=store.meta.num_parts,
        parts_complete=sum(p.complete for p in parts),
        parts_incomplete=[p.index for p in parts if not p.complete],
        parts_missing=[i for i in range(store.meta.num_parts) if i not in present],
        parts_damaged=sorted(damaged),
        frozen_damaged=[path for path in store.frozen_paths()
                        if store.frozen_problem(path, read_data=False) is not None],
        frozen_unfinished=store.frozen_record().state == "unfinished",
        bytes_on_disk=sync(zstore.getsize_prefix(prefix)) if prefix else _total(zstore),
        part_bytes_on_disk=sum(sync(zstore.getsize_prefix(
            "/".join(x for x in (prefix, part_path(p.index)) if x))) for p in parts),
        part_tokens_on_disk=sum(held),
        logical_part_bytes=per_token * sum(held),
        context_bytes_on_disk=sum(sync(zstore.getsize_prefix("/".join(
            x for x in (prefix, part_path(p.index), name) if x))) for p in parts
            for name in names if name.startswith("context")),
    )


def _bytes_per_token(part) -> int:
    """Uncompressed bytes of one token across a part's token arrays (the same in every part:
    the schema fixes them)."""
    try:
        return sum(part.array(spec.name).dtype.itemsize
                   * max(1, _prod(part.array(spec.name).shape[1:]))
                   for spec in token_arrays(part.store.meta.context_dtype))
    except StoreError:
        return 0


def _total(zstore) -> int:
    async def total():
        n = 0
        async for key in zstore.list():
            n += await zstore.getsize(key)
        return n

    return sync(total())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _label_windows(store: Store, window: int):
    """(answer tokens, the forward's stored top-k ids at the token before each, argmax first)
    of the readable parts' committed samples, `window` tokens at a time: every hard label a
    drafter trains on."""
    damaged = set(store.unreadable_parts())
    for p in store.parts():
        if p.index in damaged or not p.num_tokens:
            continue
        starts = p.offsets()[:-1]
        for lo in range(0, p.num_tokens, window):
            a, hi = max(lo - 1, 0), min(p.num_tokens, lo + window)
            t = p.read_tokens(a, hi, ("input_ids", "loss_mask", "verifier_topk_ids"))
            # label positions a+1 .. hi-1, each predicted by the token before it
            keep = t["loss_mask"][1:] & ~np.isin(np.arange(a + 1, hi), starts)
            yield t["input_ids"][1:][keep], t["verifier_topk_ids"][:-1][keep]


def top1_agreement(store: Store, window: int = 1 << 18) -> tuple[int, int]:
    """(answer tokens equal to the extract forward's top-1 at the token before them, answer
    tokens) over the readable parts' committed samples. On a greedy regenerated store
    anything short of all of them is generation drift (a server's kernels or dtype against
    this forward), and offline replay equals live decoding only where they agree. A sampled
    store (StoreMeta.sampling) falls short by design: its answers are draws, not the top-1."""
    agree = total = 0
    for answer, topk in _label_windows(store, window):
        agree += int((answer == topk[:, 0]).sum())
        total += int(answer.size)
    return agree, total


def topk_agreement(store: Store, window: int = 1 << 18) -> tuple[int, int]:
    """(answer tokens among the extract forward's stored top-k at the token before them,
    answer tokens): top1_agreement's check for sampled answers, which are draws, not the
    top-1, but of the same weights lie among its most probable tokens nearly always."""
    within = total = 0
    for answer, topk in _label_windows(store, window):
        within += int((topk == answer[:, None]).any(axis=1).sum())
        total += int(answer.size)
    return within, total


def label_counts(store: Store, window: int = 1 << 18) -> np.ndarray:
    """How often each vocabulary id is a hard label (the forward's top-1 before an answer
    token) in the store's readable parts: int64 [vocab_size], one streaming pass."""
    counts = np.zeros(store.meta.target.vocab_size, dtype=np.int64)
    for _, topk in _label_windows(store, window):
        counts += np.bincount(topk[:, 0].astype(np.int64), minlength=counts.size)[:counts.size]
    return counts
