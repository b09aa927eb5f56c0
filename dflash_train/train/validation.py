"""Validation during training: at every checkpoint the drafter is replayed offline on stores
held back from training (--val-store) by evaluate.replay, the code `dflash eval` runs, and
its figures join that step's record; the best checkpoint so far follows them (train.best).

Owns what a validation store is refused for (another target or layer set, a sample shared
with a train store or with another validation store, nothing to draft at, damage unless the
run skips it: loader.skip_corrupt rules validation's reads as it rules training's, and the
same samples are skipped at every checkpoint, so the figures stay comparable) and how the ranks'
replays become one figure: each rank replays its share of the samples, and the ranks' tau
histograms are merged (integer counts summed) before any mean is taken, so a figure is the
same whatever the batch size or the number of ranks. Never trains, never writes a file,
never loads the target.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflash_train.blocks import eligible_anchors
from dflash_train.drafter import DFlashDrafter, DrafterConfig
from dflash_train.evaluate.checkpoints import layer_selection
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.damage import DamagePolicy, check_store
from dflash_train.evaluate.drafting import BlockDrafter
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.metrics import Budget, Walk
from dflash_train.evaluate.replay import evaluate_offline
from dflash_train.evaluate.results import CheckpointResults
from dflash_train.evaluate.samples import pick_samples, read_samples, sample_keys
from dflash_train.store_schema import Part, Store, StoreError, open_store
from dflash_train.store_schema.integrity import read_by_span
from dflash_train.store_schema.part import sample_spans
from dflash_train.train.config import ValidationConfig
from dflash_train.train.errors import TrainError
from dflash_train.train.parallel import gather_objects
from dflash_train.train.record import StoreFigures, ValidationFigures

if TYPE_CHECKING:
    from dflash_train.train.checkpoint import TrainState

Echo = Callable[[str], None]
SampleKey = tuple[int, int]
"""(part, sample index) of a sample in its store."""

_READ_TOKENS = 1 << 20
"""Tokens of input_ids (and loss_mask) read at a time by the sample-identity pass."""


@dataclass
class ValidationStore:
    """One validation store, opened and checked, and the samples this rank replays."""

    url: str
    store: Store
    damage: DamagePolicy
    mine: list[SampleKey]
    """This rank's share of the chosen samples (every W-th), in store order."""


class Validation:
    """The validation stores of a run and how its drafter is measured on them."""

    def __init__(self, stores: list[ValidationStore], settings: EvalSettings,
                 layer_index: list[int] | None, world: int):
        self.stores = stores
        self.settings = settings
        self.layer_index = layer_index
        """The drafter's context layers among the stores' (all of them share the train
        stores' layer set)."""
        self.world = world

    def evaluate(self, model: DFlashDrafter) -> ValidationFigures:
        """Replay `model` (its target head attached) on every store; a collective under
        torchrun: every rank calls it and gets the same figures. `model` is left in the
        mode it was in."""
        start = time.perf_counter()
        training = model.training
        model.eval()
        try:
            drafter = BlockDrafter(model, self.layer_index)
            mine, failure = [self._replay(drafter, s) for s in self.stores], None
        except TrainError as e:  # told to the other ranks first, so that none waits forever
            mine, failure = None, str(e)
        finally:
            model.train(training)
        ranks = gather_objects((mine, failure), self.world)
        _raise_first_failure(failure for _, failure in ranks)
        per_store = [self._merged(shares)  # [rank][store] -> walks
                     for shares in zip(*(replays for replays, _ in ranks), strict=True)]
        pooled = self._merged([r.walks for r in per_store])
        return ValidationFigures(
            pooled=_figures(pooled.walks), tau_ci95=pooled.walks[None].taus.summary()["tau_ci95"],
            stores={s.url: _figures(r.walks) for s, r in zip(self.stores, per_store,
                                                              strict=True)},
            seconds=time.perf_counter() - start)

    def _replay(self, drafter: BlockDrafter, store: ValidationStore):
        try:
            results, _ = evaluate_offline({store.url: drafter},
                                          read_samples(store.store, store.mine, store.damage),
                                          self.settings)
        except (StoreError, EvalError) as e:
            raise TrainError(f"--val-store {store.url}: {e}") from e
        walks = results[store.url].walks
        for walk in walks.values():  # counts cross ranks; merging never reads the rounds
            walk.rounds = {}
        return walks

    def _merged(self, shares: Sequence[dict[Budget, Walk]]) -> CheckpointResults:
        """One result whose counts are the sum of every share's (a rank's, or a store's)."""
        out = CheckpointResults("validation", shares[0][None].stats.block_size, self.settings)
        for walks in shares:
            for budget, walk in walks.items():
                out.walks[budget].merge(walk)
        return out


def _raise_first_failure(failures) -> None:
    """Raise, on every rank alike, the first rank's refusal (None: that rank had none)."""
    for failure in failures:
        if failure is not None:
            raise TrainError(failure)


def _figures(walks: dict[Budget, Walk]) -> StoreFigures:
    """The figures kept of a replay's walks: the chain's and each tree's tau."""
    taus = {b: w.taus.summary() for b, w in walks.items()}
    return StoreFigures(tau=taus[None]["mean_tau"], blocks=taus[None]["n"],
                        tree_tau={b: t["mean_tau"] for b, t in taus.items() if b is not None})


def best_value(figures: ValidationFigures, cfg: ValidationConfig) -> float | None:
    """The figure validation.best_by follows, pooled over the stores."""
    if cfg.best_by == "tau":
        return figures.pooled.tau
    return figures.pooled.tree_tau[cfg.tree_budgets[-1]]


def follow_best(state: TrainState, figures: ValidationFigures, cfg: ValidationConfig) -> bool:
    """Count the validation of `state.step` in the run's best so far: True when it beats
    every earlier one (a tie keeps the earlier, less trained checkpoint)."""
    value = best_value(figures, cfg)
    improved = value is not None and (state.best_value is None or value > state.best_value)
    if improved:
        state.best_step, state.best_value, state.evaluations_since_best = state.step, value, 0
    else:
        state.evaluations_since_best += 1
    figures.best_step = state.best_step
    return improved


def patience_spent(state: TrainState, patience: int | None) -> bool:
    """run.patience validations in a row have not beaten the best one."""
    return patience is not None and state.evaluations_since_best >= patience


def open_validation(cfg: ValidationConfig, train_stores: list[Store], train_parts,
                    drafter: DrafterConfig, rank: int, world: int, say: Echo,
                    skip_corrupt: bool = False) -> Validation | None:
    """The run's validation stores, refused here (on every rank, before anything is written)
    when one is of another target or layer set than the train stores, holds nothing to
    draft at, shares a sample with a train store or another validation store, or is damaged
    and `skip_corrupt` (the run's loader.skip_corrupt) is not set.
    train_parts: the (store index, Part) the run trains on (StoreLoader.parts)."""
    if not cfg.stores:
        return None
    reference = train_stores[0]
    stores, seen = [], {}
    for url in cfg.stores:
        opened = _open(url, reference, skip_corrupt, say)
        chosen = _chosen_samples(opened, cfg)
        _hash_validation_samples(opened, chosen, seen)
        stores.append(ValidationStore(url, opened.store, opened.damage, chosen[rank::world]))
    _refuse_shared_with_training(seen, train_stores, train_parts, rank, world, skip_corrupt)
    settings = EvalSettings(mode="replay", tree_budgets=cfg.tree_budgets, recall_at=(1,),
                            batch_tokens=cfg.batch_tokens)
    index = layer_selection(drafter, reference.meta)
    return Validation(stores, settings, index, world)


@dataclass
class _Opened:
    url: str
    store: Store
    damage: DamagePolicy


def _open(url: str, reference: Store, skip_corrupt: bool, say: Echo) -> _Opened:
    """The store at `url`, refused unless it holds the train stores' target and layers
    (the rule a resume and eval apply: StoreMeta.target_mismatches) and reads whole, or
    its damage is skipped (`skip_corrupt`)."""
    try:
        store = open_store(url)
        damage = check_store(store, skip=skip_corrupt)
    except (StoreError, EvalError) as e:
        raise TrainError(f"--val-store {url}: {e}") from e
    diffs = reference.meta.target_mismatches(store.meta)
    if diffs:
        raise TrainError(f"--val-store {url} is a store of another target or layer set than "
                         f"--store {reference.url} (train != validation): {'; '.join(diffs)}")
    if damage.unfinished:
        say(f"--val-store {url}: leaving out unfinished parts {damage.unfinished} (extraction "
            "has not completed them)")
    if damage.known:
        more = f" (and {len(damage.known) - 1} more)" if len(damage.known) > 1 else ""
        say(f"--val-store {url}: skipping damaged data (--skip-corrupt): {damage.known[0]}"
            f"{more}")
    return _Opened(url, store, damage)


def _chosen_samples(opened: _Opened, cfg: ValidationConfig) -> list[SampleKey]:
    """The samples every validation replays: validation.limit of them drawn with its seed
    (eval's --limit / --seed draw), else all; refused when there is none."""
    keys = sample_keys(opened.store, opened.damage)
    if not keys:
        raise TrainError(f"--val-store {opened.url} holds no sample in a complete part: "
                         "nothing to validate on; extract it first, or drop it")
    return pick_samples(opened.store, cfg.limit, cfg.seed, opened.damage) or keys


def _hash_validation_samples(opened: _Opened, chosen: list[SampleKey],
                             seen: dict[bytes, str]) -> None:
    """Record the identity of every sample of the store in `seen` (token ids' digest ->
    where), refusing one another validation store holds too (the same store given twice, by
    one path or two, counts its samples twice), and a store whose chosen samples have no
    response token to draft at. A row the store itself holds twice is accepted, as extract,
    train and eval accept it: a source may repeat a prompt."""
    chosen_set, draftable, own = set(chosen), 0, set()
    parts = [p for p in opened.store.parts() if not opened.damage.part_is_left_out(p.index)]
    try:
        for part, i, ids, mask in _samples(parts, ("input_ids", "loss_mask"), opened.damage):
            digest = _digest(ids)
            if digest in seen and digest not in own:
                raise TrainError(f"--val-store {_where(opened.url, part, i)} holds the same "
                                 f"token ids as --val-store {seen[digest]}: a sample counted "
                                 "twice; give each validation store once, with samples of "
                                 "its own")
            own.add(digest)
            seen.setdefault(digest, _where(opened.url, part, i))
            if (part.index, i) in chosen_set and eligible_anchors(torch.from_numpy(mask)).numel():
                draftable += 1
    except (StoreError, EvalError) as e:
        raise TrainError(f"--val-store {opened.url}: {e}") from e
    if not draftable:
        raise TrainError(f"--val-store {opened.url}: none of the {len(chosen)} samples chosen "
                         "has a response token to draft at (empty loss masks?): nothing to "
                         "validate on")


def _refuse_shared_with_training(seen: dict[bytes, str], train_stores: list[Store],
                                 train_parts, rank: int, world: int, skip_corrupt: bool) -> None:
    """Refuse (on every rank alike) when a train sample has the token ids of a validation
    sample: the figures would reward memorising it. Rank r reads every W-th train part; a
    train sample that cannot be read is skipped (`skip_corrupt`: training skips it too)."""
    found: list[tuple[str, str]] = []
    failure = None
    mine = [(i, p) for n, (i, p) in enumerate(train_parts) if n % world == rank]
    damage = DamagePolicy(skip=skip_corrupt)
    for store_index, part in mine:
        url = train_stores[store_index].url
        try:
            for p, i, ids in _samples([part], ("input_ids",), damage):
                if (where := seen.get(_digest(ids))) is not None:
                    found.append((where, _where(url, p, i)))
        except (StoreError, EvalError) as e:  # told to the other ranks first: none waits
            failure = f"--store {url}: {e}"
            break
    ranks = gather_objects((found, failure), world)
    _raise_first_failure(failure for _, failure in ranks)
    shared = [pair for rank_found, _ in ranks for pair in rank_found]
    if shared:
        val, train = shared[0]
        raise TrainError(f"--val-store {val} has the same token ids as --store {train} "
                         f"({len(shared)} validation sample(s) shared with the train stores): "
                         "validate on samples never trained on (another store, from other "
                         "prompts)")


def _samples(parts: list[Part], names: tuple[str, ...], damage: DamagePolicy
             ) -> Iterator[tuple]:
    """(part, index, *arrays) of every committed sample of `parts`, read a span at a time; a
    damaged one (known before reading, or failing its read) is handed to `damage`, which
    refuses it (EvalError) or skips it, as replay does."""
    for part in parts:
        offsets = part.offsets()
        spans = sample_spans(np.diff(offsets), _READ_TOKENS)
        read = partial(_read_span, part, offsets, names)
        for i, arrays, failed in read_by_span(part.store.url, part.index, spans, read,
                                              lambda i, read=read: read(i, i + 1)[0]):
            found = damage.known_damage(part.index, i) or failed
            if found is not None:
                damage.handle(found)
                continue
            yield part, i, *arrays


def _read_span(part: Part, offsets: np.ndarray, names: tuple[str, ...], start: int,
               stop: int) -> list[tuple]:
    """The arrays `names` of samples [start, stop) of `part`, one tuple per sample."""
    base = int(offsets[start])
    arrays = part.read_tokens(base, int(offsets[stop]), names)
    return [tuple(arrays[n][int(offsets[i]) - base:int(offsets[i + 1]) - base] for n in names)
            for i in range(start, stop)]


def _digest(ids: np.ndarray) -> bytes:
    """A sample's identity: its token ids (int32, as every store holds them), hashed."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(),
                           digest_size=16).digest()


def _where(url: str, part: Part, index: int) -> str:
    return f"{url} part {part.index} sample {index} (source row {int(part.sources()[index])})"
