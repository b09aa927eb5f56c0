"""The one summary type of `dflash eval`: what a run (offline replay, --online, --served)
measured for one checkpoint. It is the report's column, the table's column and the plot's
line, whatever the run, so a new decode mode fills this type rather than a dict of its own."""

from dataclasses import dataclass, field
from typing import Literal

from dflash_train.evaluate.metrics import Budget, Walk

RunLabel = Literal["offline", "online", "served"]
"""Which run a summary is of: its key in the report's checkpoint entry."""
RUN_LABELS: tuple[RunLabel, ...] = ("offline", "online", "served")
"""Every run, in the report's order (a run not made is null there)."""


@dataclass
class EvalSummary:
    """One checkpoint's figures from one run; `to_json` is its report column."""

    walks: dict[Budget, Walk]
    """The chain's walk (None: committed tokens per block, streaks and per-slot acceptance in
    our convention, tau by anchor position) and each DDTree budget's (its tau); a run whose
    drafts' top-k is not visible (served) has the chain's only."""
    sees_drafts: bool = True
    """Every slot's draft and its top-k are visible (offline, --online). A serving engine
    shows only what it committed: its slot accuracy and top-k recall are unknown (null)."""
    engine: dict[str, dict] = field(default_factory=dict)
    """A serving engine's own figures, by report key ("vllm": its counters in its own
    convention, "info": versions and what it resolved the drafter as, "speed": decode speed
    with and without the drafter)."""

    def to_json(self) -> dict:
        chain = self.walks[None]
        out = chain.stats.summary()
        if not self.sees_drafts:
            out["slot_accuracy"] = [None] * (chain.stats.block_size - 1)
            out["topk_recall"] = {}
        tree = {str(b): w.tree_summary() for b, w in self.walks.items() if b is not None}
        return {**out, "block_size": chain.stats.block_size,
                "tau_by_position": chain.positions.summary(), "tree": tree, **self.engine}
