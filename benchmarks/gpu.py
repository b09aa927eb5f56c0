"""GPU benchmarks at real width, one prepared script (<= 6 min on one H200); prints a table.

    python -m benchmarks.gpu               # CUDA, real shapes, every part
    python -m benchmarks.gpu --cpu-smoke   # tiny shapes on CPU: proves the script runs
    python -m benchmarks.gpu --parts train --measured m.json        # scripts/gpu_checks.sh
    python -m benchmarks.gpu --parts head,loader,extract --measured m.json  # runs these two

  train    the Qwen3.6-27B drafter shape (DrafterConfig.qwen3_6_27b): step tokens/s, MFU and
           peak memory of `dflash train`'s own step (train_step: the batch from CPU memory,
           forward, loss, backward, the default AdamW and schedule) with the mask it uses
           there (flex on CUDA; the first, compiling step timed apart), then flex vs
           dense at fewer blocks per sequence, where dense's score matrices fit (flex then
           recompiles for the second shape with dynamic shapes, as `dflash train` does once
           its batches take a second padded shape)
  head     the loss head alone at that step's labelled slots: chunked CE forward + backward
           over a 32,768-row draft vocabulary (EAGLE-3 drafters draft over ~32k) against all
           248,320 rows
  loader   a store of 1024-token samples at the drafter's context width (5 layers x 5120
           bf16, 51 KB a token), its page cache dropped, read by the training loader (in a
           thread, then in worker processes) and copied to the device, against what one
           training step consumes (the train part's context tok/s x 51 KB)
  extract  a Qwen3.5-architecture target of real width (random weights, hidden 5120, a few
           layers: linear attention x 3 + full x 1, vocab 248320): tokens/s of the bare
           forward, of forward_states + verifier top-k, and of those plus the background
           store writer (the extract pipeline's pieces, in its order)
Random weights everywhere: speed only, nothing here depends on values. Never downloads.
"""

import argparse
import faulthandler
import json
import math
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from benchmarks.driver import package_errors_as_one_line

H200_BF16_FLOPS = 989e12
"""Dense bf16 peak of one H200 (SXM), the MFU denominator."""


@dataclass
class Shapes:
    """Sizes of one run."""

    hidden: int = 5120
    """Target and drafter width."""
    target_layers: int = 4
    """Target decoder layers built (3 linear attention + 1 full, as Qwen3.5 interleaves)."""
    vocab: int = 248320
    """Vocabulary (target lm_head and the drafter's borrowed head)."""
    intermediate: int = 17408
    """Target MLP width."""
    extract_batch: int = 4
    """Sequences per extract forward."""
    seq: int = 4096
    """Tokens per sequence (extract and train)."""
    extract_steps: int = 5
    """Timed extract batches (after one warm-up)."""
    train_batch: int = 4
    """Sequences per drafter training step."""
    anchors: int = 512
    """Blocks per sequence per training step."""
    compare_anchors: int = 64
    """Blocks per sequence of the flex vs dense comparison (dense scores must fit)."""
    train_steps: int = 3
    """Timed training steps per attention backend (after warm-up)."""
    draft_vocab: int = 32768
    """Rows of the reduced lm_head the head part compares with the full vocabulary."""
    loader_samples: int = 64
    """1024-token samples in the loader part's store (64: 3.4 GB of bf16 context)."""
    loader_workers: int = 4
    """DataLoader worker processes of the loader part's second read."""
    dtype: torch.dtype = torch.bfloat16
    """Compute dtype."""


CPU_SMOKE = Shapes(hidden=64, target_layers=4, vocab=512, intermediate=128, extract_batch=2,
                   seq=64, extract_steps=1, train_batch=2, anchors=4, compare_anchors=2,
                   train_steps=1, draft_vocab=128, loader_samples=4, loader_workers=2,
                   dtype=torch.float32)


def target_config(s: Shapes):
    from transformers import Qwen3_5TextConfig

    real = s.hidden == 5120  # Qwen3.6-27B's attention geometry; tiny heads for the smoke run
    heads = dict(num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                 linear_value_head_dim=128) if real else dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    types = (["linear_attention"] * 3 + ["full_attention"]) * (s.target_layers // 4 + 1)
    return Qwen3_5TextConfig(vocab_size=s.vocab, hidden_size=s.hidden,
                             intermediate_size=s.intermediate, num_hidden_layers=s.target_layers,
                             layer_types=types[: s.target_layers], linear_conv_kernel_dim=4,
                             tie_word_embeddings=False, **heads)


_START = time.perf_counter()


def progress(what: str) -> None:
    """A timestamped line, so a run cut short by its time limit shows where the time went."""
    print(f"  [{time.perf_counter() - _START:6.1f} s] {what}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call(fn, device: torch.device, calls: int) -> float:
    """Seconds per call over `calls` calls, the device's queue drained before and after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls


def timed(fn, device: torch.device, steps: int) -> float:
    """Seconds per call over `steps` calls, after one warm-up call."""
    fn()
    return per_call(fn, device, steps)


def bench_extract(s: Shapes, device: torch.device, root: Path) -> list[tuple[str, str]]:
    from transformers import Qwen3_5ForCausalLM

    from benchmarks.store_io import synthetic_meta
    from dflash_train.extract.writer import FLUSH_SHARDS, BackgroundWriter
    from dflash_train.store_schema import Sample, create_store
    from dflash_train.target_model.capture import forward_states
    from dflash_train.target_model.verifier import verifier_topk

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(target_config(s)).to(s.dtype).eval().requires_grad_(False)
    decoder, head = model.model, model.lm_head
    layer_ids = list(range(min(3, s.target_layers)))
    ids = torch.randint(0, s.vocab, (s.extract_batch, s.seq), device=device)
    mask = torch.ones_like(ids)
    tokens = ids.numel()

    @torch.inference_mode()
    def bare():
        model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)

    @torch.inference_mode()
    def pieces():
        context, final = forward_states(decoder, layer_ids, ids, mask)
        top = verifier_topk(final.flatten(0, 1), head, 16)
        return context, top

    meta = replace(synthetic_meta(len(layer_ids), s.hidden, tokens), hidden_dtype=(
        "bfloat16" if s.dtype == torch.bfloat16 else "float32"))
    store = create_store(str(root / "gpu.zarr"), meta)
    writer = store.part_writer(0, 0, 10**9, FLUSH_SHARDS)
    background = BackgroundWriter()
    row = [0]

    def with_writer():
        context, (top_ids, top_logits, lse) = pieces()
        n = s.seq
        samples = []
        for b in range(s.extract_batch):
            lo = b * n
            samples.append(Sample(ids[b].int().cpu(), torch.ones(n, dtype=torch.bool),
                                  context[b].cpu(), top_ids[lo:lo + n].cpu(),
                                  top_logits[lo:lo + n].cpu(), lse[lo:lo + n].cpu(), row[0]))
            row[0] += 1
        background.append(writer, samples)

    progress("extract: bare forward")
    t_bare = timed(bare, device, s.extract_steps)
    progress("extract: forward_states + top-k")
    t_pieces = timed(pieces, device, s.extract_steps)
    progress("extract: + background store writer")
    t_writer = timed(with_writer, device, s.extract_steps)
    start = time.perf_counter()
    background.close()  # what is still queued counts against the writer run
    t_writer += (time.perf_counter() - start) / s.extract_steps
    return [
        ("extract: bare forward (output_hidden_states)", f"{tokens / t_bare:,.0f} tok/s"),
        ("extract: forward_states + top-k", f"{tokens / t_pieces:,.0f} tok/s "
         f"({t_pieces / t_bare:.2f}x bare)"),
        ("extract: + background store writer", f"{tokens / t_writer:,.0f} tok/s "
         f"({t_writer / t_bare:.2f}x bare)"),
    ]


def drafter_flops(cfg, n: int, t: int, k: int) -> float:
    """Forward FLOPs of one drafter batch: fc over the context, context K/V per layer, the
    block tokens' attention projections, attention over the masked keys, MLP, and the lm_head
    over the labelled slots."""
    h, b = cfg.hidden_size, cfg.block_size
    q_tokens = n * k * b
    q_width = cfg.num_attention_heads * cfg.head_dim
    kv_width = cfg.num_key_value_heads * cfg.head_dim
    flops = 2 * n * t * cfg.num_context_features * h * h  # fc
    per_layer = (2 * n * t * h * 2 * kv_width  # context keys / values
                 + 2 * q_tokens * h * (2 * q_width + 2 * kv_width)  # q, o, block k, v
                 + 4 * q_tokens * (t / 2 + b) * q_width  # scores and values, ~half the context
                 + 6 * q_tokens * h * cfg.intermediate_size)  # SwiGLU
    labelled = n * k * (b - 1)  # the head runs on labelled slots only: slot 0 is the anchor
    return flops + cfg.num_hidden_layers * per_layer + 2 * labelled * h * cfg.vocab_size


def train_batch(s: Shapes, cfg, generator: torch.Generator):
    """A batch as the training loader hands one over: `train_batch` sequences of `seq` random
    tokens on the CPU, every position a loss position, random context and verifier top-4."""
    from dflash_train.train.batch import Batch
    from dflash_train.train.epoch_plan import SampleRef

    n, t, top_k = s.train_batch, s.seq, 4
    return Batch(
        input_ids=torch.randint(0, cfg.vocab_size, (n, t), generator=generator),
        loss_mask=torch.ones(n, t, dtype=torch.bool),
        context=torch.randn(n, t, cfg.num_context_features, cfg.hidden_size,
                            generator=generator).to(s.dtype),
        topk_ids=torch.randint(0, cfg.vocab_size, (n, t, top_k), generator=generator),
        topk_logits=torch.randn(n, t, top_k, generator=generator),
        lse=torch.full((n, t), 10.0), lengths=torch.full((n,), t),
        refs=[SampleRef(store=0, part=0, index=i, length=t) for i in range(n)])


def bench_train(s: Shapes, device: torch.device, budget_s: float,
                measured: dict[str, float]) -> list[tuple[str, str]]:
    """`dflash train`'s own step (train.loop.train_step: blocks, noise, forward, loss,
    backward, clipping, the configured optimiser and schedule) at full shape, on the backend
    `dflash train` picks here (flex on CUDA), then flex vs dense at `compare_anchors` blocks,
    where dense's [N, heads, K*B, T+K*B] scores fit (at full shape they alone would be ~100 GB
    over the layers). Steps that also measure accuracy (every run.log_every) are not timed."""
    from dflash_train.drafter import DFlashDrafter, DrafterConfig, build_block_ids
    from dflash_train.train.config import RunConfig, TrainConfig
    from dflash_train.train.loop import train_step
    from dflash_train.train.run import Placement, assemble_run

    cfg = DrafterConfig.qwen3_6_27b()
    if s.hidden != cfg.hidden_size:  # smoke: the same architecture, tiny
        cfg = replace(cfg, hidden_size=s.hidden, vocab_size=s.vocab, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      mask_token_id=s.vocab - 1, sliding_window=32)
    progress("train: building the Qwen3.6-27B drafter shape")
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDrafter(cfg)
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=s.dtype) * 0.02
        head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=s.dtype) * 0.02
    model.attach_target_head(embed, head)
    batch = train_batch(s, cfg, torch.Generator().manual_seed(0))
    n, t, b = s.train_batch, s.seq, cfg.block_size
    cuda = device.type == "cuda"
    precision = "bf16" if s.dtype == torch.bfloat16 else "fp32"  # the head's dtype, as trained

    def step_fn(k: int, attention: str):
        train_cfg = TrainConfig(run=RunConfig(anchors_per_seq=k, attention=attention,
                                              precision=precision))
        # each context layer of randn features has RMS 1: what relative noise scales by
        run = assemble_run(train_cfg, model, placement=Placement(device), total_steps=10**6,
                           layer_rms=torch.ones(cfg.num_context_features, device=device))
        return partial(train_step, run, batch)

    runs = [(s.anchors, "flex" if cuda else "dense")]
    if cuda:
        runs += [(s.compare_anchors, "flex"), (s.compare_anchors, "dense")]
    rows, seconds = [], {}
    for k, attention in runs:
        label = f"train: {n}x{t} tokens, {k} blocks/seq, {attention} mask"
        if time.perf_counter() - _START > budget_s:
            rows.append((label, f"skipped: the {budget_s:.0f} s budget is spent"))
            continue
        progress(f"{label}: first step (compiles)")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            step = step_fn(k, attention)
            first = per_call(step, device, 1)
            progress(f"{label}: {s.train_steps} timed steps")
            seconds[k, attention] = per_call(step, device, s.train_steps)
        except Exception as e:  # report a backend that fails at this shape; go on
            rows.append((label, f"failed: {type(e).__name__}: {e}"[:200]))
            continue
        sec = seconds[k, attention]
        if k == s.anchors:  # the full step: what the head and loader parts are set against
            measured.update(step_s=sec, context_tok_s=n * t / sec)
        mfu = 3 * drafter_flops(cfg, n, t, k) / sec / H200_BF16_FLOPS if cuda else float("nan")
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        rows.append((label, f"{n * t / sec:,.0f} context tok/s, {n * k * b / sec:,.0f} block "
                     f"tok/s, MFU {mfu:.1%}, peak {peak:.1f} GiB, first step {first:.1f} s"))
    if (s.compare_anchors, "flex") in seconds and (s.compare_anchors, "dense") in seconds:
        ratio = seconds[s.compare_anchors, "dense"] / seconds[s.compare_anchors, "flex"]
        rows.append((f"train: flex / dense step speed, {s.compare_anchors} blocks/seq",
                     f"{ratio:.2f}x"))
    if not cuda:  # flex on CPU runs eager and forward only: time that much
        k = s.compare_anchors
        context, lengths = batch.context.to(device), batch.lengths
        anchors = torch.sort(torch.randint(1, t - b, (n, k)), dim=1).values
        ids = build_block_ids(torch.randint(0, cfg.vocab_size, (n, k)), cfg.mask_token_id, b)
        with torch.no_grad():
            t_flex = timed(lambda: model(context, lengths, ids, anchors, attention="flex"),
                           device, 1)
            t_dense = timed(lambda: model(context, lengths, ids, anchors, attention="dense"),
                            device, 1)
        rows.append(("train: forward, flex / dense (CPU eager)", f"{t_dense / t_flex:.2f}x"))
    return rows


def head_step(hidden: torch.Tensor, head_rows: torch.Tensor, labels: torch.Tensor,
              valid: torch.Tensor) -> None:
    from dflash_train.train.loss import Head, LossConfig, SlotTargets, unary_loss

    hidden.grad = None
    unary_loss(Head(hidden, head_rows), SlotTargets(labels, valid), LossConfig()).loss.backward()


def bench_head(s: Shapes, device: torch.device,
               measured: dict[str, float]) -> list[tuple[str, str]]:
    """The chunked CE head (forward + backward into the hidden states; the borrowed rows are
    frozen) at the full step's block tokens, over `draft_vocab` rows and over all of them."""
    from dflash_train.drafter import DrafterConfig

    b = DrafterConfig.qwen3_6_27b().block_size
    blocks = s.train_batch * s.anchors
    torch.manual_seed(0)
    with torch.device(device):
        head = torch.randn(s.vocab, s.hidden, dtype=s.dtype) * 0.02
        hidden = torch.randn(blocks, b, s.hidden, dtype=s.dtype).requires_grad_(True)
        valid = torch.ones(blocks, b, dtype=torch.bool)
    valid[:, 0] = False  # slot 0 of a block is its anchor: no label, no head row
    labelled = int(valid.sum())
    rows, seconds = [], {}
    for vocab in (s.draft_vocab, s.vocab):
        labels = torch.randint(0, vocab, (blocks, b), device=device)
        step = partial(head_step, hidden, head[:vocab], labels, valid)
        progress(f"head: {vocab:,} rows")
        hidden.grad = None  # the previous run's: not this one's peak
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        sec = seconds[vocab] = timed(step, device, s.train_steps)
        # forward logits and the input gradient: two [M, H] x [H, V] products
        flops = 4 * labelled * s.hidden * vocab
        extra = (torch.cuda.max_memory_allocated() - before) / 2**30 \
            if device.type == "cuda" else float("nan")
        share = f", {sec / measured['step_s']:.0%} of the training step" \
            if "step_s" in measured else ""
        rows.append((f"head: {labelled:,} labelled slots x {vocab:,} rows",
                     f"{sec * 1e3:.1f} ms, {flops / sec / 1e12:.0f} TFLOP/s, "
                     f"+{extra:.1f} GiB peak{share}"))
    rows.append((f"head: {s.vocab:,} rows / {s.draft_vocab:,} rows, time",
                 f"{seconds[s.vocab] / seconds[s.draft_vocab]:.2f}x"))
    return rows


def drop_page_cache(root: Path) -> None:
    """Evict the files under root from the page cache (clean once synced; no root needed),
    so the next read comes from the disk, as a store larger than memory would."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def filesystem(path: Path) -> str:
    """The type of the filesystem holding path (tmpfs would make every read a memory read)."""
    where, kind, full = "", "?", str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fs = line.split()[1:3]
        inside = full == mount or full.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(where):
            where, kind = mount, fs
    return kind


def read_epoch(url: str, cfg, device: torch.device, tokens: int) -> tuple[float, int, float]:
    """One epoch of the store through the training loader, each batch's context copied to the
    device as the training step takes it: (seconds to the first batch, its tokens, seconds
    in all). Worker processes spend their start-up before the first batch."""
    from dflash_train.train.data import StoreLoader

    start = time.perf_counter()
    read, first = 0, None
    for batch in StoreLoader([url], cfg).epoch(0):
        if batch is not None:
            batch.context.to(device)
            read += batch.num_tokens
            if first is None:
                sync(device)
                first = (time.perf_counter() - start, batch.num_tokens)
    sync(device)
    assert read == tokens and first is not None, f"the loader read {read} of {tokens} tokens"
    return (*first, time.perf_counter() - start)


def bench_loader(s: Shapes, device: torch.device, root: Path,
                 measured: dict[str, float]) -> list[tuple[str, str]]:
    """Bytes/s of context the training loader delivers to the device, read cold, after its
    first batch (worker start-up apart); batches of one 27B sequence's tokens, so each worker
    reads several."""
    from benchmarks.loader_memory import write_repeated_store
    from dflash_train.drafter import DrafterConfig
    from dflash_train.train.loader_config import LoaderConfig

    layers = DrafterConfig.qwen3_6_27b().num_context_features
    token_mb = layers * s.hidden * 2 / 1e6
    url = str(root / "loader.zarr")
    progress(f"loader: writing {s.loader_samples} samples of 1024 tokens")
    tokens = write_repeated_store(url, s.loader_samples, layers, s.hidden)
    if "context_tok_s" in measured:
        need, why = measured["context_tok_s"] * token_mb, "the train part's"
    else:  # the estimate for one H200 before any was measured: ~13k context tokens/s
        need, why = 13_000 * token_mb, "13k tok/s, assumed"
    rows, rates = [], {}
    for workers, cold in ((0, True), (s.loader_workers, True), (0, False)):
        cfg = LoaderConfig(batch_tokens=s.seq, workers=workers)
        if cold:
            drop_page_cache(root)
        when = "cold" if cold else "warm"
        progress(f"loader: {workers} workers, {when}")
        first_s, first_tokens, sec = read_epoch(url, cfg, device, tokens)
        rate = rates[workers, when] = (tokens - first_tokens) * token_mb / max(sec - first_s,
                                                                                1e-9)
        rows.append((f"loader: {workers} workers, {when} ({filesystem(root)}), to "
                     f"{device.type}", f"{rate:,.0f} MB/s after the first batch "
                     f"({first_s:.1f} s), {rate / need:.1f}x a step's {need:,.0f} MB/s ({why})"))
    ratio = rates[0, "cold"] / max(rates[0, "warm"], 1e-9)
    rows.append(("loader: cold / warm rate, in a thread", f"{ratio:.2f}x" + (
        " (close to warm: the page cache drop may not have reached the disk)"
        if ratio >= 0.8 else "")))
    return rows


PARTS = ("train", "head", "loader", "extract")


def seconds(text: str) -> float:
    """--budget: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def parts_list(text: str) -> list[str]:
    """--parts: known names, each once, run in PARTS order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown part(s) {', '.join(unknown) or '(none given)'}: choose from "
            f"{', '.join(PARTS)}")
    return [p for p in PARTS if p in names]


def read_measured(path: Path | None) -> dict[str, float]:
    """What an earlier process's train part measured, if it left a file: numbers > 0 only.
    A file that cannot be written later (its folder missing) is refused before any part
    runs, not after the first."""
    if path is None:
        return {}
    if not path.parent.is_dir():
        raise SystemExit(f"--measured {path}: its folder {path.parent} does not exist (or is "
                         "not a folder); create it or choose another path")
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--measured {path}: not readable as JSON ({e})") from e
    good = isinstance(raw, dict) and all(
        k in ("step_s", "context_tok_s") and isinstance(v, (int, float))
        and not isinstance(v, bool) and math.isfinite(v) and v > 0 for k, v in raw.items())
    if not good:
        raise SystemExit(f"--measured {path}: expected step_s and context_tok_s > 0, got {raw}")
    return raw


def save_measured(path: Path, measured: dict[str, float]) -> None:
    """Rewrite --measured; a write that fails is said, and the later parts still run."""
    try:
        path.write_text(json.dumps(measured))
    except OSError as e:
        print(f"  --measured {path}: cannot write it ({e.strerror or e}); the later parts "
              "run without it", flush=True)


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on CPU (checks the script, measures nothing)")
    parser.add_argument("--budget", type=seconds, default=270,
                        help="seconds after which parts not yet started are skipped "
                             "(a started part finishes)")
    parser.add_argument("--parts", type=parts_list, default=list(PARTS),
                        help=f"comma-separated parts to run, in this order: {','.join(PARTS)} "
                             "(default: all; a rerun can take the ones a first run missed)")
    parser.add_argument("--measured", type=Path, default=None,
                        help="JSON file of what the train part measured (the step's seconds "
                             "and context tok/s): read if it exists, rewritten after each "
                             "part, so head and loader run in another process are still set "
                             "against the step")
    args = parser.parse_args()
    measured = read_measured(args.measured)
    # A run killed by its time limit (SIGTERM) first prints every thread's stack: the log
    # then says where the time went even inside a compile or a kernel wait.
    faulthandler.register(signal.SIGTERM, chain=True)
    if args.cpu_smoke:
        device, shapes = torch.device("cpu"), CPU_SMOKE
        from dflash_train.target_model.loading import guard_kernels

        guard_kernels("cpu")
    elif torch.cuda.is_available():
        device, shapes = torch.device("cuda"), Shapes()
    else:
        raise SystemExit("no CUDA device: run with --cpu-smoke")
    root = Path(tempfile.mkdtemp(prefix="dflash-gpu-bench-"))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
    print(f"dflash GPU benchmarks on {name}, {time.strftime('%Y-%m-%d')}", flush=True)
    try:  # each part prints as it ends: a run cut short still reports what it measured
        # training first: the extract part was measured on an H200 (docs/benchmarks.md), the
        # training step at the 27B drafter shape not yet; head and loader set against it
        benches = {"train": lambda: bench_train(shapes, device, args.budget, measured),
                   "head": lambda: bench_head(shapes, device, measured),
                   "loader": lambda: bench_loader(shapes, device, root, measured),
                   "extract": lambda: bench_extract(shapes, device, root)}
        for name in args.parts:
            bench = benches[name]
            if time.perf_counter() - _START > args.budget:
                print(f"  {name:<54}  skipped: the {args.budget:.0f} s budget is spent")
                continue
            try:
                rows = bench()
            except Exception as e:  # a part that fails is reported; the next one still runs
                rows = [(name, f"failed: {type(e).__name__}: {e}"[:300])]
            for what, value in rows:
                print(f"  {what:<54}  {value}", flush=True)
            if args.measured is not None:
                save_measured(args.measured, measured)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"  {'(wall time of the whole run)':<54}  {time.perf_counter() - _START:.0f} s")


if __name__ == "__main__":
    main()
