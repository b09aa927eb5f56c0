"""What every serving engine of `eval --served` shares: the prompts it gets (`--online`'s,
with its stop rule), the job a ServedMode hands its engine, an engine's per-step counts read
as rounds (`served_decode`), a checkpoint's results scored as offline scores them
(`ServedResults`), the served check, and what is known of why a served run differs.

Two counting conventions, both kept, never mixed:
- committed tokens (ours: offline, `--online`, and `served` columns): a round's tau is the
  tokens it commits; the last round of a prompt commits no bonus when the text ends inside
  its accepted drafts. From an engine's per-step accepted counts: every round but the last
  commits accepted + 1 (it did not stop), the last commits what is left of the output.
- the engine's (its block of the served summary, `vllm` or `llama_cpp`): accepted drafts
  per verify step as its scheduler counts them, before its stop check, so the last round
  counts any drafts accepted past the stop; mean acceptance length = 1 + accepted / drafts.

On a sampled store (StoreMeta.sampling) every request samples with the store's settings and a
seed of its own (`sampling.request_seed`). The engine draws from its own random stream, not
our keyed noise, so its text is another sample of the target's law, never the stored one:
the served check is then one of distribution (`agreement.tau_check`: served and offline mean
tau of the chain on the same prompts, with their 95 % intervals), not of text
(docs/reference.md §8b).

This module never starts an engine and never loads a model; it only counts.
"""

import shutil
import tempfile
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from dflash_train.evaluate.agreement import (
    TEXT_NOT_CHECKED,
    Decoded,
    LawPrompt,
    RunCheck,
    tau_check,
)
from dflash_train.evaluate.config import EvalConfig
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.metrics import Budget, Walk
from dflash_train.evaluate.modes import DecodeMode, EvalInputs, check_runs
from dflash_train.evaluate.online import StopRule, prompt_of, store_sampling
from dflash_train.evaluate.results import ROW_NAMES, AnyCheckpointResults, ModeResults
from dflash_train.evaluate.samples import EvalSample
from dflash_train.evaluate.summary import EvalSummary
from dflash_train.store_schema import Store
from dflash_train.target_model.sampling import GREEDY, SamplingConfig

_LOG_TAIL = 12
"""Lines of an engine's log quoted when it fails."""


# -- what an engine is asked --------------------------------------------------------------


@dataclass
class ServedPrompt:
    """One held-out prompt as the engine gets it."""

    sample: EvalSample
    ids: list[int]
    max_tokens: int
    """New tokens --online may generate: its cap, and never past the store's max_length."""

    @property
    def key(self) -> str:
        return f"{self.sample.part}/{self.sample.index}"


def served_prompts(samples: list[EvalSample], stop: StopRule) -> list[ServedPrompt]:
    """The prompts `--online` decodes (samples without a response are left out, as there)."""
    out = []
    for s in samples:
        ids = prompt_of(s)
        if ids is not None:
            out.append(ServedPrompt(s, ids, stop.new_tokens_cap(len(ids))))
    return out


@dataclass
class ServeJob:
    """What a ServedMode hands its engine: the same for every engine."""

    checkpoints: dict[str, tuple[str, int]]
    """Per checkpoint name: its path and block size."""
    prompts: list[ServedPrompt]
    stop: StopRule
    position_bin: int
    """Tokens per bin of the summary's tau by anchor position (EvalSettings.position_bin)."""
    speed: bool
    """Also decode every prompt without the drafter, taking turns with it (speed.py)."""
    echo: Callable[[str], None] = print
    sampling: SamplingConfig = GREEDY
    """How every request draws: the store's settings (greedy unless it records sampling);
    each request's seed is `sampling.request_seed(seed, source row)`."""


def serve_job(inputs: EvalInputs, samples: list[EvalSample], stop: StopRule, speed: bool,
              sampling: SamplingConfig = GREEDY) -> ServeJob:
    """The job of a served run; EvalError when no sample has a prompt to decode."""
    prompts = served_prompts(samples, stop)
    if not prompts:
        raise EvalError("--served: no held-out sample has a prompt and a response to decode")
    return ServeJob({c.name: (c.path, c.config.block_size) for c in inputs.checkpoints},
                    prompts, stop, inputs.settings.position_bin, speed, inputs.echo, sampling)


def in_scratch(prefix: str, export: Callable[[Path], dict[str, Path]],
               serve: Callable[[Path, dict[str, Path]], dict]) -> dict:
    """serve(workdir, export(workdir)) in a temporary directory, removed when it succeeds
    and kept when serving fails (the engine names it in its error: its logs say why)."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        exported = export(workdir)
    except BaseException:  # Ctrl-C and a full disk too: half-written exports are worth nothing
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    results = serve(workdir, exported)
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def log_tail(log: Path) -> str:
    """The last lines of an engine's log, to quote in an error."""
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return "\n  ".join(lines[-_LOG_TAIL:])


# -- counting ---------------------------------------------------------------------------


@dataclass
class ServedDecode:
    """One prompt as the engine decoded it."""

    prompt: ServedPrompt
    tokens: list[int]
    """Prompt + generated tokens."""
    accepted: list[int]
    """Per verify step, the drafts the engine counted as accepted (its convention)."""
    committed: list[int]
    """Per verify step, the tokens it committed (ours)."""
    anchors: list[int]
    """Per verify step, the position of the last committed token it drafted at."""


def served_decode(prompt: ServedPrompt, raw: dict, block_size: int, engine: str) -> ServedDecode:
    """An engine's per-step counts of one prompt as rounds; EvalError when they do not add up
    to its own output (every step drafts a full block; the generated tokens are the first one
    plus what the rounds commit)."""
    generated = list(raw["token_ids"])
    accepted, drafted = list(raw["per_step_accepted"]), list(raw["per_step_drafted"])
    where = f"{engine}'s counters for prompt {prompt.key}"
    if len(accepted) != len(drafted):
        raise EvalError(f"{where}: {len(accepted)} accepted vs {len(drafted)} drafted steps")
    short = [i for i, d in enumerate(drafted) if d != block_size - 1]
    if short:
        raise EvalError(f"{where}: step {short[0]} drafted {drafted[short[0]]} tokens, not "
                        f"{block_size - 1} (a shortened draft; our loop never drafts one)")
    if not generated:
        raise EvalError(f"{where}: {engine} generated no token")
    committed = [a + 1 for a in accepted[:-1]]
    if accepted:
        committed.append(len(generated) - 1 - sum(committed))
        if not 1 <= committed[-1] <= accepted[-1] + 1:
            raise EvalError(f"{where}: {len(generated)} tokens generated but the steps "
                            f"accepted {accepted}")
    elif len(generated) != 1:
        raise EvalError(f"{where}: {len(generated)} tokens generated without a verify step")
    anchors, at = [], len(prompt.ids)
    for c in committed:
        anchors.append(at)
        at += c
    return ServedDecode(prompt, prompt.ids + generated, accepted, committed, anchors)


@dataclass
class ServedResults:
    """A checkpoint's served decodes, scored as offline results are (committed tokens), plus
    the engine's own counters (its convention)."""

    name: str
    block_size: int
    decodes: list[ServedDecode]
    """Per prompt, in the job's order."""
    counters: dict
    """The engine's Prometheus totals: num_drafts, num_draft_tokens, num_accepted_tokens,
    accepted_per_pos."""
    position_bin: int
    """Tokens per bin of the summary's tau by anchor position (ServeJob.position_bin)."""
    engine: str
    """The report key of the engine's own counters (ServedMode.report_key)."""
    info: dict = field(default_factory=dict)
    """Versions, what the engine resolved the drafter as, timings."""
    counters_agree: bool | None = None
    """Whether the per-request counts equal `counters`, when the engine decides it by a rule
    of its own (llama.cpp: steps past the stop, rounded Prometheus values); None: the
    per-request steps equal the totals exactly (vLLM)."""
    speed: dict | None = None
    """Decode speed with and without the drafter (speed.speed_summary); None: not measured
    (--no-speed)."""
    walks: dict[Budget, Walk] = field(init=False)
    """The chain's walk only (None): the engine's trees and top-k are not visible."""

    def __post_init__(self) -> None:
        chain = Walk(self.block_size, self.position_bin, recall_at=(1,))
        for d in self.decodes:
            if d.committed:  # a prompt whose first token ends the turn has no rounds
                chain.stats.update(*_as_blocks(d, self.block_size))
                chain.record([d.prompt.sample.key] * len(d.anchors), d.anchors, d.committed)
        self.walks = {None: chain}

    def engine_summary(self) -> dict:
        """The engine's convention, from its per-step counts (vLLM's and llama.cpp's are the
        same: accepted drafts per verify step, mean length 1 + accepted / steps);
        `counters_agree` checks them against its Prometheus totals."""
        steps = [a for d in self.decodes for a in d.accepted]
        slots = self.block_size - 1
        per_pos = [sum(a > k for a in steps) for k in range(slots)]
        drafts, accepted = len(steps), sum(steps)
        c = self.counters
        agree = self.counters_agree
        if agree is None:
            agree = (c.get("num_drafts") == drafts and c.get("num_accepted_tokens") == accepted
                     and list(c.get("accepted_per_pos") or []) == per_pos)
        return {
            "num_drafts": drafts, "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos,
            "mean_acceptance_length": None if not drafts else 1 + accepted / drafts,
            "acceptance_rate_per_pos": [None if not drafts else n / drafts for n in per_pos],
            "prometheus": c, "counters_agree": agree,
        }

    def summary(self) -> EvalSummary:
        """The served column: committed tokens as offline counts them (drafts past a
        rejection, top-k and trees are not visible from outside the engine), and the
        engine's own counters."""
        return EvalSummary(self.walks, sees_drafts=False,
                           engine={self.engine: self.engine_summary(), "info": self.info,
                                   "speed": self.speed})

    def decoded(self) -> Decoded:
        """Its text and rounds per prompt, as the agreement check reads them."""
        return Decoded.of({d.prompt.sample.key: d.tokens for d in self.decodes}, self.walks,
                          {d.prompt.sample.key: len(d.prompt.ids) for d in self.decodes})

    def table(self) -> dict[str, list]:
        """Per-block rows in results.ROW_NAMES' columns, ordered by (part, sample, anchor):
        chains only (no trees from outside the engine)."""
        rows: dict[str, list] = {n: [] for n in ROW_NAMES}
        for d in sorted(self.decodes, key=lambda d: d.prompt.sample.key):
            s = d.prompt.sample
            for anchor, tau in zip(d.anchors, d.committed, strict=True):
                for name, value in zip(ROW_NAMES, (s.part, s.index, s.source_row, anchor, None,
                                                   tau), strict=True):
                    rows[name].append(value)
        return rows


def _as_blocks(decode: ServedDecode, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode's rounds in AcceptanceStats.update's terms: drafts [N, B] that match labels in
    exactly the first `accepted` slots, slots valid up to the text's end, tokens left."""
    n = len(decode.committed)
    slots = torch.arange(block_size)
    accepted = torch.tensor(decode.accepted)
    left = torch.tensor([min(len(decode.tokens) - 1 - a, block_size) for a in decode.anchors])
    labels = torch.zeros(n, block_size, dtype=torch.long)
    draft = (slots[None] > accepted[:, None]).long()  # 0 == label up to `accepted`, then 1
    valid = slots[None] <= left[:, None]
    tau = torch.minimum(torch.minimum(accepted, left) + 1, left)
    if tau.tolist() != decode.committed:  # the two readings of the engine's counts must agree
        raise EvalError(f"the engine's counters for prompt {decode.prompt.key}: committed "
                        f"{decode.committed} but accepted {decode.accepted} with {left.tolist()} "
                        "tokens left")
    return draft, labels, valid, left


# -- the served mode ------------------------------------------------------------------------


class ServedMode(DecodeMode):
    """`--served`: a serving engine decodes the prompts; each engine is one subclass, in a
    module of its own, listed in engines.SERVING_ENGINES."""

    label = "served"
    flag = "--served"
    engine: ClassVar[str]
    """Its --engine name; also its key in the versions of the served summary's `info`."""
    report_key: ClassVar[str]
    """The key of its own counters in the served summary."""
    title: ClassVar[str]
    """Its name in messages and the table."""

    def prepare(self, cfg: EvalConfig, store: Store, device: torch.device) -> None:
        self.speed = cfg.speed
        self.sampling = store_sampling(store.meta)
        self.plan = self.plan_for(cfg, store)

    @abstractmethod
    def plan_for(self, cfg: EvalConfig, store: Store):
        """Find the engine and check --model is the store's target, before the first
        forward: what `serve` needs besides the job."""

    @abstractmethod
    def serve(self, job: ServeJob) -> dict[str, ServedResults]:
        """ServedResults per checkpoint name."""

    @abstractmethod
    def causes(self, diff: dict, inputs: EvalInputs, name: str) -> list[str]:
        """What is known of why checkpoint `name`'s served run differs as `diff` says."""

    def engine_causes(self, diff: dict, inputs: EvalInputs, name: str, *, served_dtype: str,
                      drafter_dtype: str) -> list[str]:
        """likely_causes for checkpoint `name`, from the store and the checkpoint's config."""
        meta = inputs.store.meta
        config = next(c.config for c in inputs.checkpoints if c.name == name)
        return likely_causes(diff, served_dtype=served_dtype, store_dtype=meta.hidden_dtype,
                             regenerated=meta.source.regenerated,
                             sliding="sliding_attention" in config.layer_types,
                             drafter_dtype=drafter_dtype, engine=self.title)

    def run(self, inputs, samples, stop, earlier):
        job = serve_job(inputs, samples, stop, self.speed, self.sampling)
        s = self.sampling
        if not s.greedy:
            inputs.echo(f"served: sampling at temperature {s.temperature} (top-p {s.top_p}, "
                        f"top-k {s.top_k or 'off'}), each request seeded from the store's seed "
                        f"{s.seed} and its source row; {self.title}'s draws are its own, so "
                        "its tau is compared with offline as a distribution, not its text")
        served = self.serve(job)
        decoded = {n: r.decoded() for n, r in served.items()}
        if s.greedy:
            check = self.check_json(check_runs(decoded, samples, earlier), inputs)
        else:
            offline = next(r for r in earlier if r.label == "offline")
            check = sampled_check_json(served, offline.results, s)
        return ModeResults(self.label, served, decoded, check=check)

    def check_json(self, checks: dict[str, RunCheck], inputs: EvalInputs) -> dict:
        out = {"prompts": 0, "against": None, "checkpoints": {}}
        for name, c in checks.items():
            entry = {"same_text": c.prompts - len(c.text_differs)}
            entry |= {f"same_taus_as_{label}": c.prompts - len(by_walk[None])
                      for label, by_walk in c.taus_differ.items()}
            entry["first_difference"] = c.first_difference
            entry["likely_causes"] = None if c.first_difference is None else \
                self.causes(c.first_difference, inputs, name)
            out |= {"prompts": c.prompts, "against": c.against}
            out["checkpoints"][name] = entry
        return out


def sampled_check_json(served: dict[str, ServedResults], offline: dict[str, AnyCheckpointResults],
                       sampling: SamplingConfig) -> dict:
    """The served check on a sampled store: per checkpoint, its served_tau_check."""
    return {"prompts": len(next(iter(served.values())).decodes), "against": "offline",
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                         "top_k": sampling.top_k, "seed": sampling.seed},
            "text": TEXT_NOT_CHECKED,
            "checkpoints": {n: {"tau_check": served_tau_check(r, offline[n])}
                            for n, r in served.items()}}


def served_tau_check(served: ServedResults, offline: AnyCheckpointResults) -> dict:
    """agreement.tau_check of the engine's committed taus against offline replay's walk over
    the same prompts, each up to what the engine could generate (the prompt's cap)."""
    prompts = [LawPrompt(d.prompt.sample.key, d.prompt.sample.loss_mask,
                         len(d.prompt.ids) + d.prompt.max_tokens - 1) for d in served.decodes]
    return tau_check("served", served.walks[None].taus, offline.walks[None].rounds, prompts)


def likely_causes(diff: dict, *, served_dtype: str, store_dtype: str, regenerated: bool,
                  sliding: bool, drafter_dtype: str, engine: str) -> list[str]:
    """What is known of why a served run differs (the first difference's kind decides)."""
    causes = [f"no chat-template difference: {engine} got the stored prompt token ids"]
    if diff["kind"] == "text":
        if not regenerated:
            causes.append("the store's responses are not the target's own greedy output "
                          "(extract --regenerate): the texts are expected to differ")
        if served_dtype != store_dtype:
            causes.append(f"target drift: {engine} serves the target in {served_dtype}, the store "
                          f"was extracted in {store_dtype}")
        else:
            causes.append(f"target drift: {engine}'s {served_dtype} kernels differ from "
                          "transformers' in rounding; greedy flips where two logits nearly "
                          "tie")
    else:
        causes.append(f"drafter numerics: the drafter ({drafter_dtype}) reads target "
                      f"states {engine} computed with its own kernels and runs on them; where two "
                      "draft logits nearly tie, the rounding difference flips the draft")
        if sliding:
            causes.append("the drafter has sliding-window layers: the window at the block "
                          "edge is where implementations differ")
    return causes


def checked_target_config(model: str, store: Store):
    """--model's config, once the same-target rule says it is the store's target (EvalError
    naming what differs otherwise); the serving engines read their limits from it."""
    from dflash_train.evaluate.online import check_target
    from dflash_train.target_model.errors import TargetError
    from dflash_train.target_model.loading import load_target_config, target_info

    try:
        config = load_target_config(model)
        info = target_info(model, config)
    except TargetError as e:
        raise EvalError(str(e)) from e
    check_target(model, info, store.meta.target)
    return config
