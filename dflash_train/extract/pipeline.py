"""`dflash extract` end to end: plan, scan, load, create or resume the store, fill my parts.

Owns the order of things and the resume / sharding rules:
- every part is a fixed slice of rows; rank r of W takes parts r, r + W, ...;
- a complete part is skipped; an incomplete one resumes at PartWriter.next_row, with the
  batches it would have had in an uninterrupted run (committed samples give the lengths of
  the rows already done), so the arrays come out bit-identical;
- input errors surface in a scan before the store is created or the model loaded.
Never knows zarr paths: the store is reached only through dflash_train.store_schema.
"""

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from itertools import accumulate
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import PretrainedConfig, PreTrainedTokenizerBase

import dflash_train
from dflash_train.devices import resolve_device
from dflash_train.drafter.config import default_mask_token_id
from dflash_train.dtypes import dtype_name
from dflash_train.extract.ahead import GenerationAhead
from dflash_train.extract.claims import exclusive as _exclusive
from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.data import ChatSource, open_source
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.layers import resolve_layer_ids
from dflash_train.extract.plan import (
    PartPlan,
    bytes_per_token,
    parts_of_rank,
    plan_batches,
    plan_parts,
)
from dflash_train.extract.prepare import (
    Counts,
    Item,
    apply_length_policy,
    prompt_fits,
    regenerate_items,
    render_rows,
    shrink_total,
)
from dflash_train.extract.server_generate import Server, check_agreement, check_servers
from dflash_train.extract.writer import FLUSH_SHARDS, BackgroundWriter
from dflash_train.store_schema import (
    CreatedWith,
    PartWriter,
    Sample,
    SourceInfo,
    Store,
    StoreError,
    StoreMeta,
    TargetInfo,
    create_store,
    open_store,
    target_differences,
)
from dflash_train.store_schema.frozen import frozen_written, write_frozen
from dflash_train.store_schema.layout import FP8_CONTEXT
from dflash_train.store_schema.store import store_exists
from dflash_train.target_model.capture import forward_states
from dflash_train.target_model.kernels import missing_kernels_note
from dflash_train.target_model.loading import (
    Target,
    load_config,
    load_target,
    load_tokenizer,
    resolve_dtype,
    spare_special_ids,
    target_info,
    tokenizer_files,
    tokenizer_info,
)
from dflash_train.target_model.verifier import verifier_topk


@dataclass
class Summary:
    """What a run did, for the closing report."""

    out: str
    parts_done: list[int] = field(default_factory=list)
    parts_already_complete: list[int] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    counts: Counts = field(default_factory=Counts)
    bytes_per_token: int = 0
    store_complete: bool = False
    skipped: list[str] = field(default_factory=list)
    """Where each row skipped by the length policy came from (file:line (row))."""

    def count(self, counts: Counts, source: ChatSource) -> None:
        """Add what the length policy did, each skipped row named where it came from."""
        self.counts.add(counts)
        self.skipped += [source.where(row) for row in counts.skipped_rows]

    def lines(self) -> list[str]:
        c = self.counts
        return [
            f"extracted {self.samples} samples, {self.tokens} tokens into {self.out} "
            f"(~{self.tokens * self.bytes_per_token / 2**20:.1f} MiB before compression)",
            f"parts written: {self.parts_done or 'none'}; already complete: "
            f"{self.parts_already_complete or 'none'}",
            f"truncated: {c.truncated}; skipped overlong: {c.skipped_overlong}; "
            f"skipped with no assistant token within max-length: {c.skipped_no_assistant}"
            + (f"; skipped rows: {_listed(self.skipped)}" if self.skipped else ""),
            "store complete" if self.store_complete else "store not complete yet "
            "(other ranks still running, or re-run the same command to resume)",
        ]


@dataclass
class Bars:
    """The progress bars of one rank: generated tokens (--regenerate), forwarded tokens."""

    generate: tqdm | None
    forward: tqdm

    def close(self) -> None:
        for bar in (self.generate, self.forward):
            if bar is not None:
                bar.close()


def _silent(*_) -> None:
    pass


def _listed(where: list[str], limit: int = 5) -> str:
    if not where:
        return ""
    more = f" and {len(where) - limit} more" if len(where) > limit else ""
    return f"{'; '.join(where[:limit])}{more}"


@dataclass(kw_only=True)
class ExtractPlan:
    """What this rank extracts, every input row checked, all known before the model loads or
    a file is written: the dry run prints it, build_extract loads the target to carry it out."""

    cfg: ExtractConfig
    """The settings, with the embedded prompts as `data` when none was given."""
    rank: int
    world: int
    """Processes extracting together (WORLD_SIZE); rank r takes parts r, r + world, ..."""
    source: ChatSource
    tokenizer: PreTrainedTokenizerBase
    model_config: PretrainedConfig
    """The target's config as read, before any weight is loaded."""
    info: TargetInfo
    layer_ids: list[int]
    """Target layers whose states are stored as context."""
    parts: list[PartPlan]
    """Every part of the store."""
    mine: list[PartPlan]
    """The parts this rank fills (a dry run plans them all)."""
    scanned: list[Item]
    """The rows of `mine` the length policy keeps, rendered (prompts, with regenerate)."""
    dtype: torch.dtype
    """Compute and storage dtype of the hidden states."""

    @property
    def fp8(self) -> bool:
        return self.cfg.context_dtype == FP8_CONTEXT

    @property
    def bytes_per_token(self) -> int:
        """Uncompressed store bytes per token (with fp8: one byte a value, plus its scales)."""
        layers = len(self.layer_ids)
        hidden = 1 if self.fp8 else self.dtype.itemsize
        return (bytes_per_token(layers, self.info.hidden_size, hidden, self.cfg.top_k)
                + (4 * layers if self.fp8 else 0))

    @cached_property
    def budgets(self) -> dict[int, int]:
        """The most tokens each kept row can take: its rendering, and with regenerate the
        answer's max-new-tokens (the progress bars' totals)."""
        answer = self.cfg.max_new_tokens if self.cfg.regenerate else 0
        return {i.row: len(i.input_ids) + answer for i in self.scanned}

    def budget(self, part: PartPlan) -> int:
        return sum(self.budgets.get(row, 0) for row in range(part.row_start, part.row_stop))

    @cached_property
    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as saved files: hashed into the provenance, copied into the store."""
        with tempfile.TemporaryDirectory() as tmp:
            return tokenizer_files(self.tokenizer, tmp)


@dataclass(kw_only=True)
class ExtractRun:
    """A plan with what carries it out, built once by build_extract: the provenance its store
    is made with, the loaded target and the servers that generate for it."""

    plan: ExtractPlan
    meta: StoreMeta
    """The store's provenance (a store already at --out holds the same)."""
    target: Target
    servers: list[Server]
    """--server URLs checked to serve the target; empty: the target itself generates."""


def run_extract(cfg: ExtractConfig, *, rank: int = 0, world_size: int = 1,
                echo=print) -> Summary:
    """Run extract for this rank; returns what it did."""
    if cfg.dry_run:
        plan = plan_extract(cfg, rank, world_size, echo)
        _print_plan(plan, echo)
        return Summary(cfg.out, bytes_per_token=plan.bytes_per_token)
    run = build_extract(cfg, rank, world_size, echo)
    try:
        summary = _fill_store(run)
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
    source = open_source(cfg.data, allow_truncated=cfg.allow_truncated)
    for note in source.notes:
        echo(note)
    config = load_config(cfg.model)
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
               "max_new_tokens": cfg.max_new_tokens if cfg.regenerate else None, **cfg.extra},
    )


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


def _write_frozen_rows(store: Store, target: Target, tok_files: dict[str, bytes]) -> None:
    """Copy embed_tokens, lm_head, final norm, the target's config and the tokenizer as one
    unit, unless a run before this one committed it (store_schema.frozen)."""
    # The drafter is sized from the target's config (heads, MLP width, RoPE), not its weights.
    files = {"target": {"config.json": target.model.config.to_json_string().encode()},
             "tokenizer": tok_files}
    if frozen_written(store, files):
        return
    norm = target.decoder.norm
    # the norm's effective scale (1 + w for Qwen3.5's zero-centred norm, w for Qwen3/Llama):
    # a constant input of size 1e3 makes eps negligible, so norm(x) is the scale itself
    probe = torch.full((target.info.hidden_size,), 1e3, device=target.device)
    with torch.inference_mode():
        scale = norm(probe.float()).float()
    write_frozen(store, {"embed_tokens": target.decoder.embed_tokens.weight,
                         "lm_head": target.lm_head.weight, "final_norm": scale}, files)


@dataclass(kw_only=True)
class _Filling:
    """What a rank holds while it fills its parts."""

    store: Store
    bars: Bars
    writer: BackgroundWriter
    """Appends a batch's samples while the next batch's forward runs."""
    ahead: GenerationAhead | None
    """With servers: the next part's answers, generated during this part's forward."""
    summary: Summary


def _fill_store(run: ExtractRun) -> Summary:
    """Create or reopen the store, copy the frozen rows, extract my parts."""
    plan = run.plan
    store = _create_store(run)
    fill = _Filling(store=store, bars=_bars(plan), writer=BackgroundWriter(),
                    ahead=GenerationAhead() if run.servers else None,
                    summary=Summary(plan.cfg.out, bytes_per_token=plan.bytes_per_token))
    try:
        _fill_parts(run, fill)
    finally:
        fill.bars.close()
        fill.writer.close()
    fill.summary.store_complete = _complete(plan.cfg.out)
    return fill.summary


def _create_store(run: ExtractRun) -> Store:
    """The store at --out, created or reopened (create_store refuses one made differently);
    rank 0 then commits the frozen rows, unless a run before it did."""
    cfg = run.plan.cfg
    with _exclusive(cfg.out, "create", wait=True):
        store = create_store(cfg.out, run.meta, shard_tokens=cfg.shard_tokens)
    if run.plan.rank == 0:
        with _exclusive(cfg.out, "frozen", wait=True):
            _write_frozen_rows(store, run.target, run.plan.tokenizer_files)
    return store


def _bars(plan: ExtractPlan) -> Bars:
    """Bars over the rows' token budgets; each total shrinks as rows turn out shorter (eos
    before max-new-tokens, truncation) or already committed, so rate and ETA stay true."""
    cfg, where = plan.cfg, f"rank {plan.rank}/{plan.world}"
    return Bars(
        generate=tqdm(total=cfg.max_new_tokens * len(plan.scanned), unit="tok",
                      unit_scale=True, disable=not cfg.progress, desc=f"generate {where}",
                      position=0) if cfg.regenerate else None,
        forward=tqdm(total=sum(plan.budgets.values()), unit="tok", unit_scale=True,
                     disable=not cfg.progress, desc=f"extract {where}",
                     position=1 if cfg.regenerate else 0))


def _fill_parts(run: ExtractRun, fill: _Filling) -> None:
    """Extract each of my parts under its claim; with servers, check their answers agree with
    the target after the first part, and generate each later part ahead."""
    mine = run.plan.mine
    for n, part in enumerate(mine):
        # not during the first part: its agreement check must refuse another model's
        # server before any later part is asked for
        following = mine[n + 1] if fill.ahead and 0 < n < len(mine) - 1 else None
        with _exclusive(run.plan.cfg.out, f"part-{part.index:05d}", wait=False):
            _extract_part(run, fill, part, partial(_generate_ahead, run, fill, following))
            fill.writer.wait()  # the claim must outlive the part's last write
        if run.servers and n == 0:  # another model's answers: refused after one part, not all
            check_agreement(fill.store, run.servers)


def _extract_part(run: ExtractRun, fill: _Filling, part: PartPlan,
                  start_next: Callable[[], None]) -> None:
    """Write the samples of `part` still missing: what is already written says where to
    resume, the rows after it get their items (answers generated ahead, or now), and those
    are forwarded and written now. `start_next` starts the next part's generation once this
    part's answers are in, so that it runs during this part's forward."""
    part_writer = fill.store.part_writer(part.index, part.row_start, part.row_stop,
                                         FLUSH_SHARDS)
    if part_writer.complete:
        start_next()
        _count_complete(run.plan, fill, part)
        return
    first = part_writer.next_row
    done = _committed_lengths(fill.store, part) if first > part.row_start else []
    todo = _items_to_write(run, fill, part, first)
    start_next()
    _write_now(run, fill, part_writer, done, todo)
    fill.summary.parts_done.append(part.index)


def _count_complete(plan: ExtractPlan, fill: _Filling, part: PartPlan) -> None:
    """A part an earlier run completed: reported as such, its budget taken off the bars."""
    fill.summary.parts_already_complete.append(part.index)
    shrink_total(fill.bars.forward, plan.budget(part))
    prompts = sum(row in plan.budgets for row in range(part.row_start, part.row_stop))
    shrink_total(fill.bars.generate, prompts * plan.cfg.max_new_tokens)


def _committed_lengths(store: Store, part: PartPlan) -> list[tuple[int, int]]:
    """(source row, length) of the samples a previous run committed to `part`."""
    p = store.part(part.index)
    return list(zip(p.sources().tolist(), p.sample_lengths().tolist(), strict=True))


def _items_to_write(run: ExtractRun, fill: _Filling, part: PartPlan, first: int
                    ) -> list[Item]:
    """The part's rows from `first` on, rendered (or prompts answered, with regenerate), as
    the length policy keeps them; the summary counts what it skipped or cut, and the forward
    bar loses the budget no kept item will use."""
    plan = run.plan
    if plan.cfg.regenerate:
        items, counts = _answered(run, fill, part, first)
    else:
        rows = range(first, part.row_stop)
        items, counts = render_rows(plan.source, plan.tokenizer, rows, plan.cfg), Counts()
    kept = [k for i in items if (k := apply_length_policy(i, plan.cfg, counts)) is not None]
    shrink_total(fill.bars.forward, plan.budget(part) - sum(len(i.input_ids) for i in kept))
    fill.summary.count(counts, plan.source)
    return kept


def _answered(run: ExtractRun, fill: _Filling, part: PartPlan, first: int
              ) -> tuple[list[Item], Counts]:
    """Prompt + answer of the part's rows from `first` on, generated ahead (during the
    previous part's forward) or now; and the prompts of those rows that leave no room to
    generate, counted."""
    plan, counts = run.plan, Counts()
    prompts = _part_prompts(plan, part)
    for p in prompts:  # count only the skips of rows this run still has to do
        if p.row >= first:
            prompt_fits(p, plan.cfg, counts)
    items = fill.ahead.take(part.index, first) if fill.ahead else None
    if items is None:
        items = _generate(run, fill, _fitting(prompts, plan.cfg), first)
    return items, counts


def _part_prompts(plan: ExtractPlan, part: PartPlan) -> list[Item]:
    """Every prompt of the part, not only the rows still to do, so that generation batches
    equal an uninterrupted run's."""
    return render_rows(plan.source, plan.tokenizer, range(part.row_start, part.row_stop),
                       plan.cfg)


def _fitting(prompts: list[Item], cfg: ExtractConfig) -> list[Item]:
    """The prompts that leave room to generate."""
    return [k for p in prompts if (k := prompt_fits(p, cfg, Counts())) is not None]


def _generate(run: ExtractRun, fill: _Filling, prompts: list[Item], first: int) -> list[Item]:
    """Prompt + answer of each of `prompts` from row `first` on: by the servers, or the
    target itself."""
    return regenerate_items(run.target.model, run.plan.tokenizer, prompts, run.plan.cfg,
                            first, fill.bars.generate, run.servers,
                            run.target.info.vocab_size)


def _generate_ahead(run: ExtractRun, fill: _Filling, part: PartPlan | None) -> None:
    """Start the servers on `part`'s rows still to do, unless it is complete (or None). Its
    claim is not held yet: _extract_part uses what is generated only for rows still missing
    then."""
    if part is None:
        return
    try:
        committed = fill.store.part(part.index)
        first = None if committed.complete else committed.next_row()
    except StoreError:  # not started (or its creation torn): nothing committed
        first = part.row_start
    if first is None:
        return
    fitting = _fitting(_part_prompts(run.plan, part), run.plan.cfg)
    fill.ahead.start(part.index, first, lambda: _generate(run, fill, fitting, first))


def _write_now(run: ExtractRun, fill: _Filling, part_writer: PartWriter,
               done: list[tuple[int, int]], todo: list[Item]) -> None:
    """Forward `todo` and hand its samples to the background writer batch by batch, batched
    over done + todo exactly as an uninterrupted run would batch this part."""
    lengths = [n for _, n in done] + [len(i.input_ids) for i in todo]
    for batch in plan_batches(lengths, run.plan.cfg.batch_tokens):
        if batch[-1] < len(done):
            continue
        items = [todo[i - len(done)] if i >= len(done) else None for i in batch]
        samples = _forward_batch(run, items, [lengths[i] for i in batch])
        fill.writer.append(part_writer, samples)
        tokens = sum(len(s) for s in samples)
        fill.summary.samples += len(samples)
        fill.summary.tokens += tokens
        fill.bars.forward.update(tokens)
    fill.writer.finish(part_writer)


def _forward_batch(run: ExtractRun, items: list[Item | None], lengths: list[int]
                   ) -> list[Sample]:
    """Samples for the not-yet-committed items of one batch.

    Committed rows in the batch (None items) are re-run with placeholder tokens of their
    stored length only so that the batch's shape equals the uninterrupted run's.
    """
    target, layer_ids = run.target, run.plan.layer_ids
    input_ids, attention = _padded(items, lengths)
    context, final = forward_states(target.decoder, layer_ids, input_ids.to(target.device),
                                    attention.to(target.device))
    valid = attention.bool().to(target.device)
    ids, logits, lse = verifier_topk(final[valid], target.lm_head, run.plan.cfg.top_k)
    offsets = [0, *accumulate(lengths)]
    samples = []
    for b, item in enumerate(items):
        if item is None:
            continue
        n, lo, hi = lengths[b], offsets[b], offsets[b + 1]
        # checked where the states are (on the GPU: microseconds; on the host a float copy of a
        # 4096-token sample at 27B width took longer than its share of the forward)
        _check_finite(context[b, :n], logits[lo:hi], lse[lo:hi], layer_ids,
                      run.plan.source.where(item.row))
        samples.append(Sample(
            input_ids=torch.tensor(item.input_ids, dtype=torch.int32),
            loss_mask=torch.tensor(item.loss_mask, dtype=torch.bool),
            # a copy even on a CPU target: a view would keep the whole padded batch alive
            # in the writer's buffer until its next flush
            context=context[b, :n].to("cpu", copy=True), topk_ids=ids[lo:hi].cpu(),
            topk_logits=logits[lo:hi].cpu(), lse=lse[lo:hi].cpu(), source_row=item.row,
        ))
    return samples


def _padded(items: list[Item | None], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask [batch, longest], right-padded; a None item's tokens are
    zeros of its length."""
    input_ids = torch.zeros((len(items), max(lengths)), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for b, (item, n) in enumerate(zip(items, lengths, strict=True)):
        if item is not None:
            input_ids[b, :n] = torch.tensor(item.input_ids)
        attention[b, :n] = 1
    return input_ids, attention


def _check_finite(context: torch.Tensor, topk_logits: torch.Tensor, lse: torch.Tensor,
                  layer_ids: list[int], where: str) -> None:
    """Refuse a sample whose captured states [n, layers, H] or verifier logits hold NaN/Inf."""
    bad = ~torch.isfinite(context)
    if bad.any():
        t, j, _ = bad.nonzero()[0].tolist()
        raise ExtractError(f"{where}: NaN/Inf in layer {layer_ids[j]}'s state at token {t}; "
                           "stopping (nothing of this sample was written)")
    if not torch.isfinite(lse).all() or not torch.isfinite(topk_logits).all():
        raise ExtractError(f"{where}: NaN/Inf in the verifier logits; stopping")


def _complete(out: str) -> bool:
    try:
        store = open_store(out)
        store.read_files("tokenizer")  # a store made before the frozen record: its last file
        return store.complete
    except StoreError:
        return False
