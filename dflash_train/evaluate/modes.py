"""The decode modes of `dflash eval`, beside offline replay: `--online` (our live loop) and
`--served` (a serving engine: vLLM, or llama.cpp with `--engine llama.cpp`). One interface:
check the options, prepare everything (load the target, find the engine, check it is the
store's target) before the first drafter forward, then run on the held-out prompts. A run's
results have one summary type (summary.py) and one table signature, and are checked by the
one agreement check (agreement.py); a new mode is one subclass here and one line in
`decode_modes`, a new engine one ServedMode subclass and one entry in SERVING_ENGINES.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from dflash_train.evaluate.agreement import Decoded, RunCheck, check_run
from dflash_train.evaluate.checkpoints import Checkpoint
from dflash_train.evaluate.config import EvalConfig
from dflash_train.evaluate.drafting import BlockDrafter
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import StopRule, evaluate_online, load_online_target, prompt_of
from dflash_train.evaluate.replay import EvalSample, EvalSettings
from dflash_train.evaluate.served import ServedPlan, likely_causes, run_served
from dflash_train.evaluate.summary import RunLabel
from dflash_train.store_schema import Store


class RunResults(Protocol):
    """One checkpoint's results of any run (replay.CheckpointResults, served.ServedResults)."""

    sequences: dict[tuple[int, int], list[tuple[int, int]]]

    def summary(self) -> dict:
        """Its report column: a summary.Summary as JSON."""

    def table(self) -> dict[str, list]:
        """Its per-block rows (replay.ROW_NAMES), ordered by (walk, part, sample, anchor)."""


@dataclass
class EvalInputs:
    """What every run reads, all of it checked and loaded before the first forward."""

    store: Store
    settings: EvalSettings
    """The settings after clamping recall k to the vocabulary."""
    checkpoints: list[Checkpoint]
    drafters: dict[str, BlockDrafter]
    echo: Callable[[str], None]


@dataclass
class ModeRun:
    """A run of every checkpoint: offline replay, or a decode mode."""

    label: RunLabel
    results: dict[str, RunResults]
    """Per checkpoint name."""
    decoded: dict[str, Decoded]
    """Per checkpoint name: text and rounds per prompt, for the agreement check."""
    live_rounds: bool = True
    """Its rounds are the ones live decoding makes (offline: only in --mode replay), so later
    runs are checked against them."""
    check: dict | None = None
    """Its agreement check, as the report writes it (`<label>_check`)."""


def earlier_runs(runs: list[ModeRun], name: str) -> dict[str, Decoded]:
    """Checkpoint `name`'s runs a new run is compared with, in the order they ran."""
    return {r.label: r.decoded[name] for r in runs if r.live_rounds}


def check_runs(decoded: dict[str, Decoded], samples: list[EvalSample],
               earlier: list[ModeRun]) -> dict[str, RunCheck]:
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
            earlier: list[ModeRun]) -> ModeRun:
        """Decode every sample's prompt with every checkpoint; checked against `earlier`."""


class OnlineMode(DecodeMode):
    """`--online`: our greedy speculative decoding loop with the target (online.py)."""

    label = "online"
    flag = "--online"

    def prepare(self, cfg: EvalConfig, store: Store, device: torch.device) -> None:
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
        inputs.echo(f"online: decoding {len(samples)} prompts live with "
                    f"{len(inputs.drafters)} checkpoint(s) as {walks}, max "
                    f"{stop.max_new_tokens} new tokens, {how}")
        results, generated = evaluate_online(self.target, inputs.drafters, samples,
                                             inputs.settings, stop, cached=self.cached)
        lengths = {s.key: len(p) for s in samples if (p := prompt_of(s)) is not None}
        decoded = {n: Decoded(generated, r.sequences, lengths, r.tree_sequences)
                   for n, r in results.items()}
        checks = check_runs(decoded, samples, earlier)
        return ModeRun(self.label, results, decoded, check=self.check_json(checks))

    @staticmethod
    def check_json(checks: dict[str, RunCheck]) -> dict:
        """The text is the target's, whatever the drafter: the first checkpoint's says it."""
        first = next(iter(checks.values()))
        replayed = {n: c.taus_differ["offline"] for n, c in checks.items()
                    if "offline" in c.taus_differ}  # offline rounds are live ones in replay
        trees = {n: c.tree_taus_differ["offline"] for n, c in checks.items()
                 if "offline" in c.tree_taus_differ}
        return {"prompts": first.prompts, "same_text": first.prompts - len(first.text_differs),
                "text_differs": _named(first.text_differs),
                "same_taus": {n: first.prompts - len(keys) for n, keys in replayed.items()},
                "taus_differ": {n: _named(keys) for n, keys in replayed.items()},
                "same_tree_taus": {n: {str(b): first.prompts - len(keys)
                                       for b, keys in by_budget.items()}
                                   for n, by_budget in trees.items()},
                "tree_taus_differ": {n: {str(b): _named(keys) for b, keys in by_budget.items()}
                                     for n, by_budget in trees.items()}}


class ServedMode(DecodeMode):
    """`--served`: a serving engine decodes the prompts; subclasses are the engines."""

    label = "served"
    flag = "--served"

    @abstractmethod
    def serve(self, inputs: EvalInputs, samples: list[EvalSample], stop: StopRule) -> dict:
        """served.ServedResults per checkpoint name."""

    @abstractmethod
    def causes(self, diff: dict, inputs: EvalInputs, name: str) -> list[str]:
        """What is known of why checkpoint `name`'s served run differs as `diff` says."""

    def run(self, inputs, samples, stop, earlier):
        served = self.serve(inputs, samples, stop)
        for results in served.values():  # an engine counts rounds; the bins are eval's
            results.position_bin = inputs.settings.position_bin
        decoded = {n: r.decoded() for n, r in served.items()}
        checks = check_runs(decoded, samples, earlier)
        return ModeRun(self.label, served, decoded, check=self.check_json(checks, inputs))

    def check_json(self, checks: dict[str, RunCheck], inputs: EvalInputs) -> dict:
        out = {"prompts": 0, "against": None, "checkpoints": {}}
        for name, c in checks.items():
            entry = {"same_text": c.prompts - len(c.text_differs)}
            entry |= {f"same_taus_as_{label}": c.prompts - len(keys)
                      for label, keys in c.taus_differ.items()}
            entry["first_difference"] = c.first_difference
            entry["likely_causes"] = None if c.first_difference is None else \
                self.causes(c.first_difference, inputs, name)
            out |= {"prompts": c.prompts, "against": c.against}
            out["checkpoints"][name] = entry
        return out


class VllmMode(ServedMode):
    """`--served` through vLLM, in its own Python (served.py)."""

    def check_options(self, cfg: EvalConfig) -> None:
        super().check_options(cfg)
        if cfg.llama_server:
            raise EvalError("--llama-server only applies to --served --engine llama.cpp")
        if not (Path(cfg.model) / "config.json").is_file():
            raise EvalError(f"--served --model {cfg.model}: vLLM serves a model directory "
                            "(config.json + safetensors); give the target's directory (for "
                            "a .gguf target, its float32 safetensors copy is a separate "
                            "target)")

    def prepare(self, cfg: EvalConfig, store: Store, device: torch.device) -> None:
        self.plan = vllm_plan(cfg, store)

    def serve(self, inputs, samples, stop):
        paths = {c.name: (c.path, c.config.block_size) for c in inputs.checkpoints}
        return run_served(self.plan, paths, samples, stop, inputs.echo)

    def causes(self, diff, inputs, name):
        meta = inputs.store.meta
        config = next(c.config for c in inputs.checkpoints if c.name == name)
        return likely_causes(diff, served_dtype=self.plan.dtype, store_dtype=meta.hidden_dtype,
                             regenerated=meta.source.regenerated,
                             sliding="sliding_attention" in config.layer_types,
                             drafter_dtype=self.plan.dtype)


def checked_target_config(model: str, store: Store):
    """--model's config, once the same-target rule says it is the store's target (EvalError
    naming what differs otherwise); the serving engines read their limits from it."""
    from dflash_train.evaluate.online import check_target
    from dflash_train.target_model.errors import TargetError
    from dflash_train.target_model.loading import load_config, target_info

    try:
        config = load_config(model)
        info = target_info(model, config)
    except TargetError as e:
        raise EvalError(str(e)) from e
    check_target(model, info, store.meta.target)
    return config


def vllm_plan(cfg: EvalConfig, store: Store) -> ServedPlan:
    """Find vLLM and check --model is the store's target, before the first forward."""
    from dflash_train.evaluate.served import find_vllm
    from dflash_train.target_config import config_field, text_part

    python = find_vllm(cfg.vllm_python)
    config = checked_target_config(cfg.model, store)
    return ServedPlan(python=python, target=str(Path(cfg.model).resolve()),
                      dtype=store.meta.hidden_dtype,
                      max_position=config_field(text_part(config), "max_position_embeddings"))


class LlamaCppMode(ServedMode):
    """`--served --engine llama.cpp`: llama-server with each checkpoint exported as a DFlash
    GGUF (served_llama.py)."""

    def check_options(self, cfg: EvalConfig) -> None:
        from dflash_train.evaluate.llama_server import find_llama_server

        super().check_options(cfg)
        if cfg.vllm_python:
            raise EvalError("--vllm-python only applies to --served --engine vllm")
        model = Path(cfg.model)
        if model.suffix.lower() != ".gguf" or not model.is_file():
            raise EvalError(f"--served --engine llama.cpp --model {cfg.model}: llama-server "
                            "serves a target .gguf file and this is not one (convert the "
                            "target with llama.cpp's convert_hf_to_gguf.py; float32 for a "
                            "like-for-like check)")
        find_llama_server(cfg.llama_server)  # a wrong --llama-server is refused before work

    def prepare(self, cfg: EvalConfig, store: Store, device: torch.device) -> None:
        self.plan = llama_plan(cfg, store)

    def serve(self, inputs, samples, stop):
        from dflash_train.evaluate.served_llama import run_llama_served

        paths = {c.name: (c.path, c.config.block_size) for c in inputs.checkpoints}
        self.served = run_llama_served(self.plan, paths, samples, stop, inputs.echo)
        return self.served

    def causes(self, diff, inputs, name):
        meta = inputs.store.meta
        config = next(c.config for c in inputs.checkpoints if c.name == name)
        served = "float32" if self.plan.target_type == "ALL_F32" else self.plan.target_type
        causes = likely_causes(diff, served_dtype=served, store_dtype=meta.hidden_dtype,
                               regenerated=meta.source.regenerated,
                               sliding="sliding_attention" in config.layer_types,
                               drafter_dtype=self.plan.dtype, engine="llama.cpp")
        if diff["kind"] == "text" and \
                diff["prompt"] in self.served[name].info["stopped_on_other_eog"]:
            causes.insert(1, "llama.cpp stopped on an end-of-generation token of its "
                             "vocabulary that --online's stop rule does not end on")
        return causes


def llama_plan(cfg: EvalConfig, store: Store):
    """Find llama-server and check --model is the store's target, before the first forward."""
    from dflash_train.evaluate.llama_server import find_llama_server
    from dflash_train.evaluate.served_llama import LlamaPlan, server_version, target_file_type
    from dflash_train.target_config import config_field, text_part

    binary = find_llama_server(cfg.llama_server)
    config = checked_target_config(cfg.model, store)
    return LlamaPlan(binary=binary, version=server_version(binary),
                     target=str(Path(cfg.model).resolve()),
                     target_type=target_file_type(Path(cfg.model)),
                     vocab=config_field(text_part(config), "vocab_size"),
                     dtype=store.meta.hidden_dtype, threads=torch.get_num_threads())


SERVING_ENGINES: dict[str, type[ServedMode]] = {"vllm": VllmMode, "llama.cpp": LlamaCppMode}
"""--served's engines by --engine name: each one ServedMode subclass."""


def decode_modes(cfg: EvalConfig) -> list[DecodeMode]:
    """The modes the options ask for, in the order they run (each checks the ones before)."""
    modes: list[DecodeMode] = []
    if cfg.online:
        modes.append(OnlineMode())
    if cfg.served:
        modes.append(SERVING_ENGINES[cfg.engine]())
    return modes


def offline_run(results: dict, samples: list[EvalSample], settings: EvalSettings) -> ModeRun:
    """Offline replay as a run the decode modes are checked against (its text: the store's)."""
    stored = {s.key: s.input_ids.tolist() for s in samples}
    decoded = {n: Decoded(stored, r.sequences, tree_rounds=r.tree_sequences)
               for n, r in results.items()}
    return ModeRun("offline", results, decoded, live_rounds=settings.mode == "replay")

