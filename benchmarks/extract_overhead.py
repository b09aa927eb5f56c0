"""Extraction overhead: `run_extract` wall time vs the bare forward passes of the same batches.

    python -m benchmarks.extract_overhead [--prompts 48]

The baseline is what any extractor must pay: the target's own forward (CausalLM, logits
included, output_hidden_states=True) over exactly the batches run_extract forms, same model,
dtype and padding. The rest of run_extract (model load, template scan, hook capture, top-k,
the store writer, the frozen rows) is broken down piece by piece, each timed alone in the same
process, so a missed goal names where the extra time goes. Not a test.
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.driver import package_errors_as_one_line
from benchmarks.embedded_stores import EmbeddedSettings, extract, extract_config, first_rows
from benchmarks.report import Row

GOAL = 1.15


def planned_batches(cfg) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """The padded (input_ids, attention) batches run_extract forms for `cfg`, and layer ids."""
    from dflash_train.extract.data import open_source
    from dflash_train.extract.layers import resolve_layer_ids
    from dflash_train.extract.plan import plan_batches, plan_parts
    from dflash_train.extract.prepare import Counts, apply_length_policy, render_rows
    from dflash_train.target_model.loading import load_target_config, load_tokenizer, target_info

    source = open_source(cfg.data)
    tokenizer = load_tokenizer(cfg.model)
    info = target_info(cfg.model, load_target_config(cfg.model))
    batches = []
    for part in plan_parts(source.num_rows, cfg.rows_per_part):
        items = render_rows(source, tokenizer, range(part.row_start, part.row_stop), cfg)
        items = [k for i in items if (k := apply_length_policy(i, cfg, Counts())) is not None]
        for batch in plan_batches([len(i.input_ids) for i in items], cfg.batch_tokens):
            chosen = [items[i] for i in batch]
            width = max(len(i.input_ids) for i in chosen)
            ids = torch.zeros((len(chosen), width), dtype=torch.long)
            attention = torch.zeros((len(chosen), width), dtype=torch.long)
            for b, item in enumerate(chosen):
                ids[b, : len(item.input_ids)] = torch.tensor(item.input_ids)
                attention[b, : len(item.input_ids)] = 1
            batches.append((ids, attention))
    return batches, resolve_layer_ids(cfg.layers, info.num_hidden_layers)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def bare_forward(model, batches) -> None:
    for ids, attention in batches:
        model(input_ids=ids, attention_mask=attention, use_cache=False,
              output_hidden_states=True)


@torch.inference_mode()
def captured_forward(target, layer_ids, batches) -> list[torch.Tensor]:
    """forward_states (hooks, decoder only) per batch; returns the final states of real tokens."""
    from dflash_train.target_model.capture import forward_states

    finals = []
    for ids, attention in batches:
        _, final = forward_states(target.decoder, layer_ids, ids, attention)
        finals.append(final[attention.bool()])
    return finals


def rewrite_samples(src_url: str, dst_url: str) -> float:
    """Append every sample of `src_url` to a fresh store with its meta; seconds spent in the
    part writer alone (reading the source is not counted)."""
    from dflash_train.store_schema import create_store, open_store

    src = open_store(src_url)
    dst = create_store(dst_url, src.meta, shard_tokens=src.shard_tokens)
    seconds = 0.0
    for part in src.parts():
        samples = list(part.iter_samples())
        writer = dst.part_writer(part.index, part.row_start, part.row_stop)
        start = time.perf_counter()
        for s in samples:
            writer.append(s)
        writer.finish()
        seconds += time.perf_counter() - start
    return seconds


def bench(root: Path, s: EmbeddedSettings) -> list[Row]:
    """Rows of item 4. The process is warmed first (imports, first forward), then the bare
    forward runs before and after run_extract and their mean is the baseline (drift)."""
    from dflash_train.dtypes import resolve_dtype
    from dflash_train.target_model.loading import load_target
    from dflash_train.target_model.verifier import verifier_topk

    data = first_rows("train", s.train_prompts, root / "overhead.jsonl")
    url = str(root / "overhead.zarr")
    cfg = extract_config(data, url, s, regenerate=False)
    batches, layer_ids = planned_batches(cfg)
    tokens = sum(int(a.sum()) for _, a in batches)
    padded = sum(a.numel() for _, a in batches)
    dtype = resolve_dtype(cfg.dtype, "cpu")
    load_s = timed(lambda: load_target(cfg.model, device="cpu", dtype=dtype,
                                       load_as="causal-lm"))
    target = load_target(cfg.model, device="cpu", dtype=dtype, load_as="causal-lm")
    bare_forward(target.model, batches[:1])  # warm-up: imports and first-call allocations
    bare_s = timed(lambda: bare_forward(target.model, batches))
    extract_s = extract(data, url, s, regenerate=False)
    bare_s = (bare_s + timed(lambda: bare_forward(target.model, batches))) / 2
    finals: list[torch.Tensor] = []
    capture_s = timed(lambda: finals.extend(captured_forward(target, layer_ids, batches)))
    topk_s = timed(lambda: [verifier_topk(f, target.lm_head, cfg.top_k) for f in finals])
    write_s = rewrite_samples(url, str(root / "overhead-rewrite.zarr"))
    # A real run loads the model once for hours of forwards: the goal is on the rest.
    ratio = (extract_s - load_s) / bare_s
    return [
        Row("4 extract", "run_extract wall minus model load / bare forward (same batches)",
            f"{ratio:.2f}x ({extract_s - load_s:.1f} vs {bare_s:.1f} s, {tokens} tokens, "
            f"{tokens / padded:.0%} of padded)", f"<= {GOAL}x", ratio <= GOAL),
        Row("4 extract", "  run_extract wall, load included / bare forward",
            f"{extract_s / bare_s:.2f}x"),
        Row("4 extract", "  model load alone / bare forward", f"{load_s / bare_s:.2f}x"),
        Row("4 extract", "  hooked decoder forward alone / bare forward",
            f"{capture_s / bare_s:.2f}x"),
        Row("4 extract", "  verifier top-k alone / bare forward", f"{topk_s / bare_s:.2f}x"),
        Row("4 extract", "  store writer alone / bare forward", f"{write_s / bare_s:.2f}x"),
    ]


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=EmbeddedSettings.train_prompts)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    try:
        rows = bench(root, EmbeddedSettings(train_prompts=args.prompts))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from benchmarks.report import format_table

    print(format_table(rows))


if __name__ == "__main__":
    main()
