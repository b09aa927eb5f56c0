"""`dflash eval` end to end: open the store, load and check checkpoints, replay, run each
decode mode (modes.py: --online, --served), report.

Owns the order of things: every input is checked (options, device, output paths, store,
checkpoints against the store, plot dependency, each decode mode's target and engine, the
stop rule) before the first drafter forward; unfinished parts of the store are left out
(named on stderr) as train does; all checkpoints see the same samples and blocks; the outputs
are written only after every number is computed.
Deterministic: sample choice depends only on --limit / --seed, batching only on the store
and the options, so the same command gives the same numbers.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_train.blocks import eligible_anchors
from dflash_train.devices import resolve_device
from dflash_train.dtypes import resolve_dtype
from dflash_train.evaluate.checkpoints import (
    EvalCheckpoint,
    layer_selection,
    load_checkpoint,
    unique_names,
)
from dflash_train.evaluate.config import DEFAULT_MAX_NEW_TOKENS, EvalConfig, EvalSettings
from dflash_train.evaluate.damage import DamagePolicy, check_store
from dflash_train.evaluate.drafting import BlockDrafter
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.modes import DecodeMode, EvalInputs, decode_modes, offline_run
from dflash_train.evaluate.online import StopRule
from dflash_train.evaluate.replay import draft_at, evaluate_offline
from dflash_train.evaluate.report import (
    BLOCKS_FILE,
    REPORT_FILE,
    CheckpointEntry,
    EvalReport,
    ShownBlock,
    block_rows,
    format_shown,
    format_table,
    plot_acceptance,
    require_matplotlib,
    write_json,
    write_parquet,
)
from dflash_train.evaluate.results import Agreement, ModeResults
from dflash_train.evaluate.samples import EvalSample, labels_for, pick_samples, read_samples
from dflash_train.evaluate.summary import RunLabel
from dflash_train.evaluate.tokenizer import store_tokenizer
from dflash_train.store_schema import Store, StoreError, open_store


@dataclass
class EvalOutcome:
    """What a run produced."""

    report: dict
    """The report as written (EvalReport.to_json())."""
    text: str
    """The table (and shown blocks) as printed."""
    runs: dict[RunLabel, ModeResults]
    """Offline replay and each decode mode's run, by label."""
    written: list[str]
    """Files written."""
    notes: list[str]
    """Outputs skipped, and why."""

    def _results(self, label: RunLabel) -> dict | None:
        return self.runs[label].results if label in self.runs else None

    @property
    def offline(self) -> dict:
        """CheckpointResults per checkpoint name."""
        return self.runs["offline"].results

    @property
    def online(self) -> dict | None:
        """CheckpointResults per checkpoint name of the live run."""
        return self._results("online")

    @property
    def served(self) -> dict | None:
        """ServedResults per checkpoint name of the served run."""
        return self._results("served")

    @property
    def generated(self) -> dict | None:
        """Per sample key, the tokens generated live (the same for every checkpoint)."""
        if "online" not in self.runs:
            return None
        return next(iter(self.runs["online"].decoded.values())).text


def _open(url: str) -> Store:
    try:
        return open_store(url)
    except StoreError as e:
        raise EvalError(f"--store {url}: {e}") from e


def load_drafters(store: Store, paths: list[str], *, device: torch.device, dtype: torch.dtype
                  ) -> tuple[list[EvalCheckpoint], dict[str, BlockDrafter]]:
    """Load every checkpoint, refuse misfits, attach the store's frozen embed / lm_head."""
    if not paths:
        raise EvalError("no checkpoint given")
    checkpoints = [load_checkpoint(p, store.meta, dtype=dtype, device=device) for p in paths]
    unique_names(checkpoints)
    try:
        rows = store.target_rows()
    except StoreError as e:
        raise EvalError(str(e)) from e
    embed = rows["embed_tokens"].to(device=device, dtype=dtype)
    head = rows["lm_head"].to(device=device, dtype=dtype)
    drafters = {}
    for c in checkpoints:
        c.model.attach_target_head(embed, head)
        drafters[c.name] = BlockDrafter(c.model, layer_selection(c.config, store.meta))
    return checkpoints, drafters


def _total_samples(store: Store, keys, damage: DamagePolicy) -> int:
    if keys is not None:
        return len(keys)
    return sum(p.num_samples for p in store.parts() if not damage.part_is_left_out(p.index))


def shown_blocks(drafters: dict[str, BlockDrafter], samples: list[EvalSample],
                 settings: EvalSettings) -> list[ShownBlock]:
    """One block per sample, at the middle eligible anchor, drafted by every checkpoint."""
    chosen = []
    for s in samples:
        anchors = eligible_anchors(s.loss_mask)
        if anchors.numel():
            chosen.append((s, int(anchors[anchors.numel() // 2])))
    if not chosen:
        return []
    picked = [s for s, _ in chosen]
    blocks = []
    drafts = {}
    for name, d in drafters.items():
        out = draft_at(d, picked, [torch.tensor([a]) for _, a in chosen],
                       settings.top_k(d.config.vocab_size), settings.blocks_per_forward)
        drafts[name] = [d.ids[0, 1:, 0].tolist() for d in out]
    longest = max(d.block_size for d in drafters.values())
    for i, (s, a) in enumerate(chosen):
        labels, valid = labels_for([(s, a)], longest)
        target = labels[0, 1:][valid[0, 1:]].tolist()
        blocks.append(ShownBlock(
            where=f"part {s.part} sample {s.index} (source row {s.source_row}), anchor {a}",
            context=s.input_ids[max(0, a - 24) : a + 1].tolist(), target=target,
            drafts={name: d[i] for name, d in drafts.items()}))
    return blocks


def run_eval(cfg: EvalConfig, echo: Callable[[str], None] = print) -> EvalOutcome:
    """Run `dflash eval`: check and prepare everything, replay offline, run each decode
    mode on the same prompts, then report; returns the report and every run's results."""
    modes = check_options(cfg)
    inputs, damage = prepare(cfg, modes, echo)
    keys = pick_samples(inputs.store, cfg.limit, cfg.seed, damage)
    total = _total_samples(inputs.store, keys, damage)
    if total == 0:
        raise EvalError(f"--store {cfg.store}: no sample to evaluate "
                        f"({_why_empty(damage, cfg.store)})")
    stop = stop_rule(cfg, inputs.store, modes) if modes else None
    offline, agreement, shown, prompts = replay_offline(cfg, inputs, damage, keys, total,
                                                        keep_prompts=bool(modes))
    runs = [offline]
    for mode in modes:
        runs.append(mode.run(inputs, prompts, stop, runs))
    evaluated = _evaluated(cfg, damage, total, offline, echo)
    report = EvalReport(
        store=cfg.store, meta=inputs.store.meta, settings=inputs.settings, samples=evaluated,
        limit=cfg.limit, seed=cfg.seed, agreement=agreement,
        checkpoints=[_entry(c, runs) for c in inputs.checkpoints],
        checks={r.label: r.check for r in runs[1:]}, skipped=damage.report()).to_json()
    text = format_table(report)
    if cfg.show:
        text += "\n\n" + format_shown(shown_blocks(inputs.drafters, shown, inputs.settings),
                                      store_tokenizer(inputs.store))
    try:
        written, notes = _write_outputs(cfg, report, runs)
    except OSError as e:  # checked up front; this is a race or a full disk
        raise EvalError(f"cannot write the outputs: {e}") from e
    return EvalOutcome(report, text, {r.label: r for r in runs}, written, notes)


def prepare(cfg: EvalConfig, modes: list[DecodeMode], echo: Callable[[str], None]
            ) -> tuple[EvalInputs, DamagePolicy]:
    """Open and check the store, load and check the checkpoints, prepare each decode mode:
    everything that can be refused is refused here, before the first drafter forward."""
    device = resolve_device(cfg.device, EvalError)
    dtype = resolve_dtype(cfg.dtype, device)
    store = _open(cfg.store)
    damage = check_store(store, cfg.skip_corrupt)  # reads no chunk data: offsets and listings
    if damage.unfinished:
        echo(f"leaving out unfinished parts {damage.unfinished} of {cfg.store} (extraction "
             "has not completed them; train skips them too)")
    for d in damage.known:
        echo(f"skipping damaged data (--skip-corrupt): {d}")
    budgets = cfg.settings.tree_budgets
    if any(b < 1 for b in budgets) or any(k < 1 for k in cfg.settings.recall_at):
        raise EvalError(f"tree budgets {budgets} and recall k {cfg.settings.recall_at} "
                        "must be >= 1")
    if cfg.settings.position_bin < 1:
        raise EvalError(f"--position-bin {cfg.settings.position_bin}: a bin spans at least "
                        "1 token")
    vocab = store.meta.target.vocab_size
    settings = replace(cfg.settings,
                       recall_at=tuple(sorted({min(k, vocab) for k in cfg.settings.recall_at})))
    _check_temperature(store, cfg.temperature)
    checkpoints, drafters = load_drafters(store, cfg.checkpoints, device=device, dtype=dtype)
    for mode in modes:
        mode.prepare(cfg, store, device)
    return EvalInputs(store, settings, checkpoints, drafters, echo), damage


def _check_temperature(store: Store, temperature: float | None) -> None:
    """--temperature states the temperature the user means to evaluate at; every mode decodes
    with the store's settings (--online and --served sample as its answers were drawn), so
    it must be the store's (0 for a greedy store)."""
    try:
        sampling = store.meta.sampling
    except StoreError as e:
        raise EvalError(f"--store {store.url}: {e}") from e
    stored = 0.0 if sampling is None else float(sampling["temperature"])
    if temperature is not None and temperature != stored:
        drawn = "greedily" if sampling is None else f"at temperature {stored} ({sampling})"
        raise EvalError(f"--temperature {temperature}, but the store's answers were drawn "
                        f"{drawn}: eval decodes with the store's settings; give --temperature "
                        f"{stored}, drop it, or extract a store at {temperature}")


def replay_offline(cfg: EvalConfig, inputs: EvalInputs, damage: DamagePolicy, keys,
                   total: int, *, keep_prompts: bool
                   ) -> tuple[ModeResults, Agreement, list[EvalSample], list[EvalSample]]:
    """Offline replay of every checkpoint; also keeps the samples --show prints and, for
    the decode modes, every sample's prompt and stored text (without its contexts)."""
    shown: list[EvalSample] = []
    prompts: list[EvalSample] = []
    bar = tqdm(total=total, unit="seq", disable=not cfg.progress, desc="eval")

    def on_batch(batch: list[EvalSample]) -> None:
        for s in batch:
            if len(shown) < cfg.show:
                shown.append(s)
            if keep_prompts:
                prompts.append(EvalSample(s.part, s.index, s.source_row, s.input_ids,
                                          s.loss_mask, torch.empty(0), s.top1))
        bar.update(len(batch))

    try:
        samples = read_samples(inputs.store, keys, damage)
        results, agreement = evaluate_offline(inputs.drafters, samples, inputs.settings,
                                              on_batch)
    except StoreError as e:
        raise EvalError(f"--store {cfg.store}: {e}") from e
    finally:
        bar.close()
    return offline_run(results, prompts, inputs.settings), agreement, shown, prompts


def _evaluated(cfg: EvalConfig, damage: DamagePolicy, total: int, offline: ModeResults,
               echo: Callable[[str], None]) -> int:
    """Samples evaluated; EvalError when damage or empty loss masks left none."""
    skipped = damage.report()["samples"]
    for d in [d for d in damage.skipped if d not in damage.known]:  # found while reading
        echo(f"skipped damaged data (--skip-corrupt): {d}")
    if total - skipped <= 0:
        raise EvalError(f"--store {cfg.store}: every sample chosen was damaged and skipped; "
                        "nothing was evaluated")
    if all(r.walks[None].taus.summary()["n"] == 0 for r in offline.results.values()):
        raise EvalError(f"--store {cfg.store}: none of the {total - skipped} "
                        "samples has a response token to draft at (empty loss masks?); "
                        "nothing was evaluated")
    return total - skipped


def _entry(c: EvalCheckpoint, runs: list[ModeResults]) -> CheckpointEntry:
    trained_on = None if c.provenance is None else c.provenance.source.paths
    return CheckpointEntry(c.name, c.path, trained_on,
                           {r.label: r.results[c.name].summary() for r in runs})


def check_options(cfg: EvalConfig) -> list[DecodeMode]:
    """Refuse option combinations and output paths that cannot work, before any reading;
    the decode modes the options ask for."""
    modes = decode_modes(cfg)
    for mode in modes:
        mode.check_options(cfg)
    served_only = [name for name, given in (("--vllm-python", cfg.vllm_python),
                                            ("--llama-server", cfg.llama_server),
                                            (f"--engine {cfg.engine}", cfg.engine != "vllm"),
                                            ("--no-speed", not cfg.speed))
                   if given]
    if served_only and not cfg.served:
        raise EvalError(f"{served_only[0]} only applies to --served; add --served or drop it")
    if cfg.no_cache and not cfg.online:
        raise EvalError("--no-cache only applies to --online; add --online or drop it")
    if not modes:
        # Offline replay never loads the target: a --model given without --online would be
        # silently ignored, and the user would read offline numbers as live ones.
        given = [name for name, value in (("--model", cfg.model),
                                          ("--max-new-tokens", cfg.max_new_tokens))
                 if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise EvalError(f"{' and '.join(given)} only {verb} to --online or --served "
                            "(decoding with the target); add one, or drop it for offline "
                            "replay")
    if cfg.out is not None:
        _check_writable_dir(Path(cfg.out), "--out")
    if cfg.plot:
        require_matplotlib()
        plot = Path(cfg.plot)
        if plot.is_dir():
            raise EvalError(f"--plot {cfg.plot}: is a directory; give the PNG file's path")
        parent = plot.parent
        if not parent.is_dir():
            raise EvalError(f"--plot {cfg.plot}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise EvalError(f"--plot {cfg.plot}: directory {parent} is not writable")
        _check_plot_format(plot)
    return modes


def _check_writable_dir(path: Path, option: str) -> None:
    """`path` is a directory, or can be created as one (its first existing ancestor is a
    writable directory)."""
    if path.exists():
        if not path.is_dir():
            raise EvalError(f"{option} {path}: exists and is not a directory")
        if not os.access(path, os.W_OK):
            raise EvalError(f"{option} {path}: directory is not writable")
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise EvalError(f"{option} {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK):
        raise EvalError(f"{option} {path}: cannot create it under {ancestor} (not writable)")


def _check_plot_format(plot: Path) -> None:
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = plot.suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise EvalError(f"--plot {plot}: matplotlib cannot write .{suffix} files (use one "
                        f"of {', '.join(sorted(formats))})")


def _why_empty(damage: DamagePolicy, url: str) -> str:
    reasons = []
    if damage.unfinished:
        reasons.append(f"parts {damage.unfinished} are unfinished; finish extraction first")
    damaged = sorted({d.part for d in damage.known if d.sample is None and d.part is not None})
    if damaged:
        reasons.append(f"parts {damaged} are damaged; run `dflash store validate {url}`")
    return "; ".join(reasons) if reasons else "it holds no committed sample"


def stop_rule(cfg: EvalConfig, store: Store, modes: list[DecodeMode]) -> StopRule:
    """When every decode mode's generations end: at the end-of-turn ids of the target's
    generation config (the loaded target's, when a mode loaded one, else the --model
    directory's), after --max-new-tokens, or at the store's max_length."""
    from dflash_train.target_model.generation import eos_token_ids

    model, tokenizer = cfg.model, store_tokenizer(store)
    max_new_tokens = cfg.max_new_tokens
    if tokenizer is None:
        from transformers import AutoTokenizer

        from dflash_train.target_model.loading import from_pretrained_args

        where, kwargs = from_pretrained_args(model)
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    if max_new_tokens is None:
        max_new_tokens = store.meta.extra.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    loaded = [s for m in modes if (s := m.generation_source()) is not None]
    source = loaded[0] if loaded else _generation_source(model)
    return StopRule(eos_ids=eos_token_ids(source, tokenizer),
                    max_new_tokens=int(max_new_tokens),
                    max_length=store.meta.source.max_length)


def _generation_source(model: str):
    """What eos_token_ids reads of a loaded model (its generation_config), from a directory:
    generation_config.json, else the model config, as from_pretrained builds it."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from dflash_train.target_model.loading import load_target_config

    try:
        generation = GenerationConfig.from_pretrained(model)
    except OSError:
        generation = GenerationConfig.from_model_config(load_target_config(model))
    return SimpleNamespace(generation_config=generation)


def _write_outputs(cfg: EvalConfig, report: dict, runs: list[ModeResults]
                   ) -> tuple[list[str], list[str]]:
    written, notes = [], []
    plot = cfg.plot
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        # report.json is the set's last write, removed first: it never stands beside
        # another run's blocks.parquet
        (out / REPORT_FILE).unlink(missing_ok=True)
        write_parquet(block_rows({r.label: r.results for r in runs}), out / BLOCKS_FILE)
        write_json(report, out / REPORT_FILE)
        written += [str(out / REPORT_FILE), str(out / BLOCKS_FILE)]
        if plot is None:
            try:
                require_matplotlib()
                plot = str(out / "acceptance.png")
            except EvalError as e:
                notes.append(f"no plot: {e}")
    if plot:
        plot_acceptance(report, plot)
        written.append(plot)
    return written, notes
