"""The terminal table of `dflash eval`: what it shows of the streak histogram and of tau by
anchor position; the plot's panels."""

import re

import pytest
import torch

from dflash_train.blocks import IGNORE_LABEL
from dflash_train.evaluate.metrics import AcceptanceStats, PositionBins
from dflash_train.evaluate.report import format_table, plot_acceptance

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


def _by_position(width: int, blocks: list[tuple[int, int]]) -> dict:
    """tau_by_position of blocks (anchor, tau)."""
    bins = PositionBins(width, B)
    bins.update(torch.tensor([a for a, _ in blocks]), torch.tensor([t for _, t in blocks]))
    return bins.summary()


def _position_rows(text: str) -> list[list[str]]:
    lines = text.split("tau by anchor position from the sequence start (bins of 8 tokens)",
                       1)[1].splitlines()
    return [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]


def test_tau_by_position_has_a_row_per_bin_and_a_dash_where_a_column_has_no_blocks():
    report = _report({"a": [0, 1], "b": [2]})
    a, b = (c["offline"] for c in report["checkpoints"])
    a["tau_by_position"] = _by_position(8, [(5, 2), (7, 4), (30, 1)])
    b["tau_by_position"] = _by_position(8, [(9, 3)])
    rows = _position_rows(format_table(report))
    # bin 0..7: taus 2, 4: mean 3, half-width 1.96 * stdev / sqrt(2) = 1.96 * sqrt(2) / sqrt(2)
    assert rows == [["position", "a", "b"],
                    ["0-7", "3.000 ±1.960 (2)", "-"],
                    ["8-15", "-", "3.000 (1)"],
                    ["16-23", "-", "-"],
                    ["24-31", "1.000 (1)", "-"]]


def test_a_report_without_position_bins_has_no_position_section():
    assert "tau by anchor position" not in format_table(_report({"a": [0, 1]}))


def test_the_plot_draws_both_panels_with_gaps_and_single_blocks(tmp_path):
    pytest.importorskip("matplotlib")
    report = _report({"a": [0, 1], "b": [2]})
    report["checkpoints"][0]["offline"]["tau_by_position"] = _by_position(8, [(5, 2), (30, 1)])
    path = tmp_path / "acceptance.png"
    plot_acceptance(report, path)  # b has no bins: it has no line in the lower panel
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
