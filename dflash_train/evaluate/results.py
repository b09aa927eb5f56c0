"""What `dflash eval` measures, and the types every run's results share.

`CheckpointResults` is one checkpoint's figures from offline replay or `--online`: each
walk's metrics and rounds (the chain, and the DDTree of each budget) and the per-block rows
(`ROW_NAMES`); `Agreement` the store's agreement rate. `AnyCheckpointResults` is what the
report, the table and the checks read of one checkpoint's results whatever the run
(CheckpointResults, or engines.shared.ServedResults for `--served`), and `ModeResults` a
run's results for every checkpoint with its rounds for the agreement check. Replay
(replay.py) and the live loop (online.py) fill these; nothing here drafts, decodes or reads
the store.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflash_train.evaluate.agreement import Decoded
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.metrics import Budget, Walk, agreement_counts, committed_lengths
from dflash_train.evaluate.samples import EvalSample, tokens_left
from dflash_train.evaluate.summary import EvalSummary, RunLabel
from dflash_train.evaluate.tree import DraftTree, accepted_path

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


class AnyCheckpointResults(Protocol):
    """One checkpoint's results, whatever the run made them (CheckpointResults for offline
    replay and --online, engines.shared.ServedResults for --served)."""

    walks: dict[Budget, Walk]
    """Per walk (None: the chain, else a DDTree budget): its metrics and rounds."""

    def summary(self) -> EvalSummary:
        """Its report column."""

    def table(self) -> dict[str, list]:
        """Its per-block rows (ROW_NAMES), ordered by (walk, part, sample, anchor)."""


@dataclass
class ModeResults:
    """What one run (offline replay, or a decode mode) measured for every checkpoint."""

    label: RunLabel
    results: dict[str, AnyCheckpointResults]
    """Per checkpoint name."""
    decoded: dict[str, Decoded]
    """Per checkpoint name: text and rounds per prompt, for the agreement check."""
    live_rounds: bool = True
    """Its rounds are the ones live decoding makes (offline: only in --mode replay), so later
    runs are checked against them."""
    check: dict | None = None
    """Its agreement check, as the report writes it (`<label>_check`)."""
