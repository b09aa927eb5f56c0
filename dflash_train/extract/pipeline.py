"""`dflash extract` end to end: plan, scan, check, load, then fill my parts (fill.py).

Owns the order of things before the first write: every part is a fixed slice of rows and
rank r of W takes parts r, r + W, ...; input errors surface in a scan before the store is
created or the model loaded; sampling settings that would do nothing (without --regenerate,
or beside --temperature 0) are refused before the scan; a store of something else at --out
(another seed, temperature or sampler included), and a server of another model, are refused
before the target loads. `plan_extract` gives the plan (all a dry run prints),
`build_extract` the run that carries it out, `store_meta` the provenance the store is made
with (run.py holds the types).
Never knows zarr paths: the store is reached only through dflash_train.store_schema.
"""

from dataclasses import asdict, replace
from pathlib import Path

import torch
import transformers

import dflash_train
from dflash_train.devices import resolve_device
from dflash_train.drafter.config import default_mask_token_id
from dflash_train.dtypes import dtype_name, resolve_dtype
from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.data import ChatSource, open_source
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.fill import fill_store
from dflash_train.extract.layers import resolve_layer_ids
from dflash_train.extract.plan import PartPlan, parts_of_rank, plan_parts
from dflash_train.extract.prepare import Counts, Item, apply_length_policy, prompt_fits, render_rows
from dflash_train.extract.run import ExtractPlan, ExtractRun, ExtractSummary
from dflash_train.extract.server_generate import Server, check_agreement, check_servers
from dflash_train.store_schema import (
    CreatedWith,
    SourceInfo,
    StoreMeta,
    TargetInfo,
    open_store,
    target_differences,
)
from dflash_train.store_schema.layout import FP8_CONTEXT
from dflash_train.store_schema.meta import DRAWN_BY_KEY, SAMPLING_KEY, SERVER_DRAWN
from dflash_train.store_schema.store import store_exists
from dflash_train.target_model.kernels import missing_kernels_note
from dflash_train.target_model.loading import (
    load_target,
    load_target_config,
    load_tokenizer,
    spare_special_ids,
    target_info,
    tokenizer_info,
)
from dflash_train.target_model.sampling import GREEDY


def run_extract(cfg: ExtractConfig, *, rank: int = 0, world_size: int = 1,
                echo=print) -> ExtractSummary:
    """Run extract for this rank; returns what it did."""
    if cfg.dry_run:
        plan = plan_extract(cfg, rank, world_size, echo)
        _print_plan(plan, echo)
        return ExtractSummary(cfg.out, bytes_per_token=plan.bytes_per_token)
    run = build_extract(cfg, rank, world_size, echo)
    try:
        summary = fill_store(run)
    except OSError as e:
        raise ExtractError(_write_failure(cfg.out, e)) from e
    if run.servers:  # a server of another model answers fluently, only the forward can tell
        check_agreement(open_store(cfg.out), run.servers, echo)
    return summary


def build_extract(cfg: ExtractConfig, rank: int, world: int, echo=print) -> ExtractRun:
    """Rank `rank` of `world`'s extract, ready to fill its parts: every refusal that needs no
    weights (input rows, another store at --out, a server of another model) made before the
    target loads; nothing written. Rank 0 says what every rank would."""
    plan = plan_extract(cfg, rank, world, echo)
    cfg = plan.cfg
    say = echo if rank == 0 else _silent
    device = resolve_device(cfg.device, ExtractError, rank)
    _refuse_different_store(cfg.out, store_meta(plan, device, "not loaded yet"), say)
    servers = _checked_servers(plan)
    target = load_target(cfg.model, device=str(device), dtype=plan.dtype, load_as=cfg.load_as,
                         revision=cfg.revision, progress=cfg.progress)
    note = missing_kernels_note(plan.model_config, device)
    if note:
        say(note)
    return ExtractRun(plan=plan, meta=store_meta(plan, device, target.kernels), target=target,
                      servers=servers)


def plan_extract(cfg: ExtractConfig, rank: int, world: int, echo=print) -> ExtractPlan:
    """Rank `rank` of `world`'s share of the extract `cfg` describes. Input errors surface
    here, in a scan of every row, before the store is created or the model loaded."""
    if not 0 <= rank < world:
        raise ExtractError(f"RANK={rank} is outside WORLD_SIZE={world}")
    cfg = with_default_data(cfg, echo)
    _check_sampling(cfg)
    source = open_source(cfg.data, allow_truncated=cfg.allow_truncated)
    for note in source.notes:
        echo(note)
    config = load_target_config(cfg.model)
    info = target_info(cfg.model, config, cfg.revision)
    layer_ids = resolve_layer_ids(cfg.layers, info.num_hidden_layers)
    if cfg.top_k > info.vocab_size:
        raise ExtractError(f"--top-k {cfg.top_k} exceeds the target vocabulary "
                           f"({info.vocab_size} tokens)")
    tokenizer = load_tokenizer(cfg.model)
    parts = plan_parts(source.num_rows, cfg.rows_per_part)
    mine = parts if cfg.dry_run else parts_of_rank(parts, rank, world)
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    scanned = _scan(source, tokenizer, mine, cfg)
    if not scanned and len(mine) == len(parts):
        _refuse_all_skipped(source, cfg)
    return ExtractPlan(cfg=cfg, rank=rank, world=world, source=source, tokenizer=tokenizer,
                       model_config=config, info=info, layer_ids=layer_ids, parts=parts,
                       mine=mine, scanned=scanned, dtype=dtype)


def store_meta(plan: ExtractPlan, device: torch.device, kernels: str) -> StoreMeta:
    """The provenance of the store `plan` fills on `device` with the target's `kernels`."""
    cfg, info = plan.cfg, plan.info
    tokenizer = tokenizer_info(plan.tokenizer_files, plan.tokenizer, cfg.enable_thinking)
    return StoreMeta(
        target=info, tokenizer=tokenizer,
        source=SourceInfo(paths=plan.source.paths, sha256=plan.source.sha256,
                          max_length=cfg.max_length, regenerated=cfg.regenerate,
                          num_rows=plan.source.num_rows),
        created_with=CreatedWith(dflash=dflash_train.__version__, torch=torch.__version__,
                                 transformers=transformers.__version__, device=device.type,
                                 kernels=kernels),
        context_layer_ids=plan.layer_ids, top_k=cfg.top_k, hidden_dtype=dtype_name(plan.dtype),
        context_dtype=FP8_CONTEXT if plan.fp8 else None, num_parts=len(plan.parts),
        extra={"mask_token_id": _mask_token_id(plan), "rows_per_part": cfg.rows_per_part,
               "overlong": cfg.overlong,
               "max_new_tokens": cfg.max_new_tokens if cfg.regenerate else None,
               **({"capture": "generation"} if plan.captures_in_generation else {}),
               **_sampling_record(cfg), **cfg.extra},
    )


def _sampling_record(cfg: ExtractConfig) -> dict:
    """The answers' sampling settings, recorded only when sampled (a greedy store's
    provenance, and so its fingerprint, stays byte for byte what it was), and whether a
    server drew them (StoreMeta.server_drawn)."""
    if not cfg.regenerate or cfg.sampling.greedy:
        return {}
    return {SAMPLING_KEY: asdict(cfg.sampling)} | (
        {DRAWN_BY_KEY: SERVER_DRAWN} if cfg.servers else {})


def _check_sampling(cfg: ExtractConfig) -> None:
    """Refuse sampling options that would change nothing."""
    s = cfg.sampling
    given = [f"--{flag} {value}" for flag, value, default in (
        ("temperature", s.temperature, GREEDY.temperature), ("top-p", s.top_p, GREEDY.top_p),
        ("sample-top-k", s.top_k, GREEDY.top_k), ("seed", s.seed, GREEDY.seed))
        if value != default]
    if given and not cfg.regenerate:
        raise ExtractError(f"sampling options ({', '.join(given)}) choose how answers are "
                           "generated: add --regenerate (without it the dataset's answers are "
                           "stored as they are)")
    if given and s.greedy:
        raise ExtractError(f"sampling options ({', '.join(given)}) change nothing at "
                           "--temperature 0 (greedy): drop them, or sample with --temperature "
                           "> 0")


def with_default_data(cfg: ExtractConfig, echo=print) -> ExtractConfig:
    """No --data: the embedded prompt set's train split, whose responses must be regenerated
    (they are the original code, not anything the target said)."""
    if cfg.data:
        return cfg
    from dflash_train.assets.embedded import prompt_file

    try:
        path = str(prompt_file("train"))
    except FileNotFoundError as e:
        raise ExtractError(f"no --data given and {e}") from e
    echo(f"no --data: using the embedded coding prompts {path} (implies --regenerate)")
    return replace(cfg, data=[path], regenerate=True)


def _scan(source: ChatSource, tokenizer, parts: list[PartPlan], cfg: ExtractConfig
          ) -> list[Item]:
    """Render every row of `parts` once, so template errors stop the run before any write."""
    items: list[Item] = []
    for part in parts:
        for item in render_rows(source, tokenizer, range(part.row_start, part.row_stop), cfg):
            policy = prompt_fits if cfg.regenerate else apply_length_policy
            kept = policy(item, cfg, Counts())
            if kept is not None:
                items.append(kept)
    return items


def _refuse_all_skipped(source: ChatSource, cfg: ExtractConfig) -> None:
    """Every row fell to the length policy: a store of nothing is a mistake, not a result."""
    what = "prompt" if cfg.regenerate else "sample"
    raise ExtractError(
        f"{', '.join(source.paths)}: all {source.num_rows} rows were skipped, no {what} "
        f"leaves an assistant token within --max-length {cfg.max_length} (first: "
        f"{source.where(0)}); raise --max-length")


def _print_plan(plan: ExtractPlan, echo) -> None:
    cfg, info, scanned, parts = plan.cfg, plan.info, plan.scanned, plan.parts
    tokens = sum(len(i.input_ids) for i in scanned)
    note = " (prompts only; up to max-new-tokens more each)" if cfg.regenerate else ""
    if cfg.regenerate:
        tokens += cfg.max_new_tokens * len(scanned)
    frozen = (2 * info.vocab_size + 1) * info.hidden_size * plan.dtype.itemsize
    echo(f"target: {info.name_or_path} ({info.model_type}, {info.num_hidden_layers} layers, "
         f"hidden {info.hidden_size}, vocab {info.vocab_size})")
    echo(f"context layers: {plan.layer_ids}; top-k: {cfg.top_k}")
    echo(f"bytes/token: {plan.bytes_per_token}")
    echo(f"samples: {len(scanned)}; tokens: {tokens}{note}")
    echo(f"total: {tokens * plan.bytes_per_token / 2**30:.3f} GiB of samples + "
         f"{frozen / 2**30:.3f} GiB of frozen rows, before compression")
    echo(f"parts: {len(parts)} of {cfg.rows_per_part} rows; with WORLD_SIZE={plan.world} "
         f"rank r takes parts r, r+{plan.world}, ...")
    for part in parts[:8]:
        echo(f"  part {part.index}: rows {part.row_start}..{part.row_stop - 1} -> rank "
             f"{part.index % plan.world}")
    if len(parts) > 8:
        echo(f"  ... {len(parts) - 8} more")


def _refuse_different_store(out: str, meta: StoreMeta, echo=print) -> None:
    """Fail before loading the model if `out` holds something other than this store."""
    if "://" in out and not out.startswith("file://"):
        return  # checked by create_store once the model is loaded
    path = Path(out.removeprefix("file://"))
    if not path.exists():
        return
    if not path.is_dir():
        raise ExtractError(f"--out {out} exists and is not a directory")
    if not store_exists(out):  # empty, or a first write a kill cut short
        return
    stored = open_store(out).meta
    _refuse_other_weights(out, stored.target, meta.target, echo)
    diffs = stored.mismatches(meta)
    if diffs:
        raise ExtractError(f"--out {out} holds a store made differently; refusing to mix "
                           "them (use another --out):\n  " + "\n  ".join(diffs))


def _refuse_other_weights(out: str, stored: TargetInfo, wanted: TargetInfo, echo) -> None:
    """The one-line refusal of a resume onto other weights (replaced at the same path or
    not); a store from before weights fingerprints is only noted (checked by its path)."""
    if stored.weights_sha256 is None:
        if wanted.weights_sha256 is not None:
            echo(f"note: --out {out} records no weights fingerprint (made by an older dflash); "
                 f"its target is checked by path only ({stored.name_or_path})")
        return
    if "weights_sha256" in [f for f, _, _ in target_differences(stored, wanted)]:
        raise ExtractError(
            f"--out {out} was extracted from other weights than --model {wanted.name_or_path} "
            f"(weights fingerprint {stored.weights_sha256[:12]}... != "
            f"{wanted.weights_sha256[:12]}...): the checkpoint was replaced or retrained; "
            "resume with the original weights, or extract into another --out")


def _mask_token_id(plan: ExtractPlan) -> int | None:
    """--mask-token-id, else the default for the target; refused outside its vocabulary."""
    info, tokenizer = plan.info, plan.tokenizer
    mask = plan.cfg.mask_token_id
    if mask is None:
        mask = default_mask_token_id(info.model_type, info.vocab_size,
                                     getattr(tokenizer, "mask_token_id", None),
                                     tokenizer_size=len(tokenizer),
                                     spare_special_ids=spare_special_ids(tokenizer))
    if mask is not None and not 0 <= mask < info.vocab_size:
        raise ExtractError(f"--mask-token-id {mask} is outside the target vocabulary "
                           f"(size {info.vocab_size})")
    return mask


def _checked_servers(plan: ExtractPlan) -> list[Server]:
    """--server URLs checked to serve the target before the model loads or a sample is
    written; a server must hold a prompt and its completion up to max_length + 1 tokens, so
    an answer that runs past max_length reaches --overlong as the built-in path's does
    (skipped or truncated there, never silently kept at exactly max_length)."""
    cfg = plan.cfg
    if not cfg.servers:
        return []
    if not cfg.regenerate:
        raise ExtractError("--server generates answers: it needs --regenerate")
    longest = max((len(i.input_ids) for i in plan.scanned), default=0)
    need = min(cfg.max_length + 1, longest + cfg.max_new_tokens)
    return check_servers(cfg.servers, [cfg.model, plan.info.name_or_path], need,
                         cfg.server_timeout)


def _write_failure(out: str, e: OSError) -> str:
    """One line for a store write the OS refused (disk full, permission denied, ...)."""
    cause = e.strerror or str(e) or type(e).__name__
    at = f" at {e.filename}" if e.filename else ""
    return (f"--out {out}: cannot write the store ({cause}{at}); every committed shard is "
            "intact: fix the cause and re-run the same command to resume")


def _silent(*_) -> None:
    pass
