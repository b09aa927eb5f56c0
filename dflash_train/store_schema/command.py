"""`dflash store ...`: look inside a feature store and check it."""

import fcntl
import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from dflash_train.store_schema.errors import StoreError, one_line
from dflash_train.store_schema.info import answers_description, summarize, top1_agreement
from dflash_train.store_schema.integrity import check_before_reading, refusal
from dflash_train.store_schema.layout import FP8_CONTEXT, HIDDEN_DTYPES
from dflash_train.store_schema.stats import store_stats
from dflash_train.store_schema.store import (
    local_path,
    open_store,
    remove_local_store,
    store_exists,
)
from dflash_train.store_schema.subset import KEEP_CONTEXT_DTYPE, copy_store
from dflash_train.store_schema.validate import validate


@click.group("store")
def store() -> None:
    """Inspect and check a feature store (local path or fsspec URL such as s3://b/hs.zarr)."""


def _agreement(s) -> tuple[int, int] | str:
    """top1_agreement, or why it cannot be read: info still describes a damaged store."""
    try:
        return top1_agreement(s)
    except Exception as e:  # zarr and the codecs raise ValueError, RuntimeError, OSError, ...
        return one_line(f"a token array cannot be read ({type(e).__name__}: {e}); run "
                        f"`dflash store validate`")


@store.command("info")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def info(path: str, as_json: bool) -> None:
    """Schema, provenance, sizes and extraction progress of the store at PATH."""
    try:
        s = open_store(path)
        summary = summarize(s)
    except StoreError as e:
        raise click.ClickException(str(e)) from e
    agreement = _agreement(s) if s.meta.source.regenerated else None
    meta = s.meta
    if as_json:
        out = {"meta": meta.to_dict(), "shard_tokens": s.shard_tokens, **vars(summary),
               "bytes_per_token": summary.bytes_per_token,
               "context_bytes_per_token": summary.context_bytes_per_token,
               "compression_ratio": summary.compression_ratio,
               "top1_agreement": list(agreement) if isinstance(agreement, tuple) else None}
        click.echo(json.dumps(out, indent=2))
        return
    click.echo("\n".join(_info_lines(path, meta, summary, agreement)))


def _info_lines(path: str, meta, summary, agreement) -> list[str]:
    """`store info`'s text: provenance, sizes, parts, top-1 agreement, the frozen unit."""
    t = meta.target
    state = "DAMAGED" if summary.parts_damaged or summary.frozen_damaged else "complete" \
        if not (summary.parts_incomplete or summary.parts_missing
                or summary.frozen_unfinished) else "INCOMPLETE"
    per_token, ratio = summary.bytes_per_token, summary.compression_ratio
    per_context = summary.context_bytes_per_token
    lines = [
        f"store          {path}  (schema v{meta.schema_version}, {state})",
        f"target         {t.name_or_path} ({t.model_type}, {t.num_hidden_layers} layers, "
        f"hidden {t.hidden_size}, vocab {t.vocab_size})",
        f"weights        {_weights(t)}",
        f"context layers {meta.context_layer_ids}  dtype {meta.hidden_dtype}  "
        f"verifier top-{meta.top_k}",
        f"context dtype  {_context_dtype(meta)}",
        f"source         {', '.join(meta.source.paths)}  rows {meta.source.num_rows}  "
        f"max_length {meta.source.max_length}  regenerated {meta.source.regenerated}",
        f"answers        {answers_description(meta)}",
        f"made with      dflash {meta.created_with.dflash}, torch {meta.created_with.torch}, "
        f"transformers {meta.created_with.transformers} on {meta.created_with.device} "
        f"({meta.created_with.kernels})",
        f"samples        {summary.samples:,}",
        f"tokens         {summary.tokens:,}",
        f"bytes on disk  {summary.bytes_on_disk:,} ({_human(summary.bytes_on_disk)})",
        "bytes/token    " + ("n/a (no token written yet)" if per_token is None
                               else f"{per_token:,.1f} (context {per_context:,.1f})"),
        "compression    " + ("n/a (no token written yet)" if ratio is None else f"{ratio:.2f}x"),
        f"parts          {summary.parts_complete}/{summary.parts_planned} complete"
        + (f"; incomplete {summary.parts_incomplete}" if summary.parts_incomplete else "")
        + (f"; not started {_short(summary.parts_missing)}" if summary.parts_missing else "")
        + (f"; DAMAGED {_short(summary.parts_damaged)} (metadata unreadable: run "
           f"`dflash store validate {path}`)" if summary.parts_damaged else ""),
    ]
    if isinstance(agreement, str):
        lines.append(f"top-1 agree    n/a: {agreement}")
    elif agreement and agreement[1]:
        agree, answers = agreement
        # sampled answers differ from the top-1 by design: replay on them is exact anyway
        why = ("offline == live only where they do" if meta.sampling is None
               else "sampled answers drawn by a server: figures are in-distribution only"
               if meta.server_drawn
               else "sampled answers: offline == live sample-and-match at their settings")
        lines.append(f"top-1 agree    {agree:,} of {answers:,} regenerated tokens "
                     f"({agree / answers:.2%}) equal the forward's top-1 ({why})")
    if summary.frozen_unfinished:
        lines.append(f"frozen rows    {FROZEN_UNFINISHED}")
    if summary.frozen_damaged:
        lines.append(f"DAMAGED        {', '.join(summary.frozen_damaged)} (run `dflash store "
                     f"validate {path}`)")
    return lines


@store.command("validate")
@click.argument("path")
@click.option("--no-data", is_flag=True,
              help="Check only metadata, offsets and shard presence; skip reading every chunk.")
@click.option("--require-complete", is_flag=True,
              help="Also fail if some planned part is missing or unfinished.")
def validate_cmd(path: str, no_data: bool, require_complete: bool) -> None:
    """Check the store at PATH; exit 1 naming the part and sample of every problem."""
    findings = validate(path, check_data=not no_data)
    for f in findings:
        click.echo(str(f), err=True)
    unfinished = _unfinished(path) if require_complete else None
    if unfinished:
        click.echo(f"store is incomplete: {unfinished}", err=True)
    if findings or unfinished:
        verdict = [f"{len(findings)} problem(s) found"] if findings else []
        verdict += [f"not complete ({unfinished})"] if unfinished else []
        click.echo(f"{path}: {'; '.join(verdict)}", err=True)
        sys.exit(1)
    try:
        s = open_store(path)
        click.echo(f"target weights {_weights(s.meta.target)}")
        if s.frozen_record().state == "unrecorded":
            click.echo("note: made before dflash recorded the sha256 of its target rows and "
                       "files: each was checked readable, not that none is missing or changed")
    except StoreError:  # validate just read it; only a store removed since lands here
        pass
    click.echo(f"{path}: ok")


FROZEN_UNFINISHED = ("target rows and files not all written (the store's creation was cut "
                     "short or is under way: re-run the same `dflash extract`)")


def _context_dtype(meta) -> str:
    if meta.fp8:
        return (f"{meta.context_dtype} (one float32 scale per token and layer), read as "
                f"{meta.hidden_dtype}")
    return meta.hidden_dtype


def _weights(target) -> str:
    """The target's weights fingerprint as `store info` and `store validate` report it."""
    if target.weights_sha256 is None:
        return ("not fingerprinted (made before weights fingerprints, or from a hub id): "
                "resume, train and eval know its target by path only")
    return f"sha256 {target.weights_sha256}"


def _unfinished(path: str) -> str | None:
    """Which planned parts keep the store at PATH from being complete, or None."""
    try:
        s = summarize(open_store(path))
    except StoreError as e:  # validate has named what is wrong already
        return f"cannot tell which parts are done: {e}"
    why = [FROZEN_UNFINISHED if s.frozen_unfinished else "",
           f"parts unfinished {_short(s.parts_incomplete)}" if s.parts_incomplete else "",
           f"not started {_short(s.parts_missing)}" if s.parts_missing else "",
           f"damaged {_short(s.parts_damaged)}" if s.parts_damaged else ""]
    return ", ".join(w for w in why if w) or None


@store.command("stats")
@click.argument("path")
@click.option("--recompute", is_flag=True, help="Ignore the statistics cached in the store.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--skip-corrupt", is_flag=True,
              help="Leave damaged parts and shards out (named; nothing cached) instead of "
                   "refusing the store.")
def stats(path: str, recompute: bool, as_json: bool, skip_corrupt: bool) -> None:
    """Per-context-layer mean, RMS, absmax and outlier channels over the whole store.

    Computed in parallel with dask and cached in the store; training scales its noise by them.
    """
    try:
        try:
            s = open_store(path, mode="r+")
        except StoreError:
            s = open_store(path)  # read-only location: compute without caching
        result = store_stats(s, recompute=recompute, skip_damaged=skip_corrupt)
    except StoreError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps({"tokens": result.tokens, "left_out": result.left_out,
                               "layers": [vars(layer) for layer in result.layers]}, indent=2))
        return
    for what in result.left_out:
        click.echo(f"left out as damaged (--skip-corrupt): {what}", err=True)
    click.echo(f"{result.tokens:,} tokens")
    click.echo(f"{'layer':>5} {'mean':>10} {'rms':>10} {'absmax':>10}  largest channels (rms)")
    for layer in result.layers:
        top = ", ".join(f"{c} ({r:.3g})" for c, r in
                        zip(layer.outlier_channels[:4], layer.outlier_rms[:4], strict=True))
        click.echo(f"{layer.layer_id:>5} {layer.mean:>10.4g} {layer.rms:>10.4g} "
                   f"{layer.absmax:>10.4g}  {top}")


@store.command("convert")
@click.argument("src")
@click.argument("dst")
@click.option("--context-dtype", default=KEEP_CONTEXT_DTYPE, show_default=True,
              type=click.Choice([KEEP_CONTEXT_DTYPE, "same", FP8_CONTEXT]),
              help="How DST stores context: keep SRC's encoding, 'same' as the hidden dtype, "
                   "or float8_e4m3 (E4M3, one float32 scale per token and layer: half a "
                   "bf16 store's raw context bytes).")
@click.option("--hidden-dtype", type=click.Choice(HIDDEN_DTYPES), default=None,
              help="DST's hidden dtype (target rows, and context as readers see it); "
                   "default: SRC's.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
def convert(src: str, dst: str, context_dtype: str, hidden_dtype: str | None,
            progress: bool) -> None:
    """Re-encode the complete store SRC into a new store DST, e.g. as fp8 context, without
    running the target again. Samples, parts, rows and provenance are SRC's."""
    try:
        s = open_store(src)
        if not s.complete:
            raise StoreError(f"{src} is not complete ({_unfinished(src)}): finish extracting "
                             "it first")
        damage = check_before_reading(s, [p.index for p in s.parts()])
        if damage:
            raise refusal(damage)
        _refuse_existing(dst)
        kept = _convert_into(src, dst, hidden_dtype=hidden_dtype,
                             context_dtype=None if context_dtype == "same" else context_dtype,
                             progress=progress)
        summary = summarize(open_store(dst))
    except StoreError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # a read-only filesystem, no space left: nothing is left at DST
        raise click.ClickException(f"{dst}: cannot write the converted store: "
                                   f"{e.strerror or e}"
                                   + (f" ({e.filename})" if e.filename else "")) from e
    click.echo(f"{dst}: {kept:,} samples, {summary.tokens:,} tokens, "
               f"{summary.bytes_per_token:,.1f} bytes/token (context "
               f"{summary.context_bytes_per_token:,.1f})")


CONVERTING_SUFFIX = ".converting"
"""A local convert writes `.DST-NAME.converting` beside DST and renames it to DST once whole:
a killed convert leaves no DST for `validate` to call ok or `train` to read in part."""


def _refuse_existing(dst: str) -> None:
    """DST must not exist (an empty directory aside): convert never writes over anything."""
    path = local_path(dst)
    if path is None:
        if store_exists(dst):
            raise StoreError(f"{dst} already exists (if a convert into it was interrupted, it "
                             "is an unfinished copy): convert writes a new store; give another "
                             "DST or remove it")
        return
    here = Path.cwd()
    if path.resolve() in (here, *here.parents):
        raise StoreError(f"{dst} is the directory you are in (or holds it): convert publishes "
                         "DST by renaming a finished copy into place; give a new path, e.g. "
                         "../NAME.zarr")
    existing = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not existing.is_dir():
        raise StoreError(f"{dst}: {existing} is a file, not a directory; give another DST")
    if path.is_dir() and not any(path.iterdir()):
        return
    if path.exists() or path.is_symlink():
        what = "a directory" if path.is_dir() else "a file"
        raise StoreError(f"{dst} already exists ({what}): convert writes a new store; give "
                         "another DST or remove it")


def _convert_into(src: str, dst: str, **how) -> int:
    """copy_store(src, dst) through a temporary name for a local DST (renamed when whole);
    an object store is written in place, refused by every reader until the copy is whole
    (store.COPYING_KEY). Returns the samples copied."""
    path = local_path(dst)
    if path is None:
        return copy_store(src, dst, **how)[0]
    tmp = path.with_name(f".{path.name}{CONVERTING_SUFFIX}")
    path.parent.mkdir(parents=True, exist_ok=True)  # the lock lives there, beside DST
    with _sole_writer(dst, tmp):
        _refuse_existing(dst)  # another convert may have finished it since the first look
        if tmp.exists():
            click.echo(f"note: removing {tmp}, the partial copy of an interrupted convert "
                       f"into {dst}", err=True)
            shutil.rmtree(tmp)
        try:
            kept, _ = copy_store(src, str(tmp), **how)
        except BaseException:
            remove_local_store(str(tmp))  # nothing half-written left behind
            raise
        if path.is_dir():
            path.rmdir()  # the empty directory _refuse_existing let through
        tmp.rename(path)
    return kept


@contextmanager
def _sole_writer(dst: str, tmp: Path) -> Iterator[None]:
    """Hold an flock on `.DST-NAME.converting.lock` while `tmp` is written, so a second
    convert into DST is refused by name instead of deleting a live copy as interrupted. The
    kernel drops the lock of a killed convert: its leftover copy is then fair to remove."""
    lock = tmp.with_name(tmp.name + ".lock")
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise StoreError(f"{dst}: cannot create {lock} ({e.strerror}); give a DST in a "
                             "writable directory") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(f"{dst}: another `dflash store convert` is writing it (into "
                             f"{tmp}, lock {lock}); wait for it to end, or give another DST"
                             ) from None
        if _is_current(fd, lock):
            break
        os.close(fd)  # its holder finished and removed it: lock the file there now
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # before the release: a waiter re-checks the inode
        os.close(fd)


def _is_current(fd: int, path: Path) -> bool:
    """Whether open file `fd` is still the file at `path` (not removed or replaced)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _short(items: list[int], limit: int = 10) -> str:
    return str(items[:limit])[:-1] + (", ...]" if len(items) > limit else "]")
