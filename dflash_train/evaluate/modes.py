"""The decode modes of `dflash eval`, beside offline replay: `--online` (our live loop, here)
and `--served` (a serving engine: vLLM, or llama.cpp with `--engine llama.cpp`; engines/).
One interface: check the options, prepare everything (load the target, find the engine,
check it is the store's target) before the first drafter forward, then run on the held-out
prompts. A run's results (results.ModeResults) have one summary type (summary.py) and one
table signature (results.AnyCheckpointResults), and are checked by agreement.py (the same
text and rounds, or at T > 0 against other draws the same law of tau); a new mode is one
subclass here and one line in `decode_modes`, a new engine one module in engines/ and one
entry in engines.SERVING_ENGINES.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from dflash_train.evaluate.agreement import (
    TEXT_NOT_CHECKED,
    Decoded,
    LawPrompt,
    RunCheck,
    check_run,
    tau_check,
)
from dflash_train.evaluate.checkpoints import EvalCheckpoint
from dflash_train.evaluate.config import EvalConfig, EvalSettings
from dflash_train.evaluate.drafting import BlockDrafter
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import (
    StopRule,
    evaluate_online,
    load_online_target,
    prompt_of,
    store_sampling,
)
from dflash_train.evaluate.results import ModeResults
from dflash_train.evaluate.samples import EvalSample
from dflash_train.evaluate.summary import RunLabel
from dflash_train.store_schema import Store


@dataclass
class EvalInputs:
    """What every run reads, all of it checked and loaded before the first forward."""

    store: Store
    settings: EvalSettings
    """The settings after clamping recall k to the vocabulary."""
    checkpoints: list[EvalCheckpoint]
    drafters: dict[str, BlockDrafter]
    echo: Callable[[str], None]


def earlier_runs(runs: list[ModeResults], name: str) -> dict[str, Decoded]:
    """Checkpoint `name`'s runs a new run is compared with, in the order they ran."""
    return {r.label: r.decoded[name] for r in runs if r.live_rounds}


def check_runs(decoded: dict[str, Decoded], samples: list[EvalSample],
               earlier: list[ModeResults]) -> dict[str, RunCheck]:
    """The agreement check of each checkpoint's run (by name): the stored text, and the
    rounds of its earlier runs."""
    stored = {s.key: s.input_ids.tolist() for s in samples}
    return {n: check_run(d, stored, earlier_runs(earlier, n)) for n, d in decoded.items()}


def _named(keys: list[tuple[int, int]]) -> list[str]:
    """Sample keys as the report names prompts: "part/index"."""
    return [f"{p}/{i}" for p, i in keys]


class DecodeMode(ABC):
    """A way of decoding the held-out prompts with the target."""

    label: ClassVar[RunLabel]
    """Its column in the report, the table and the parquet `run` column."""
    flag: ClassVar[str]
    """The option that asks for it."""

    def check_options(self, cfg: EvalConfig) -> None:
        """Refuse options it cannot run with, before anything is read."""
        if not cfg.model:
            raise EvalError(f"{self.flag} needs --model (the target checkpoint)")

    @abstractmethod
    def prepare(self, cfg: EvalConfig, store: Store, device: torch.device) -> None:
        """Load and check what it needs (target, engine) before the first drafter forward."""

    def generation_source(self):
        """What the stop rule reads the end-of-turn ids from (a loaded model), or None."""
        return None

    @abstractmethod
    def run(self, inputs: EvalInputs, samples: list[EvalSample], stop: StopRule,
            earlier: list[ModeResults]) -> ModeResults:
        """Decode every sample's prompt with every checkpoint; checked against `earlier`."""


class OnlineMode(DecodeMode):
    """`--online`: our speculative decoding loop with the target (online.py): greedy, or
    sample-and-match under a sampled store's settings and seed."""

    label = "online"
    flag = "--online"

    def prepare(self, cfg: EvalConfig, store: Store, device: torch.device) -> None:
        self.sampling = store_sampling(store.meta)
        self.server_drawn = store.meta.server_drawn
        self.target = load_online_target(cfg.model, store.meta, device=str(device))
        self.cached = not cfg.no_cache

    def generation_source(self):
        return self.target.target.model

    def run(self, inputs, samples, stop, earlier):
        budgets = inputs.settings.tree_budgets
        walks = "chains" + (f" and DDTrees of {', '.join(map(str, budgets))} nodes"
                            if budgets else "")
        how = ("with the target's cache" if self.cached else
               "recomputing the target over the whole sequence every round (--no-cache)")
        s = self.sampling
        drawn = "" if s.greedy else (f", the target sampling at temperature {s.temperature} "
                                     f"(top-p {s.top_p}, top-k {s.top_k or 'off'}) with the "
                                     f"store's seed {s.seed}")
        if self.server_drawn:
            drawn += ("; the store's answers were drawn by a server, so the live text is "
                      "another sample and its tau is compared with offline's as a "
                      "distribution, not round by round")
        inputs.echo(f"online: decoding {len(samples)} prompts live with "
                    f"{len(inputs.drafters)} checkpoint(s) as {walks}, max "
                    f"{stop.max_new_tokens} new tokens, {how}{drawn}")
        results, generated = evaluate_online(self.target, inputs.drafters, samples,
                                             inputs.settings, stop, cached=self.cached,
                                             sampling=s)
        lengths = {s.key: len(p) for s in samples if (p := prompt_of(s)) is not None}
        decoded = {n: Decoded.of(generated, r.walks, lengths) for n, r in results.items()}
        if self.server_drawn:
            offline = next(r for r in earlier if r.label == "offline").results
            check = law_check_json(results, offline, samples, stop)
        else:
            check = self.check_json(check_runs(decoded, samples, earlier))
        return ModeResults(self.label, results, decoded, check=check)

    @staticmethod
    def check_json(checks: dict[str, RunCheck]) -> dict:
        """The text is the target's, whatever the drafter: the first checkpoint's says it."""
        first = next(iter(checks.values()))
        walks = {n: c.taus_differ["offline"] for n, c in checks.items()
                 if "offline" in c.taus_differ}  # offline rounds are live ones in replay
        replayed = {n: by_walk[None] for n, by_walk in walks.items()}
        trees = {n: {b: keys for b, keys in by_walk.items() if b is not None}
                 for n, by_walk in walks.items()}
        return {"prompts": first.prompts, "same_text": first.prompts - len(first.text_differs),
                "text_differs": _named(first.text_differs),
                "same_taus": {n: first.prompts - len(keys) for n, keys in replayed.items()},
                "taus_differ": {n: _named(keys) for n, keys in replayed.items()},
                "same_tree_taus": {n: {str(b): first.prompts - len(keys)
                                       for b, keys in by_budget.items()}
                                   for n, by_budget in trees.items()},
                "tree_taus_differ": {n: {str(b): _named(keys) for b, keys in by_budget.items()}
                                     for n, by_budget in trees.items()}}


def law_check_json(live: dict, offline: dict, samples: list[EvalSample], stop: StopRule
                   ) -> dict:
    """--online on a store a server sampled: per checkpoint and walk (the chain, each DDTree
    budget), agreement.tau_check of the live taus against offline's over the same prompts;
    text and rounds are not compared (TEXT_NOT_CHECKED)."""
    prompts = [LawPrompt(s.key, s.loss_mask, len(p) + stop.new_tokens_cap(len(p)) - 1)
               for s in samples if (p := prompt_of(s)) is not None]

    def check(r, budget) -> dict:
        return tau_check("online", r.walks[budget].taus, offline[r.name].walks[budget].rounds,
                         prompts)

    return {"prompts": len(prompts), "against": "offline", "drawn_by": "server",
            "text": TEXT_NOT_CHECKED,
            "checkpoints": {n: {"tau_check": check(r, None),
                                "tree_tau_checks": {str(b): check(r, b) for b in r.walks
                                                    if b is not None}}
                            for n, r in live.items()}}


def decode_modes(cfg: EvalConfig) -> list[DecodeMode]:
    """The modes the options ask for, in the order they run (each checks the ones before)."""
    modes: list[DecodeMode] = []
    if cfg.online:
        modes.append(OnlineMode())
    if cfg.served:
        from dflash_train.evaluate.engines import SERVING_ENGINES  # they build on this module

        modes.append(SERVING_ENGINES[cfg.engine]())
    return modes


def offline_run(results: dict, samples: list[EvalSample], settings: EvalSettings) -> ModeResults:
    """Offline replay as a run the decode modes are checked against (its text: the store's)."""
    stored = {s.key: s.input_ids.tolist() for s in samples}
    decoded = {n: Decoded.of(stored, r.walks) for n, r in results.items()}
    return ModeResults("offline", results, decoded, live_rounds=settings.mode == "replay")

