"""Offline acceptance metrics of blocks against stored verifier labels (docs/reference.md §6).

streak = number of leading slots 1..B-1 whose draft equals the label. A slot whose label is
invalid (past the sequence end or outside the assistant text) ends the streak as a mismatch
would: nothing beyond it can be verified offline. tau = the tokens the round commits: the
streak plus the target's bonus token, except where the text ends right after the streak (an
end-of-turn token or the token cap inside the accepted drafts): generation is over there
and no bonus is produced, so tau = streak (`committed_lengths`, given the tokens left).

Accumulators count integers only, so a store of any size evaluates streaming and results
from several ranks merge exactly. This module never runs a model and never reads the store.
"""

import math

import torch

from dflash_train.blocks import BLOCK_SIZE, BlockError

Z_95 = 1.959963984540054
"""Two-sided 95 % normal quantile, for the confidence interval of the mean tau."""

DEFAULT_POSITION_BIN = 256
"""Tokens per bin of tau by anchor position (`dflash eval --position-bin`)."""


def streak_lengths(draft: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Leading accepted slots per block [N] (slot 0 ignored; an invalid label stops it)."""
    if not draft.shape == labels.shape == valid.shape or draft.dim() != 2:
        raise BlockError(
            f"draft {tuple(draft.shape)}, labels {tuple(labels.shape)} and valid "
            f"{tuple(valid.shape)} must all be [N, B]"
        )
    ok = (draft.long() == labels.long()) & valid.bool()  # [N, B]
    return ok[:, 1:].long().cumprod(dim=1).sum(dim=1)


def committed_lengths(streak: torch.Tensor, tokens_left: torch.Tensor | None) -> torch.Tensor:
    """tau per block [N]: the accepted drafts `streak` plus the bonus token, but never more
    than the `tokens_left` [N] the text holds after the anchor (None: it always goes on)."""
    tau = streak + 1
    return tau if tokens_left is None else torch.minimum(tau, tokens_left.to(tau))


def acceptance_lengths(
    draft: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
    tokens_left: torch.Tensor | None = None,
) -> torch.Tensor:
    """tau per block [N] in 1..B: committed_lengths of the streak."""
    return committed_lengths(streak_lengths(draft, labels, valid), tokens_left)


def agreement_counts(
    input_ids: torch.Tensor, verifier_top1: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[int, int]:
    """(matches, total) of stored next token == verifier argmax, over assistant tokens.

    Position t counts when token t+1 is an assistant token; the ratio is the store's
    agreement rate, which says how far offline replay can be trusted as live decoding.
    """
    if not input_ids.shape == verifier_top1.shape == loss_mask.shape or input_ids.dim() != 1:
        raise BlockError(
            f"input_ids {tuple(input_ids.shape)}, verifier_top1 {tuple(verifier_top1.shape)} "
            f"and loss_mask {tuple(loss_mask.shape)} must all be [L] for one sample"
        )
    counted = loss_mask[1:].bool()
    same = (input_ids[1:].long() == verifier_top1[:-1].long()) & counted
    return int(same.sum()), int(counted.sum())


class TauHistogram:
    """Streaming histogram of acceptance lengths tau in 1..max_tau, with mean and 95 % CI."""

    def __init__(self, max_tau: int = BLOCK_SIZE):
        self.max_tau = max_tau
        self.counts = torch.zeros(max_tau + 1, dtype=torch.long)  # index = tau; [0] unused

    def update(self, taus: torch.Tensor) -> None:
        """Add a batch of taus [N]."""
        taus = _checked_taus(taus, self.max_tau)
        self.counts += torch.bincount(taus, minlength=self.max_tau + 1)

    def merge(self, other: "TauHistogram") -> None:
        """Add another histogram's counts (e.g. from another rank)."""
        if other.max_tau != self.max_tau:
            raise BlockError(f"cannot merge max_tau {other.max_tau} into {self.max_tau}")
        self.counts += other.counts

    def summary(self) -> dict:
        """n, mean_tau, tau_ci95 [lo, hi], tau_hist (counts for tau = 1..max_tau)."""
        n = int(self.counts.sum())
        values = torch.arange(self.max_tau + 1, dtype=torch.float64)
        if n == 0:
            mean, ci = None, None
        else:
            mean = float((values * self.counts).sum()) / n
            ci = _normal_ci(values, self.counts, mean, n)
        return {
            "n": n,
            "mean_tau": mean,
            "tau_ci95": ci,
            "tau_hist": self.counts[1:].tolist(),
        }


class PositionBins:
    """Streaming tau histograms by the anchor's position: bin = anchor // width, the position
    counted from the start of the sequence, prompt included (long contexts are where
    acceptance falls). Integer counts per bin, so results merge exactly; a bin's mean and
    interval are computed at summary time."""

    def __init__(self, width: int = DEFAULT_POSITION_BIN, max_tau: int = BLOCK_SIZE):
        if width < 1:
            raise BlockError(f"a position bin must span >= 1 token, got {width}")
        self.width = width
        self.max_tau = max_tau
        self.bins: dict[int, TauHistogram] = {}  # bin index -> its blocks' taus

    def update(self, anchors: torch.Tensor, taus: torch.Tensor) -> None:
        """Add blocks: their anchors [N] and taus [N]."""
        anchors = anchors.detach().long().flatten().cpu()
        taus = _checked_taus(taus, self.max_tau)  # all of them before any bin is counted
        if anchors.shape != taus.shape:
            raise BlockError(f"{anchors.numel()} anchors for {taus.numel()} taus")
        if anchors.numel() and int(anchors.min()) < 0:
            raise BlockError(f"anchor positions must be >= 0, got {int(anchors.min())}")
        present, row = torch.unique(anchors // self.width, return_inverse=True)
        width = self.max_tau + 1  # one bincount for every (bin, tau) pair of the batch
        counts = torch.bincount(row * width + taus, minlength=present.numel() * width)
        for b, hist_counts in zip(present.tolist(), counts.view(-1, width), strict=True):
            self.bins.setdefault(b, TauHistogram(self.max_tau)).counts += hist_counts

    def merge(self, other: "PositionBins") -> None:
        """Add another accumulator's counts (same width and max_tau)."""
        if (other.width, other.max_tau) != (self.width, self.max_tau):
            raise BlockError(f"cannot merge position bins of {other.width} tokens (max tau "
                             f"{other.max_tau}) into {self.width} (max tau {self.max_tau})")
        for b, hist in other.bins.items():
            self.bins.setdefault(b, TauHistogram(self.max_tau)).merge(hist)

    def summary(self) -> dict:
        """bin_tokens, and per bin holding blocks, in position order: its first position
        (start), n_blocks, mean_tau and tau_ci95 (null below 2 blocks)."""
        bins = []
        for b in sorted(self.bins):
            s = self.bins[b].summary()
            bins.append({"start": b * self.width, "n_blocks": s["n"], "mean_tau": s["mean_tau"],
                         "tau_ci95": s["tau_ci95"]})
        return {"bin_tokens": self.width, "bins": bins}


class AcceptanceStats:
    """Streaming per-slot acceptance of linear (one-path) drafts against verifier labels."""

    def __init__(self, block_size: int = BLOCK_SIZE, recall_at: tuple[int, ...] = (1, 2, 4, 8)):
        if any(r < 1 for r in recall_at):
            raise BlockError(f"recall_at values must be >= 1, got {recall_at}")
        self.block_size = block_size
        self.recall_at = tuple(sorted(set(recall_at)))
        self.taus = TauHistogram(block_size)  # tau: tokens committed per block
        self.streaks = TauHistogram(block_size)  # streak + 1: accepted drafts per block
        zeros = torch.zeros(block_size, dtype=torch.long)
        self.slot_valid = zeros.clone()  # valid labels per slot
        self.slot_correct = zeros.clone()  # top-1 == label, regardless of earlier slots
        self.slot_reached = zeros.clone()  # slots < k all accepted and slot k has a label
        self.slot_accepted = zeros.clone()  # slots <= k all accepted
        self.slot_recall = torch.zeros(len(self.recall_at), block_size, dtype=torch.long)

    def update(
        self, draft_topk_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
        tokens_left: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add blocks: draft ids [N, B, K] (rank 0 = the draft) or [N, B], and the tokens
        the text holds after each anchor (committed_lengths); returns tau [N]."""
        if draft_topk_ids.dim() == 2:
            draft_topk_ids = draft_topk_ids.unsqueeze(-1)
        if draft_topk_ids.dim() != 3 or draft_topk_ids.shape[1] != self.block_size:
            raise BlockError(
                f"draft ids must be [N, {self.block_size}, K], got {tuple(draft_topk_ids.shape)}"
            )
        k_have = draft_topk_ids.shape[-1]
        if self.recall_at and self.recall_at[-1] > k_have:
            raise BlockError(
                f"top-k recall at {self.recall_at} needs draft top-{self.recall_at[-1]} ids, "
                f"got top-{k_have}; pass more ids or a smaller recall_at"
            )
        ids = draft_topk_ids.detach().long().cpu()
        labels = labels.detach().long().cpu()
        valid = valid.detach().bool().cpu()
        streak = streak_lengths(ids[..., 0], labels, valid)  # [N]
        slots = torch.arange(self.block_size)
        hit = (ids == labels.unsqueeze(-1)) & valid.unsqueeze(-1)  # [N, B, K]

        tau = committed_lengths(streak, tokens_left)
        self.taus.update(tau)
        self.streaks.update(streak + 1)
        self.slot_valid += valid.sum(0)
        self.slot_correct += hit[..., 0].sum(0)
        reached = (streak[:, None] >= slots - 1) & valid  # [N, B]
        reached[:, 0] = False
        self.slot_reached += reached.sum(0)
        accepted = (streak[:, None] >= slots) & valid
        accepted[:, 0] = False
        self.slot_accepted += accepted.sum(0)
        for i, r in enumerate(self.recall_at):
            self.slot_recall[i] += hit[..., :r].any(-1).sum(0)
        return tau

    def merge(self, other: "AcceptanceStats") -> None:
        """Add another accumulator's counts (same block size and recall_at)."""
        if (other.block_size, other.recall_at) != (self.block_size, self.recall_at):
            raise BlockError("cannot merge AcceptanceStats with a different block_size/recall_at")
        self.taus.merge(other.taus)
        self.streaks.merge(other.streaks)
        for name in ("slot_valid", "slot_correct", "slot_reached", "slot_accepted", "slot_recall"):
            getattr(self, name).add_(getattr(other, name))

    def summary(self) -> dict:
        """Plain dict: tau stats, streak histogram and per-slot lists for slots 1..B-1.

        mean_tau: tokens committed per block. mean_streak / streak_hist: accepted drafts
        per block (a block the text ends in counts the drafts up to the end). Per slot k:
        cond_accept = P(draft k accepted | drafts < k accepted and position a+k is text),
        slot_accuracy = P(draft k == label | label valid), whatever came before."""
        taus, streaks = self.taus.summary(), self.streaks.summary()
        return {
            "n_blocks": taus["n"],
            "mean_tau": taus["mean_tau"],
            "mean_streak": None if streaks["mean_tau"] is None else streaks["mean_tau"] - 1.0,
            "tau_ci95": taus["tau_ci95"],
            "ci_method": "normal approximation, 95 %, blocks treated as independent",
            "streak_hist": streaks["tau_hist"],  # index s = streak s
            "slot_valid": self.slot_valid[1:].tolist(),
            "cond_accept": _ratios(self.slot_accepted[1:], self.slot_reached[1:]),
            "slot_accuracy": _ratios(self.slot_correct[1:], self.slot_valid[1:]),
            "topk_recall": {
                str(r): _ratios(self.slot_recall[i, 1:], self.slot_valid[1:])
                for i, r in enumerate(self.recall_at)
            },
        }


def _checked_taus(taus: torch.Tensor, max_tau: int) -> torch.Tensor:
    """taus as a flat long CPU tensor; BlockError unless every one lies in 1..max_tau."""
    taus = taus.detach().long().flatten().cpu()
    if taus.numel() and (int(taus.min()) < 1 or int(taus.max()) > max_tau):
        raise BlockError(f"tau must lie in 1..{max_tau}, got {int(taus.min())}..{int(taus.max())}")
    return taus


def _ratios(num: torch.Tensor, den: torch.Tensor) -> list[float | None]:
    """Elementwise num / den as floats, None where the denominator is 0."""
    return [None if d == 0 else n / d for n, d in zip(num.tolist(), den.tolist(), strict=True)]


def _normal_ci(
    values: torch.Tensor, counts: torch.Tensor, mean: float, n: int
) -> list[float] | None:
    """mean +- z * s / sqrt(n) from a histogram; None with fewer than 2 samples."""
    if n < 2:
        return None
    var = float(((values - mean) ** 2 * counts).sum()) / (n - 1)
    half = Z_95 * math.sqrt(var / n)
    return [mean - half, mean + half]


Budget = int | None
"""A walk's key: the DDTree's node budget, or None for the chain."""
Rounds = dict[tuple[int, int], list[tuple[int, int]]]
"""Per sample key (part, index): the (anchor, tau) of its rounds in the order walked."""


class Walk:
    """One walk of a checkpoint over the samples, the chain's or a DDTree budget's: its
    rounds' tau, by anchor position too, and each sample's rounds. The chain's drafts are
    scored slot by slot as well (`stats`, whose histogram is this walk's `taus`)."""

    def __init__(self, block_size: int, position_bin: int,
                 recall_at: tuple[int, ...] | None = None):
        self.stats = None if recall_at is None else AcceptanceStats(block_size, recall_at)
        """The chain's per-slot metrics (AcceptanceStats); None for a DDTree's walk."""
        self.taus = TauHistogram(block_size) if self.stats is None else self.stats.taus
        self.positions = PositionBins(position_bin, block_size)
        self.rounds: Rounds = {}

    def record(self, keys: list[tuple[int, int]], anchors: list[int], taus: list[int]) -> None:
        """Add rounds by position and per sample; `taus` counted into the histogram already
        where `stats` scored them, else here."""
        t = torch.tensor(taus, dtype=torch.long)
        if self.stats is None:
            self.taus.update(t)
        self.positions.update(torch.tensor(anchors, dtype=torch.long), t)
        for key, anchor, tau in zip(keys, anchors, taus, strict=True):
            self.rounds.setdefault(key, []).append((anchor, tau))

    def merge(self, other: "Walk") -> None:
        """Add another walk's counts (another rank's or store's); rounds are not kept."""
        (self.stats or self.taus).merge(other.stats or other.taus)
        self.positions.merge(other.positions)

    def tree_summary(self) -> dict:
        """A DDTree walk's report entry: its tau, rounds and tau by anchor position."""
        s = self.taus.summary()
        return {"mean_tau": s["mean_tau"], "tau_ci95": s["tau_ci95"], "rounds": s["n"],
                "tau_hist": s["tau_hist"], "tau_by_position": self.positions.summary()}
