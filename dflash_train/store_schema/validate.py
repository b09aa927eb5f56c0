"""Check a store end to end and say precisely what is wrong, naming the part and sample.

validate() never raises for a problem in the store: every problem becomes a Finding, so one run
reports all of them. Checks: schema and provenance, each part's commit record and array
metadata, offsets and source rows, array shapes and dtypes, shards present, checksums (by
reading every chunk), NaN/Inf, token ids within the vocabulary, verifier top-k ordering, an
fp8 store's scales (finite and > 0, as every writer stores them); the frozen target rows and
carried files (metadata and chunks present, checksums) against the frozen unit's record: every
array it lists present and (reading data) equal to it, none it does not list. A store made
before the record has its rows and files checked readable only (frozen.py).
"""

from dataclasses import dataclass

import numpy as np
import zarr

from dflash_train.store_schema.chunks import existing_keys, missing_chunks
from dflash_train.store_schema.errors import StoreError, one_line
from dflash_train.store_schema.fp8 import bad_scales
from dflash_train.store_schema.frozen import digest
from dflash_train.store_schema.layout import (
    CONTEXT_INNER_TOKENS,
    SAMPLE_ARRAYS,
    context_storage_dtype,
    nonfinite_hidden,
    part_path,
    token_arrays,
)
from dflash_train.store_schema.part import commit_record
from dflash_train.store_schema.store import Store, open_store


@dataclass
class Finding:
    """One problem: where it is and what it is."""

    part: int | None
    sample: int | None
    kind: str
    message: str

    def __str__(self) -> str:
        where = "store" if self.part is None else f"part {self.part}"
        if self.sample is not None:
            where += f" sample {self.sample}"
        return f"{where}: [{self.kind}] {self.message}"


def validate(store_or_url: "Store | str", *, check_data: bool = True) -> list[Finding]:
    """All problems found in a store; an empty list means it is sound (complete or not)."""
    if isinstance(store_or_url, Store):
        store = store_or_url
    else:
        try:
            store = open_store(store_or_url)
        except StoreError as e:
            return [Finding(None, None, "schema", str(e))]
    findings: list[Finding] = []
    if "parts" not in store.root:
        return [Finding(None, None, "layout", "the 'parts' group is missing (the store's "
                        "creation was cut short? re-run the same `dflash extract`)")]
    findings += _check_frozen(store, check_data)
    for name in store.part_names():
        if not name.isdigit() or int(name) >= store.meta.num_parts:
            findings.append(Finding(None, None, "layout", f"unexpected part group '{name}'"))
            continue
        findings += _check_part(store, int(name), check_data)
    return findings


def _check_frozen(store: Store, check_data: bool) -> list[Finding]:
    """The target rows and carried files (config, tokenizer) every reader needs: metadata and
    chunks present, and (check_data) every chunk intact and equal to the frozen record.
    Their damage is the store's, not a part's: no skipping steps around it. An unfinished
    unit is work in flight, refused by readers and redone by the next extract: not checked."""
    try:
        record = store.frozen_record()
    except StoreError as e:
        return [Finding(None, None, "record", str(e))]
    if record.state == "unfinished":
        return []
    present = store.frozen_paths()
    listed = record.sha256
    found = [Finding(None, None, "missing", f"{path} is missing (the store's frozen record "
                     "lists it)") for path in listed if path not in present]
    if record.state == "whole":
        found += [Finding(None, None, "unexpected", f"{path} is not in the store's frozen "
                          "record (added after extract wrote the store?)")
                  for path in present if path not in listed]
    for path in present:
        if record.state == "whole" and path not in listed:
            continue
        found += _check_frozen_array(store, path, listed.get(path), check_data)
    return found


def _check_frozen_array(store: Store, path: str, want: str | None, check_data: bool
                        ) -> list[Finding]:
    data, problem = store.frozen_data(path, read_data=check_data)
    if problem is None and want is not None and data is not None and digest(data) != want:
        problem = ("differs", f"{path} differs from the store's frozen record (sha256 "
                              f"{digest(data)[:16]}... != {want[:16]}...): changed after "
                              "extract wrote it")
    return [] if problem is None else [Finding(None, None, *problem)]


def _check_part(store: Store, index: int, check_data: bool) -> list[Finding]:
    try:
        group = store.root[part_path(index)]
    except KeyError:  # its directory, and no metadata yet: a kill came before its first write
        return [Finding(index, None, "record", "no commit record: creation was torn")]
    except Exception as e:  # torn zarr.json
        return [Finding(index, None, "record",
                        f"part metadata (zarr.json) is unreadable: {e}")]
    try:
        record = commit_record(dict(group.attrs), f"part {index}")
    except StoreError as e:
        return [Finding(index, None, "record", str(e).removeprefix(f"part {index}: "))]
    if record is None:  # creation cut short before the record: not started, as every reader
        return []       # takes it (--require-complete names it)
    committed, tokens = record["committed_samples"], record["committed_tokens"]
    complete, rows = record["complete"], (record["row_start"], record["row_stop"])
    arrays, found = _open_arrays(group, index, store.meta.context_dtype)
    if found:
        return found
    found = _check_arrays(store, index, arrays, committed, tokens, complete)
    if found:
        return found  # offsets and data checks would only repeat the same problem
    sample_arrays, found = _read_sample_arrays(index, arrays, committed)
    if found:
        return found  # no sample can be located
    offsets, sources = sample_arrays
    found = _check_offsets(index, offsets, tokens, sources, rows)
    if found:
        return found
    found = _check_shards_present(store, index, arrays, tokens, offsets)
    if check_data and not found:
        found += _check_data(store, index, arrays, offsets)
    return _first_per_sample(found)


def _open_arrays(group: zarr.Group, index: int, context_dtype: str | None
                 ) -> tuple[dict[str, zarr.Array], list[Finding]]:
    """The part's arrays by name; a torn or undecodable array zarr.json is a finding (without
    its metadata none of the part's samples can be located), a missing array is left to
    _check_arrays."""
    arrays, found = {}, []
    for name in [a.name for a in token_arrays(context_dtype)] + list(SAMPLE_ARRAYS):
        try:
            arrays[name] = group[name]
        except KeyError:
            continue
        except Exception as e:  # zarr surfaces a torn zarr.json as a JSON or metadata error
            found.append(Finding(index, None, "metadata",
                                 f"array {name} metadata (zarr.json) is unreadable: {e}"))
    return arrays, found


def _read_sample_arrays(index, arrays, committed):
    """(offsets, sources) of the committed samples; a finding naming the array that cannot be
    read (a chunk failing its checksum or not decoding) instead."""
    read, found = [], []
    for name, count in (("sample_offsets", committed + 1), ("sample_source", committed)):
        try:
            read.append(arrays[name][:count])
        except Exception as e:  # codecs raise ValueError/RuntimeError on corrupt bytes
            found.append(Finding(index, None, "checksum", f"array {name} cannot be read: "
                                 f"{type(e).__name__}: {one_line(e)}"))
    return (read if not found else None), found


def _first_per_sample(found: list[Finding]) -> list[Finding]:
    """One finding per (sample, kind, array): a chunk longer than the span read is otherwise
    reported again for every span it covers."""
    seen, out = set(), []
    for f in found:
        key = (f.sample, f.kind, f.message.split(" ", 1)[0])
        if f.sample is None or key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _check_arrays(store, index, arrays, committed, tokens, complete) -> list[Finding]:
    f = []
    meta = store.meta
    want_inner = {"context": (meta.num_context_layers, meta.target.hidden_size),
                  "context_scale": (meta.num_context_layers,),
                  "verifier_topk_ids": (meta.top_k,), "verifier_topk_logits": (meta.top_k,)}
    for spec in token_arrays(meta.context_dtype):
        arr = arrays.get(spec.name)
        if arr is None:
            f.append(Finding(index, None, "layout", f"array {spec.name} is missing"))
            continue
        inner = want_inner.get(spec.name, ())
        if tuple(arr.shape[1:]) != inner:
            f.append(Finding(index, None, "layout", f"{spec.name} has per-token shape "
                             f"{tuple(arr.shape[1:])}, expected {inner}"))
        dtype = context_storage_dtype(meta.hidden_dtype, meta.context_dtype) \
            if spec.name == "context" else spec.dtype
        if np.dtype(arr.dtype) != np.dtype(dtype):  # e.g. an fp8 store's uint8 context
            f.append(Finding(index, None, "layout", f"{spec.name} holds {arr.dtype}, expected "
                             f"{np.dtype(dtype)} for {meta.context_encoding} context"))
        if arr.shape[0] < tokens or (complete and arr.shape[0] != tokens):
            f.append(Finding(index, None, "offsets", f"{spec.name} holds {arr.shape[0]} tokens "
                             f"but the commit record says {tokens}"))
    for name in SAMPLE_ARRAYS:
        arr = arrays.get(name)
        need = committed + (name == "sample_offsets")
        if arr is None:
            f.append(Finding(index, None, "layout", f"array {name} is missing"))
        elif arr.shape[0] < need:
            f.append(Finding(index, None, "offsets", f"{name} holds {arr.shape[0]} entries, "
                             f"the commit record needs {need}"))
    return f


def _check_offsets(index, offsets, tokens, sources, rows) -> list[Finding]:
    f = []
    if offsets[0] != 0:
        f.append(Finding(index, 0, "offsets", f"first offset is {offsets[0]}, not 0"))
    bad = np.flatnonzero(np.diff(offsets) <= 0)
    for s in bad[:10]:
        f.append(Finding(index, int(s), "offsets",
                         f"sample spans [{offsets[s]}, {offsets[s + 1]}): empty or reversed"))
    if offsets[-1] != tokens:
        f.append(Finding(index, len(offsets) - 2 if len(offsets) > 1 else None, "offsets",
                         f"offsets end at token {offsets[-1]} but {tokens} tokens are committed"))
    out = np.flatnonzero((sources < rows[0]) | (sources >= rows[1]))
    for s in out[:10]:
        f.append(Finding(index, int(s), "source",
                         f"source row {sources[s]} outside the part's rows {list(rows)}"))
    dup = np.flatnonzero(np.diff(sources) <= 0)
    for s in dup[:10]:
        f.append(Finding(index, int(s) + 1, "source",
                         f"source row {sources[s + 1]} repeats or goes back (after {sources[s]})"))
    return f


def samples_in(offsets: np.ndarray, start: int, stop: int) -> list[int]:
    """Samples overlapping tokens [start, stop)."""
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, stop, side="left")) - 1
    return list(range(max(first, 0), min(last, len(offsets) - 2) + 1))


def _span_findings(index, offsets, start, stop, kind, message) -> list[Finding]:
    samples = samples_in(offsets, start, stop)
    label = f"tokens [{start}, {stop}) of samples {samples[0]}..{samples[-1]}" if samples \
        else f"tokens [{start}, {stop})"
    return [Finding(index, s, kind, f"{message} ({label})") for s in samples] or \
        [Finding(index, None, kind, f"{message} ({label})")]


def _check_shards_present(store, index, arrays, tokens, offsets) -> list[Finding]:
    """Every chunk object covering the committed tokens must exist: zarr would silently read
    fill values for a missing one."""
    f = []
    keys = existing_keys(store.root.store,
                         "/".join(p for p in (store.root.path, part_path(index)) if p))
    for spec in token_arrays(store.meta.context_dtype):
        for start, stop, key in missing_chunks(arrays[spec.name], tokens, keys):
            f += _span_findings(index, offsets, start, stop, "missing",
                                f"{spec.name} chunk '{key}' is missing")
    return f


def _check_data(store, index, arrays, offsets) -> list[Finding]:
    """Read every committed token once: checksums, NaN/Inf, id ranges, top-k order."""
    f = []
    meta = store.meta
    vocab = meta.target.vocab_size
    tokens = int(offsets[-1])
    step = store.shard_tokens
    specs = token_arrays(meta.context_dtype)
    for start in range(0, tokens, step):
        stop = min(start + step, tokens)
        data = {}
        for spec in specs:
            try:
                data[spec.name] = arrays[spec.name][start:stop]
            except Exception as e:  # codecs raise ValueError/RuntimeError on corrupt bytes
                f += _localise_corruption(index, arrays[spec.name], offsets, start, stop, e)
        if len(data) < len(specs):
            continue
        f += _check_values(index, offsets, start, data, meta.context_encoding, vocab)
        if "context_scale" in data:
            f += _check_scales(index, offsets, start, data["context_scale"],
                               meta.context_layer_ids)
    return f


def _localise_corruption(index, arr: zarr.Array, offsets, start, stop, error) -> list[Finding]:
    """Re-read a failing span chunk by chunk so the finding names only the damaged samples."""
    f = []
    step = CONTEXT_INNER_TOKENS if arr.shards else arr.chunks[0]
    for a in range(start, stop, step):
        b = min(a + step, stop)
        try:
            arr[a:b]
        except Exception as e:
            f += _span_findings(index, offsets, a, b, "checksum",
                                f"{arr.basename} cannot be read: {e}")
    return f or _span_findings(index, offsets, start, stop, "checksum",
                               f"{arr.basename} cannot be read: {error}")


def _check_values(index, offsets, start, data, hidden_dtype, vocab) -> list[Finding]:
    f = []
    ids, topk = data["input_ids"], data["verifier_topk_ids"]
    logits, lse = data["verifier_topk_logits"], data["verifier_lse"]
    problems = {
        "nan": nonfinite_hidden(data["context"], hidden_dtype).reshape(len(ids), -1).any(1)
        | ~np.isfinite(logits).all(1) | ~np.isfinite(lse),
        "token": (ids < 0) | (ids >= vocab) | ((topk < 0) | (topk >= vocab)).any(1),
        "verifier": (np.diff(logits, axis=1) > 0).any(1) | (logits[:, 0] > lse + 1e-3),
    }
    what = {"nan": "NaN or Inf in context or verifier logits",
            "token": f"token id outside the vocabulary [0, {vocab})",
            "verifier": "top-k logits not in descending order or above the log-sum-exp"}
    for kind, bad in problems.items():
        for s in sorted({_sample_of(offsets, start + int(t)) for t in np.flatnonzero(bad)}):
            f.append(Finding(index, s, kind, what[kind]))
    return f


def _check_scales(index, offsets, start, scales, layer_ids) -> list[Finding]:
    """An fp8 scale that no writer stores (NaN, Inf, 0, negative): its row would dequantize
    to garbage or zeros without any checksum failing (e.g. a chunk rewritten as zeros). One
    finding per sample, naming its damaged token span and layers."""
    bad = bad_scales(scales)
    f = []
    for s in sorted({_sample_of(offsets, start + int(t)) for t in np.flatnonzero(bad.any(1))}):
        a, b = max(int(offsets[s]), start), min(int(offsets[s + 1]), start + len(scales))
        rows = bad[a - start:b - start]
        tokens = np.flatnonzero(rows.any(1)) + a
        layers = [layer_ids[i] for i in np.flatnonzero(rows.any(0))]
        first = scales[tokens[0] - start][rows[tokens[0] - a]][0]
        f.append(Finding(index, s, "scale", f"context_scale is {first} at {rows.sum()} "
                         f"(token, layer) rows of tokens [{tokens[0]}, {tokens[-1] + 1}), "
                         f"layers {layers}: an fp8 scale must be finite and > 0"))
    return f


def _sample_of(offsets: np.ndarray, token: int) -> int:
    return int(np.searchsorted(offsets, token, side="right")) - 1

