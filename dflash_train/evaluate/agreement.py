"""The agreement checks of `dflash eval`: does a decode run (--online, --served) give the
stored text, and the same rounds as the runs before it, prompt by prompt; and where is the
first difference (`check_run`). Where its draws cannot be the stored ones (a serving engine's
own random stream at T > 0, or a store a server sampled), the law is checked instead: mean tau
live against offline's on the same prompts, with 95 % intervals (`tau_check`). The report
writes each mode's check in that mode's JSON shape (evaluate/modes.py)."""

from dataclasses import dataclass, field

import torch

from dflash_train.blocks import replay_anchors
from dflash_train.evaluate.metrics import Budget, Rounds, TauHistogram, Walk

Key = tuple[int, int]
"""A sample: (part, index)."""


@dataclass
class Decoded:
    """A run of one checkpoint as the check reads it, prompt by prompt."""

    text: dict[Key, list[int]]
    """Prompt + generated tokens (the stored ones for offline replay)."""
    walks: dict[Budget, Rounds]
    """Per walk (None: the chain, else a DDTree's node budget; a serving engine has the chain
    only): its rounds. A prompt without any (first token an end of turn) may be absent."""
    prompt_lengths: dict[Key, int] = field(default_factory=dict)
    """Tokens before the first generated one (a run's own; a reference needs none)."""

    @classmethod
    def of(cls, text: dict[Key, list[int]], walks: dict[Budget, Walk],
           prompt_lengths: dict[Key, int] | None = None) -> "Decoded":
        """A run's text and the rounds of each of its walks."""
        return cls(text, {b: w.rounds for b, w in walks.items()}, prompt_lengths or {})


@dataclass
class RunCheck:
    """How a checkpoint's run agrees with the stored text and with earlier runs."""

    prompts: int
    """Prompts the run decoded."""
    text_differs: list[Key]
    """Prompts whose generated text is not the stored text."""
    taus_differ: dict[str, dict[Budget, list[Key]]]
    """Per earlier run ("offline", "online") it is compared with, per walk both have: prompts
    whose rounds differ from that run's."""
    against: str | None
    """The earlier run `first_difference` is taken against (the first compared), if any."""
    first_difference: dict | None
    """The first prompt (in store order) where the run differs from `against`: its text at a
    token, else its rounds at an anchor; None when every prompt agrees."""


def check_run(run: Decoded, stored: dict[Key, list[int]], earlier: dict[str, Decoded]
              ) -> RunCheck:
    """Compare `run` with the stored text and each earlier run (by label, in order)."""
    keys = sorted(run.text)
    taus_differ = {
        label: {b: [k for k in keys if rounds.get(k, []) != ref.walks[b].get(k, [])]
                for b, rounds in run.walks.items() if b in ref.walks}
        for label, ref in earlier.items()}
    against = next(iter(earlier), None)
    diff = None if against is None else first_difference(run, earlier[against])
    return RunCheck(len(keys), [k for k in keys if run.text[k] != stored.get(k)],
                    taus_differ, against, diff)


def _first_mismatch(a: list, b: list) -> int:
    """The first index where two lists differ (the shorter one's length if one is a prefix)."""
    same = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(same, min(len(a), len(b)))


def first_difference(run: Decoded, ref: Decoded) -> dict | None:
    """The first prompt of `run` (in store order) where it differs from `ref`: its text at a
    token, else its rounds at an anchor ("served" is `run`'s value, as the report names it)."""
    for key in sorted(run.text):
        where = f"{key[0]}/{key[1]}"
        mine, theirs = run.text[key], ref.text.get(key)
        if theirs is not None and theirs != mine:
            t = _first_mismatch(theirs, mine)
            return {"prompt": where, "kind": "text", "position": t,
                    "response_token": t - run.prompt_lengths[key],
                    "served": mine[t] if t < len(mine) else None,
                    "reference": theirs[t] if t < len(theirs) else None}
        mine, theirs = run.walks[None].get(key, []), list(ref.walks[None].get(key, []))
        if mine != theirs:
            r = _first_mismatch(mine, theirs)
            return {"prompt": where, "kind": "tau", "round": r,
                    "position": mine[r][0] if r < len(mine) else theirs[r][0],
                    "served": mine[r][1] if r < len(mine) else None,
                    "reference": theirs[r][1] if r < len(theirs) else None}
    return None


TEXT_NOT_CHECKED = ("not compared: at temperature > 0 the live draws are not the stored ones "
                    "(a serving engine draws from its own random stream, and a store a server "
                    "sampled holds that server's draws), so the text is another sample of the "
                    "target's law and its rounds follow that text; what must agree is the law "
                    "of tau (tau_check)")
"""Why a check at T > 0 against other draws compares no text and no rounds."""


@dataclass(frozen=True)
class LawPrompt:
    """One prompt as the law check reads offline replay's walk over it (any walk)."""

    key: Key
    loss_mask: torch.Tensor
    """The stored sample's assistant-token mask (where offline's anchors may lie)."""
    end: int
    """The first position past what live decoding may generate (prompt + cap - 1: the last
    token drafts no block)."""


def tau_check(label: str, live: TauHistogram, offline_rounds: Rounds,
              prompts: list[LawPrompt]) -> dict:
    """Live (`label`: its walk's tau histogram) and offline mean tau of one walk (the chain or
    a DDTree budget) on the same prompts, each with its 95 % interval, and whether the
    intervals overlap (`within`; None below 2 rounds a side). Both are draws of live
    sample-and-match's law at the store's settings (reference.md §8a), so a drafter and target
    run live as offline replays them give overlapping intervals."""
    offline = TauHistogram(live.max_tau)
    offline.update(torch.tensor(offline_walk_taus(offline_rounds, prompts), dtype=torch.long))
    mine, theirs = _tau_interval(live), _tau_interval(offline)
    a, b = mine["tau_ci95"], theirs["tau_ci95"]
    within = None if a is None or b is None else a[0] <= b[1] and b[0] <= a[1]
    return {label: mine, "offline": theirs, "within": within}


def _tau_interval(hist: TauHistogram) -> dict:
    s = hist.summary()
    return {"rounds": s["n"], "mean_tau": s["mean_tau"], "tau_ci95": s["tau_ci95"]}


def offline_walk_taus(rounds: Rounds, prompts: list[LawPrompt]) -> list[int]:
    """Offline replay's taus of one walk over the prompts, walked as live decoding walks
    (blocks.replay_anchors over its per-anchor taus: its own rounds under --mode replay, the
    walk through every anchor's tau under --mode all), up to each prompt's end."""
    taus = []
    for p in prompts:
        at = dict(rounds.get(p.key, []))
        for anchor in replay_anchors(p.loss_mask, at.__getitem__):
            if anchor >= p.end or anchor not in at:
                break
            taus.append(at[anchor])
    return taus
