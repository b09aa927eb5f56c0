"""`dflash eval` end to end: open the store, load and check checkpoints, replay, report.

Owns the order of things: every input is checked (options, device, output paths, store,
checkpoints against the store, plot dependency, --online model) before the first drafter
forward; unfinished parts of the store are left out (named on stderr) as train does; all
checkpoints see the same samples and blocks; the outputs are written only after every number
is computed.
Deterministic: sample choice depends only on --limit / --seed, batching only on the store
and the options, so the same command gives the same numbers.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from dflash_train.blocks import eligible_anchors
from dflash_train.devices import resolve_device
from dflash_train.evaluate.checkpoints import (
    Checkpoint,
    layer_selection,
    load_checkpoint,
    unique_names,
)
from dflash_train.evaluate.damage import DamagePolicy, check_store
from dflash_train.evaluate.drafting import BlockDrafter
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import (
    StopRule,
    check_target,
    evaluate_online,
    load_online_target,
)
from dflash_train.evaluate.replay import (
    EvalSample,
    EvalSettings,
    draft_at,
    evaluate_offline,
    labels_for,
    pick_samples,
    read_samples,
)
from dflash_train.evaluate.report import (
    ShownBlock,
    block_rows,
    build_report,
    format_shown,
    format_table,
    plot_acceptance,
    require_matplotlib,
    write_json,
    write_parquet,
)
from dflash_train.evaluate.served import (
    ServedPlan,
    ServedResults,
    find_vllm,
    first_difference,
    likely_causes,
    run_served,
)
from dflash_train.evaluate.tokenizer import store_tokenizer
from dflash_train.store_schema import Store, StoreError, open_store
from dflash_train.target_config import config_field, text_part

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_MAX_NEW_TOKENS = 1024
"""--online generation length when neither the option nor the store's provenance sets it."""


@dataclass
class EvalConfig:
    """Everything `dflash eval` needs; the CLI maps its options one to one onto these."""

    store: str
    """The (held-out) store: local path or fsspec URL."""
    checkpoints: list[str]
    """Training checkpoints, exported drafters or third-party DFlash drafter directories."""
    settings: EvalSettings = field(default_factory=EvalSettings)
    """Mode, tree budgets, recall, batching."""
    limit: int | None = None
    """Evaluate this many samples, drawn uniformly by `seed`; None = every sample."""
    seed: int = 0
    """Seed of the --limit draw (nothing else is random)."""
    device: str = "auto"
    """Torch device; auto = cuda when available, else cpu."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Drafter compute dtype; auto = bf16 on CUDA, fp32 on CPU."""
    out: str | None = None
    """Directory for report.json, blocks.parquet and acceptance.png."""
    plot: str | None = None
    """PNG path of the per-slot acceptance plot (needs matplotlib)."""
    show: int = 0
    """Decoded example blocks to print."""
    online: bool = False
    """Also run live greedy speculative decoding with the target (--model)."""
    model: str | None = None
    """The target checkpoint for --online."""
    max_new_tokens: int | None = None
    """--online generation length; None = the store's regeneration setting (or 1024)."""
    progress: bool = True
    """Show a progress bar."""
    skip_corrupt: bool = False
    """Skip damaged samples of the store (listed in the report) instead of refusing it."""
    served: bool = False
    """Also serve the target (--model) with each checkpoint through vLLM, greedy on the same
    prompts, and report vLLM's own acceptance counters."""
    vllm_python: str | None = None
    """The Python that runs vLLM for --served; None: this one when it imports vllm, else the
    venv scripts/vllm_venv.sh builds."""


@dataclass
class EvalOutcome:
    """What a run produced."""

    report: dict
    text: str
    """The table (and shown blocks) as printed."""
    offline: dict
    """CheckpointResults per checkpoint name."""
    online: dict | None
    """CheckpointResults per checkpoint name of the live run."""
    generated: dict | None
    """Per sample key, the tokens generated live."""
    served: dict | None
    """ServedResults per checkpoint name of the vLLM run."""
    written: list[str]
    """Files written."""
    notes: list[str]
    """Outputs skipped, and why."""


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def _open(url: str) -> Store:
    try:
        return open_store(url)
    except StoreError as e:
        raise EvalError(f"--store {url}: {e}") from e


def load_drafters(store: Store, paths: list[str], *, device: torch.device, dtype: torch.dtype
                  ) -> tuple[list[Checkpoint], dict[str, BlockDrafter]]:
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
        drafts[name] = [ids[0, 1:, 0].tolist() for _, ids in out]
    longest = max(d.block_size for d in drafters.values())
    for i, (s, a) in enumerate(chosen):
        labels, valid = labels_for([(s, a)], longest)
        target = labels[0, 1:][valid[0, 1:]].tolist()
        blocks.append(ShownBlock(
            where=f"part {s.part} sample {s.index} (source row {s.source_row}), anchor {a}",
            context=s.input_ids[max(0, a - 24) : a + 1].tolist(), target=target,
            drafts={name: d[i] for name, d in drafts.items()}))
    return blocks


def _online_check(offline: dict, online: dict, generated: dict, samples: list[EvalSample],
                  mode: str) -> dict:
    """How far offline replay matches the live run, prompt by prompt."""
    stored = {s.key: s.input_ids.tolist() for s in samples}
    keys = sorted(generated)
    same_text = [k for k in keys if generated[k] == stored[k]]
    check = {"prompts": len(keys), "same_text": len(same_text),
             "text_differs": [f"{p}/{i}" for p, i in keys if generated[(p, i)] != stored[(p, i)]],
             "same_taus": {}, "taus_differ": {}}
    if mode != "replay":
        return check
    for name in offline:
        a, b = offline[name].sequences, online[name].sequences
        differ = [k for k in keys if a.get(k, []) != b.get(k, [])]
        check["same_taus"][name] = len(keys) - len(differ)
        check["taus_differ"][name] = [f"{p}/{i}" for p, i in differ]
    return check


def run_eval(cfg: EvalConfig, echo: Callable[[str], None] = print) -> EvalOutcome:
    """Run `dflash eval`; returns the report and the per-checkpoint results."""
    check_options(cfg)
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
    vocab = store.meta.target.vocab_size
    settings = replace(cfg.settings,
                       recall_at=tuple(sorted({min(k, vocab) for k in cfg.settings.recall_at})))
    checkpoints, drafters = load_drafters(store, cfg.checkpoints, device=device, dtype=dtype)
    target = load_online_target(cfg.model, store.meta, device=str(device)) if cfg.online \
        else None
    plan = _served_plan(cfg, store) if cfg.served else None

    keys = pick_samples(store, cfg.limit, cfg.seed, damage)
    total = _total_samples(store, keys, damage)
    if total == 0:
        raise EvalError(f"--store {cfg.store}: no sample to evaluate "
                        f"({_why_empty(damage, cfg.store)})")
    kept_for_show: list[EvalSample] = []
    kept_light: list[EvalSample] = []
    bar = tqdm(total=total, unit="seq", disable=not cfg.progress, desc="eval")

    def on_batch(batch: list[EvalSample]) -> None:
        for s in batch:
            if len(kept_for_show) < cfg.show:
                kept_for_show.append(s)
            if cfg.online or cfg.served:  # prompts and stored text only: no contexts
                kept_light.append(EvalSample(s.part, s.index, s.source_row, s.input_ids,
                                             s.loss_mask, torch.empty(0), s.top1))
        bar.update(len(batch))

    try:
        offline, agreement = evaluate_offline(drafters, read_samples(store, keys, damage),
                                              settings, on_batch)
    except StoreError as e:
        raise EvalError(f"--store {cfg.store}: {e}") from e
    finally:
        bar.close()

    online = generated = check = stop = None
    if target is not None or plan is not None:
        stop = _stop_rule(target, cfg.model, store_tokenizer(store), store, cfg.max_new_tokens)
    if target is not None:
        echo(f"online: decoding {len(kept_light)} prompts live with {len(drafters)} "
             f"checkpoint(s), max {stop.max_new_tokens} new tokens (the target is recomputed "
             "over the whole sequence every round)")
        online, generated = evaluate_online(target, drafters, kept_light, settings, stop)
        check = _online_check(offline, online, generated, kept_light, settings.mode)
    served = served_check = None
    if plan is not None:
        served = run_served(plan, {c.name: (c.path, c.config.block_size) for c in checkpoints},
                            kept_light, stop, echo)
        served_check = _served_check(served, offline, online, generated, kept_light,
                                     settings.mode, store, plan, checkpoints)

    skipped = damage.report()
    for d in [d for d in damage.skipped if d not in damage.known]:  # found while reading
        echo(f"skipped damaged data (--skip-corrupt): {d}")
    if total - skipped["samples"] <= 0:
        raise EvalError(f"--store {cfg.store}: every sample chosen was damaged and skipped; "
                        "nothing was evaluated")
    if all(r.stats.summary()["n_blocks"] == 0 for r in offline.values()):
        raise EvalError(f"--store {cfg.store}: none of the {total - skipped['samples']} "
                        "samples has a response token to draft at (empty loss masks?); "
                        "nothing was evaluated")
    report = build_report(
        store_url=cfg.store, meta=store.meta, settings=settings,
        samples=total - skipped["samples"], skipped=skipped,
        limit=cfg.limit, seed=cfg.seed,
        checkpoints=[{"name": c.name, "path": c.path,
                      "trained_on": None if c.provenance is None else
                      c.provenance.source.paths} for c in checkpoints],
        offline=offline, agreement=agreement, online=online, online_check=check,
        served=served, served_check=served_check)
    text = format_table(report)
    if cfg.show:
        text += "\n\n" + format_shown(shown_blocks(drafters, kept_for_show, settings),
                                      store_tokenizer(store))
    try:
        written, notes = _write_outputs(cfg, report, offline, online, served)
    except OSError as e:  # checked up front; this is a race or a full disk
        raise EvalError(f"cannot write the outputs: {e}") from e
    return EvalOutcome(report, text, offline, online, generated, served, written, notes)


def check_options(cfg: EvalConfig) -> None:
    """Refuse option combinations and output paths that cannot work, before any reading."""
    for flag, on in (("--online", cfg.online), ("--served", cfg.served)):
        if on and not cfg.model:
            raise EvalError(f"{flag} needs --model (the target checkpoint)")
    if cfg.vllm_python and not cfg.served:
        raise EvalError("--vllm-python only applies to --served; add --served or drop it")
    if cfg.served and cfg.model and not (Path(cfg.model) / "config.json").is_file():
        raise EvalError(f"--served --model {cfg.model}: vLLM serves a model directory "
                        "(config.json + safetensors); give the target's directory (for a "
                        ".gguf target, its float32 safetensors copy is a separate target)")
    if not (cfg.online or cfg.served):
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


def _stop_rule(target, model: str, tokenizer, store: Store, max_new_tokens: int | None
               ) -> StopRule:
    """--online's stop rule (the loaded target's generation config when `target` is given,
    else the one in the --model directory), which --served uses too."""
    from dflash_train.extract.regenerate import eos_token_ids

    if tokenizer is None:
        from transformers import AutoTokenizer

        from dflash_train.extract.loading import from_pretrained_args

        where, kwargs = from_pretrained_args(model)
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    if max_new_tokens is None:
        max_new_tokens = store.meta.extra.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    source = target.target.model if target is not None else _generation_source(model)
    return StopRule(eos_ids=eos_token_ids(source, tokenizer),
                    max_new_tokens=int(max_new_tokens),
                    max_length=store.meta.source.max_length)


def _generation_source(model: str):
    """What eos_token_ids reads of a loaded model (its generation_config), from a directory:
    generation_config.json, else the model config, as from_pretrained builds it."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from dflash_train.extract.loading import load_config

    try:
        generation = GenerationConfig.from_pretrained(model)
    except OSError:
        generation = GenerationConfig.from_model_config(load_config(model))
    return SimpleNamespace(generation_config=generation)


def _served_plan(cfg: EvalConfig, store: Store) -> ServedPlan:
    """Find vLLM and check --model is the store's target, before the first forward."""
    from dflash_train.extract.errors import ExtractError
    from dflash_train.extract.loading import load_config, target_info

    python = find_vllm(cfg.vllm_python)
    try:
        config = load_config(cfg.model)
        info = target_info(cfg.model, config)
    except ExtractError as e:
        raise EvalError(str(e)) from e
    check_target(cfg.model, info, store.meta.target)
    return ServedPlan(python=python, target=str(Path(cfg.model).resolve()),
                      dtype=store.meta.hidden_dtype,
                      max_position=config_field(text_part(config), "max_position_embeddings"))


def _served_check(served: dict[str, ServedResults], offline: dict, online: dict | None,
                  generated: dict | None, samples: list[EvalSample], mode: str, store: Store,
                  plan: ServedPlan, checkpoints: list[Checkpoint]) -> dict:
    """Served vs offline replay (or --online, when replay is not the live order), prompt by
    prompt: equal text, equal rounds, and the first difference with its likely causes."""
    stored = {s.key: s.input_ids.tolist() for s in samples}
    configs = {c.name: c.config for c in checkpoints}
    against = "offline" if mode == "replay" else "online" if online else None
    out = {"prompts": 0, "against": against, "checkpoints": {}}
    for name, results in served.items():
        runs = results.runs
        out["prompts"] = len(runs)
        entry = {"same_text": sum(stored.get(r.prompt.sample.key) == r.tokens for r in runs)}
        for label, ref in (("offline", offline), ("online", online)):
            if ref is None or (label == "offline" and mode != "replay"):
                continue
            seqs = ref[name].sequences
            entry[f"same_taus_as_{label}"] = sum(
                list(zip(r.anchors, r.committed, strict=True)) == seqs.get(r.prompt.sample.key, [])
                for r in runs)
        diff = None
        if against == "offline":
            diff = first_difference(results, stored, offline[name].sequences)
        elif against == "online":
            diff = first_difference(results, generated, online[name].sequences)
        entry["first_difference"] = diff
        entry["likely_causes"] = None if diff is None else likely_causes(
            diff, served_dtype=plan.dtype, store_dtype=store.meta.hidden_dtype,
            regenerated=store.meta.source.regenerated,
            sliding="sliding_attention" in configs[name].layer_types, drafter_dtype=plan.dtype)
        out["checkpoints"][name] = entry
    return out


def _write_outputs(cfg: EvalConfig, report: dict, offline: dict, online: dict | None,
                   served: dict | None = None) -> tuple[list[str], list[str]]:
    written, notes = [], []
    plot = cfg.plot
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(report, out / "report.json")
        write_parquet(block_rows(offline, online, served, report["tree_budgets"]),
                      out / "blocks.parquet")
        written += [str(out / "report.json"), str(out / "blocks.parquet")]
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
