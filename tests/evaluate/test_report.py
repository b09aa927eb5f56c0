"""The terminal table of `dflash eval`: what it shows of the streak histogram."""

import torch

from dflash_train.blocks import IGNORE_LABEL
from dflash_train.evaluate.metrics import AcceptanceStats
from dflash_train.evaluate.report import format_table

B = 16


def _summary(streaks: list[int]) -> dict:
    """Metrics of blocks whose drafts match their labels for exactly `streaks[i]` slots."""
    labels = torch.arange(B).repeat(len(streaks), 1)
    labels[:, 0] = IGNORE_LABEL
    draft = labels.clone()
    for i, s in enumerate(streaks):
        draft[i, s + 1:] = -1  # slots 1..s right, slot s+1 wrong
    stats = AcceptanceStats(block_size=B, recall_at=(1,))
    stats.update(draft, labels, labels != IGNORE_LABEL)
    return {**stats.summary(), "block_size": B}  # as CheckpointResults.summary adds it


def _report(columns: dict[str, list[int]]) -> dict:
    return {"store": "s.zarr", "mode": "replay", "samples": 1, "limit": None, "seed": 0,
            "agreement": {"matches": 1, "total": 1, "rate": 1.0}, "warning": None,
            "tree_budgets": [], "recall_at": [1], "skipped": None, "online_check": None,
            "checkpoints": [{"name": name, "offline": _summary(streaks), "online": None}
                            for name, streaks in columns.items()]}


def _histogram(text: str) -> list[list[str]]:
    lines = text.split("streak histogram (blocks)\n", 1)[1].splitlines()
    return [line.split() for line in lines[1:]]


def test_the_streak_histogram_stops_after_the_longest_streak_any_checkpoint_reached():
    rows = _histogram(format_table(_report({"untrained": [0, 0, 0, 1], "trained": [0, 2, 3]})))
    assert rows == [["0", "3", "1"], ["1", "1", "0"], ["2", "0", "1"], ["3", "0", "1"],
                    ["4..15", "0", "0"]]


def test_a_full_block_keeps_every_row_of_the_streak_histogram():
    rows = _histogram(format_table(_report({"d": [0, B - 1]})))
    assert [r[0] for r in rows] == [str(s) for s in range(B)]
    assert rows[0][1] == rows[-1][1] == "1" and {r[1] for r in rows[1:-1]} == {"0"}


def test_one_missing_streak_length_is_named_alone():
    rows = _histogram(format_table(_report({"d": [B - 2]})))
    assert rows[-2:] == [["14", "1"], ["15", "0"]]
