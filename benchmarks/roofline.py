"""This machine's practical peaks, and each stage's work per second as a share of them.

    python -m benchmarks.roofline [--quick] [--update-docs docs/benchmarks.md]

At the thread count the stages use (torch.get_num_threads()) it measures GEMM rates in
float32 and bfloat16 at 2048^3 and at SmolLM2's shapes (hidden 576, intermediate 1536, 512-token
rows) and the memory copy rate (bytes copied per second), on CUDA too when torch sees it. Then,
on the CPU at SmolLM2's shape:
  target forward  extract's capture (target_model.capture.forward_states, then the top-k over
                  the lm_head) on a random-weight LlamaConfig model, in extract's auto dtype;
                  FLOPs = tokens x (2 x matmul parameters + 4 x layers x mean context x heads
                  x head_dim), the causal attention's QK^T and AV;
  regeneration    extract --regenerate's built-in generation with its states kept
                  (target_model.generate_capture) on the same model: 32 prompts of 64 tokens,
                  32 new tokens each; FLOPs counted as it runs, least traffic the weights
                  once a decoding step;
  drafter step    `dflash train`'s step (train.loop.train_step) at the quick preset's recipe
                  (benchmarks/optimizer_step.py: 1 layer, 4,096 draft ids, D-PACE, Muon, 16
                  anchors, 4,096-token batches) on a synthetic store, in train's auto precision;
                  FLOPs counted as it runs (`CountedFlops`: every matmul, attention's and
                  Muon's Newton-Schulz included, by torch's flop_counter registry, per output
                  dtype), so its bound mixes the dtypes' GEMM peaks by their FLOPs;
  loader          the StoreLoader's bytes of batches per second over that store, vs copy;
  store writer    extract's PartWriter (its flush interval) writing SmolLM2-shape samples
                  (5 context layers x 576 bf16, benchmarks/store_io.py's synthetic hidden
                  states) to a new store, synced to disk: logical bytes per second, vs the
                  least of copy, the disk's own synced write rate (the same bytes raw, the
                  median of three writes) and the rate its context codec encodes at (blosc
                  byte-shuffle + zstd-1, measured on the context bytes, scaled to all bytes);
  offline replay, cached live round
                  eval's two ways of drafting (benchmarks/roofline_decode.py says how), with
                  the quick preset's drafter (random weights) in eval's float32.
A stage's bound is the roofline's: the target forward's min(GEMM peak of its dtype, FLOP/byte
x copy rate) over its least traffic (weights once, inputs and outputs); the drafter step's the
GEMM peaks mixed by its counted FLOPs per dtype; a byte mover's the least of its ceilings (copy,
and for the writer the disk and the codec). "bound by" says which one.
Last, the same quantities counted (not measured) at Qwen3.6-27B's shape: what one H200 training
its drafter needs per second from the other stages. `--quick` (< 30 s, for the test) shrinks
every measurement and says so. Not a test.
"""

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.roofline_decode import live_round, offline_replay
from benchmarks.roofline_parts import (
    CPU,
    QUICK,
    SMOLLM2,
    CountedFlops,
    Size,
    Stage,
    dtype_name,
    random_target,
)
from benchmarks.train_memory import build_store

SMOLLM2_GEMMS = ((512, 576, 1536), (512, 1536, 576), (512, 576, 576))
"""(rows, in, out) of the MLP's up and down projections and the attention's q/o, 512 rows."""
BEGIN, END = "<!-- roofline:begin -->", "<!-- roofline:end -->"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(work: float, fn, device: torch.device, seconds: float) -> float:
    """work / second of fn() after a warm-up call; a call slower than `seconds` (emulated bf16
    at 2048^3 takes ~17 s on an AVX2 CPU) is its own measurement."""
    start = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - start
    if first >= seconds:
        return work / first
    calls, start = 0, time.perf_counter()
    while (took := time.perf_counter() - start) < seconds or calls == 0:
        fn()
        _sync(device)
        calls += 1
    return work * calls / took


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
              seconds: float) -> float:
    """FLOP/s of an [m, k] x [k, n] matmul."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    return _rate(2 * m * k * n, lambda: a @ b, device, seconds)


def copy_rate(mib: int, device: torch.device, seconds: float) -> float:
    """Bytes copied per second (each read once and written once) between two buffers."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _rate(src.numel(), lambda: dst.copy_(src), device, seconds)


def measure_peaks(size: Size, device: torch.device) -> dict[str, float]:
    """{name: rate}: "copy" in bytes/s, "<dtype> <m>x<k>x<n>" in FLOP/s."""
    s = size.square
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in ((s, s, s), *SMOLLM2_GEMMS):
            name = f"{dtype_name(dtype)} {m}x{k}x{n}"
            peaks[name] = gemm_rate(m, k, n, dtype, device, size.seconds)
    peaks["copy"] = copy_rate(size.copy_mib, device, size.seconds)
    return peaks


def target_forward(size: Size) -> Stage:
    """extract's capture on a random-weight model of SmolLM2's config, in extract's dtype."""
    from dflash_train.target_model.capture import forward_states
    from dflash_train.target_model.verifier import verifier_topk

    model, shape, layer_ids = random_target(size)
    dtype = model.dtype
    tokens = size.target_tokens
    ids = torch.randint(0, shape["vocab_size"], (1, tokens))
    mask = torch.ones_like(ids)

    @torch.inference_mode()
    def capture():
        context, final = forward_states(model.model, layer_ids, ids, mask)
        verifier_topk(final[0], model.lm_head, 8)

    matmul = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    heads = shape["num_attention_heads"] * shape["head_dim"]
    per_token = 2 * matmul + 4 * shape["num_hidden_layers"] * (tokens + 1) / 2 * heads
    flops = per_token * tokens
    weights = matmul * dtype.itemsize
    out = tokens * (len(layer_ids) + 1) * shape["hidden_size"] * dtype.itemsize
    capture()  # warms kernels up
    start = time.perf_counter()
    capture()
    return Stage("target forward", f"{shape['num_hidden_layers']} layers, {tokens} tokens",
                 flops, weights + out, time.perf_counter() - start, dtype)


def regeneration(size: Size) -> Stage:
    """extract --regenerate's built-in generation keeping the states (generate_with_states)
    on the same random-weight model: prompts of equal length, no eos, FLOPs counted as run.
    Least traffic: the weights once per decoding step (prefill included)."""
    from dflash_train.target_model.generate_capture import StatesToKeep, generate_with_states
    from dflash_train.target_model.loading import Target

    model, shape, layer_ids = random_target(size)
    dtype = model.dtype
    target = Target(model=model, decoder=model.model, lm_head=model.lm_head, info=None,
                    kernels="")
    rows, new = size.generate_rows, size.generate_tokens
    prompts = torch.randint(0, shape["vocab_size"], (rows, size.generate_prompt)).tolist()

    def generate():
        generate_with_states(target, prompts, StatesToKeep(layer_ids, 8), max_new_tokens=new,
                             eos_ids=[shape["vocab_size"]], pad_id=0)

    generate()  # warms kernels up
    start = time.perf_counter()
    generate()
    seconds = time.perf_counter() - start
    # counted on generate's own forwards (the dispatch mode sees nothing under the
    # inference_mode generate_with_states runs in), plus the prompts' top-k over the head
    with torch.no_grad(), CountedFlops() as counted:
        model.generate(input_ids=torch.tensor(prompts), attention_mask=torch.ones(rows, len(
            prompts[0]), dtype=torch.long), do_sample=False, max_new_tokens=new + 1,
            eos_token_id=shape["vocab_size"], pad_token_id=0)
    head = 2 * shape["vocab_size"] * shape["hidden_size"] * rows * size.generate_prompt
    matmul = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    return Stage("regeneration (built-in, states kept)",
                 f"{rows} prompts x {size.generate_prompt} + {new} new tokens",
                 sum(counted.by_dtype.values()) + head, (new + 1) * matmul * dtype.itemsize,
                 seconds, dtype)


def step_flops(fc_kv: float, layers: float, head: float, context: float, slots: float
               ) -> float:
    """A drafter step's model FLOPs, counted for the Qwen3.6-27B table (attention and the
    optimizer left out): 6 x (fc + K/V weights) x context tokens + 6 x layer weights x block
    slots + 4 x hidden x draft vocab x block slots (the frozen head: forward and the gradient
    to its input)."""
    return 6 * fc_kv * context + 6 * layers * slots + 4 * head * slots


def drafter_step(store: str, size: Size) -> Stage:
    """`dflash train`'s step at the quick preset's recipe, in train's auto precision; its
    FLOPs counted on an extra, untimed step over each timed step's batch (the count depends
    on shapes only)."""
    from benchmarks.optimizer_step import RECIPE, build_run
    from dflash_train.train.loop import train_step

    run = build_run(store, "muon", {"loader.batch_tokens": str(size.batch_tokens),
                                    "run.precision": "auto"})
    batches = [b for b in run.loader.epoch(0) if b is not None][: size.steps + 1]
    seconds, counts = [], []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        train_step(run, batch)
        if i:  # the first step warms caches and kernels up
            seconds.append(time.perf_counter() - start)
            with CountedFlops() as counted:
                train_step(run, batch)
            counts.append(counted.by_dtype)
    mix = {d: statistics.median(c.get(d, 0.0) for c in counts) for d in counts[0]}
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    # least traffic: weights, gradient and two optimiser moments, read and written once
    least = 16 * trainable + sum(t.nbytes for t in (batches[1].context, batches[1].topk_ids))
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    return Stage("drafter step", f"1 layer, {RECIPE['model.draft_vocab_size']} draft ids, "
                 f"{size.batch_tokens}-token batches", sum(mix.values()), least,
                 statistics.median(seconds), dtype, mix=mix)


def eval_drafter(store: str):
    """The quick preset's drafter (random weights, the store's head) as eval holds it on the
    CPU: float32, in eval mode."""
    from benchmarks.optimizer_step import build_run
    from dflash_train.evaluate.drafting import BlockDrafter

    return BlockDrafter(build_run(store, "adamw", {"run.precision": "fp32"}).model.eval())


def loader_stage(store: str, size: Size) -> Stage:
    """Bytes of batches the StoreLoader hands over per second, with nothing computing."""
    from benchmarks.optimizer_step import build_run

    loader = build_run(store, "adamw", {"loader.batch_tokens": str(size.batch_tokens)}).loader
    fields = ("input_ids", "loss_mask", "context", "topk_ids", "topk_logits", "lse")
    start, moved = time.perf_counter(), 0
    for batch in loader.epoch(0):
        if batch is not None:
            moved += sum(getattr(batch, f).nbytes for f in fields)
    return Stage("loader", f"{size.batch_tokens}-token batches", 0.0, moved,
                 time.perf_counter() - start)


def writer_stage(root: Path, size: Size) -> Stage:
    """Logical bytes of samples extract's PartWriter turns into a synced store per second."""
    from benchmarks.store_io import samples, synthetic_hidden, write_synced_store

    layers, hidden = 5, SMOLLM2["hidden_size"]
    items = samples(synthetic_hidden(size.writer_tokens, layers, hidden))
    moved = sum(t.nbytes for s in items for t in (s.input_ids, s.loss_mask, s.context,
                                                   s.topk_ids, s.topk_logits, s.lse))
    start = time.perf_counter()
    write_synced_store(str(root / "written.zarr"), items, layers, hidden, size.writer_tokens)
    seconds = time.perf_counter() - start
    # this VM's synced write rate moved 0.4-1.8 GB/s between single runs: the median of three
    disk = statistics.median(_synced_write_rate(root / "raw.bin", moved) for _ in range(3))
    context = torch.cat([s.context for s in items]).view(torch.int16).numpy()
    codec = _context_encode_rate(context) * moved / context.nbytes
    limit = min(("disk (synced write)", disk), ("compression (the context codec)", codec),
                key=lambda named: named[1])
    return Stage("store writer", f"{layers} x {hidden} bf16 per token, "
                 f"{size.writer_tokens} tokens", 0.0, moved, seconds, limit=limit)


def _context_encode_rate(context) -> float:
    """Bytes/s of encoding bf16 context (an int16 array, so its type size is the store's)
    with the store's own context codec (layout.context_compressors), in this process."""
    from dflash_train.store_schema.layout import context_compressors
    from dflash_train.store_schema.shards import blosc_of

    codec = blosc_of(context_compressors("bfloat16")[0])
    start = time.perf_counter()
    codec.encode(context)
    return context.nbytes / (time.perf_counter() - start)


def _synced_write_rate(path: Path, size: int) -> float:
    """Bytes/s of writing `size` random bytes to `path` and syncing them to disk."""
    import os

    from benchmarks.store_io import write_synced

    data = os.urandom(size)
    start = time.perf_counter()
    write_synced(path, data)
    rate = size / (time.perf_counter() - start)
    path.unlink()
    return rate


def bound(stage: Stage, peaks: dict[str, float], square: int) -> tuple[float, str]:
    """(the roofline's ceiling on the stage's work per second, what sets it)."""
    if stage.dtype is None:
        if stage.limit is not None and stage.limit[1] < peaks["copy"]:
            return stage.limit[1], stage.limit[0]
        return peaks["copy"], "memory (copy)"
    if stage.mix:
        fp32 = peaks[f"float32 {square}x{square}x{square}"]
        at_peak = sum(f / peaks.get(f"{d} {square}x{square}x{square}", fp32)
                      for d, f in stage.mix.items())
        shares = ", ".join(f"{d} {f / stage.flops:.0%}" for d, f in stage.mix.items() if f)
        return stage.flops / at_peak, f"compute (GEMM; FLOPs {shares})"
    peak = peaks[f"{dtype_name(stage.dtype)} {square}x{square}x{square}"]
    by_memory = stage.flops / stage.bytes * peaks["copy"]
    if by_memory < peak:
        return by_memory, "memory (copy)"
    return peak, f"compute ({dtype_name(stage.dtype)} GEMM)"


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def peaks_table(peaks: dict[str, dict[str, float]]) -> list[str]:
    """One row per measurement, one column per device."""
    lines = ["| peak | " + " | ".join(peaks) + " |", "| --- |" + " --- |" * len(peaks)]
    for name in next(iter(peaks.values())):
        unit = "B/s" if name == "copy" else "FLOP/s"
        label = "memory copy" if name == "copy" else f"GEMM {name}"
        lines.append(f"| {label} | " + " | ".join(_si(d[name], unit) for d in peaks.values())
                     + " |")
    return lines


def _share(x: float) -> str:
    """Two decimals; two significant digits below 0.1, so a small share never reads 0."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def stages_table(stages: list[Stage], peaks: dict[str, float], square: int) -> list[str]:
    lines = ["| stage | shape | work/s | FLOP/byte | bound | share | bound by |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for st in stages:
        ceiling, by = bound(st, peaks, square)
        done = (st.flops or st.bytes) / st.seconds
        unit = "FLOP/s" if st.dtype is not None else "B/s"
        intensity = f"{st.flops / st.bytes:.0f}" if st.dtype is not None else "-"
        lines.append(f"| {st.name} | {st.shape} | {_si(done, unit)} | {intensity} | "
                     f"{_si(ceiling, unit)} | {_share(done / ceiling)} | {by} |")
    return lines


@dataclass(frozen=True)
class H200Feed:
    """What one H200 training the Qwen3.6-27B drafter would need fed, counted, not measured."""

    peak: float = 989e12
    """Dense bf16 FLOP/s of an H200 SXM (the H100 SXM's tensor cores)."""
    hbm: float = 4.8e12
    host_link: float = 64e9
    """Bytes/s of the PCIe 5 x16 link the loader's batches cross to the card."""
    mfu: float = 0.4
    """Assumed share of `peak` a drafter step and a capture forward each reach."""
    seq: int = 4096
    anchors: int = 512
    """Blocks per sequence (TorchSpec's 512 anchors), of the drafter's 16 slots."""
    target_params: float = 27e9
    full_attention_layers: int = 16
    """Of the target's 64 layers, every 4th is full attention (the rest Gated DeltaNet, linear
    in the sequence and left out); 24 heads x 256."""
    capture_tokens: int = 4 * 4096
    """Tokens per capture forward (a weight read serves them all)."""

    def assumptions(self) -> str:
        return (f"Assumed: the drafter DrafterConfig.qwen3_6_27b() (5 layers, hidden 5120, "
                f"intermediate 17408, 32 x 128 query and 8 kv heads, frozen 248,320-word head); "
                f"{self.seq}-token sequences, {self.anchors} anchors x 16 slots each; an H200 at "
                f"{self.peak / 1e12:.0f} TFLOP/s bf16 and {self.hbm / 1e12:.1f} TB/s, each "
                f"stage at {self.mfu:.0%} of peak; the target {self.target_params / 1e9:.0f} B "
                f"parameters, {self.full_attention_layers} full-attention layers, "
                f"{self.capture_tokens} tokens per capture forward; the store 5 layers x 5120 "
                "bf16 per token (top-k rows left out).")


def h200_table(a: H200Feed) -> list[str]:
    """Work per second each stage must deliver to keep one H200's drafter step busy."""
    from dflash_train.drafter.config import DrafterConfig

    d = DrafterConfig.qwen3_6_27b()
    h, q = d.hidden_size, d.num_attention_heads * d.head_dim
    kv = 2 * h * d.num_key_value_heads * d.head_dim
    layer = 2 * h * q + kv + 3 * h * d.intermediate_size
    fc = len(d.target_layer_ids) * h * h
    slots = a.anchors * d.block_size
    per_seq = step_flops(fc + kv * d.num_hidden_layers, layer * d.num_hidden_layers,
                         h * d.vocab_size, a.seq, slots)
    seqs = a.mfu * a.peak / per_seq
    trained = 16 * (fc + layer * d.num_hidden_layers)
    store_token = len(d.target_layer_ids) * h * 2
    attention = 4 * a.full_attention_layers * a.seq / 2 * 24 * 256
    capture = seqs * a.seq * (2 * a.target_params + attention)
    capture_intensity = a.capture_tokens * (2 * a.target_params + attention) / (
        2 * a.target_params + a.capture_tokens * store_token)
    stream = seqs * a.seq * store_token
    return [
        "| stage | needed per second | FLOP/byte | bound by | H200s at the assumed share |",
        "| --- | --- | --- | --- | --- |",
        f"| drafter step | {_si(a.mfu * a.peak, 'FLOP/s')} ({seqs:.2f} sequences) | "
        f"{per_seq / (trained + a.seq * store_token):.0f} | compute | 1 |",
        f"| target forward (capture) | {_si(capture, 'FLOP/s')} | {capture_intensity:.0f} | "
        f"compute | {capture / (a.mfu * a.peak):.2f} |",
        f"| store writer / loader | {_si(stream, 'B/s')} each | - | storage and host link | "
        f"{stream / a.host_link:.1%} of a PCIe 5 x16 link |",
    ]


def _cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def report(size: Size, quick: bool) -> str:
    """The markdown the command prints: the machine, its peaks, the stages, the H200 count."""
    from dflash_train.devices import native_bf16

    peaks = {"cpu": measure_peaks(size, CPU)}
    if torch.cuda.is_available():
        peaks["cuda"] = measure_peaks(size, torch.device("cuda"))
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "smollm2.zarr")
        build_store(store, "smollm2", 192, samples=size.samples)
        stages = [target_forward(size), regeneration(size), drafter_step(store, size),
                  loader_stage(store, size), writer_stage(Path(tmp), size)]
        drafter = eval_drafter(store)
        stages += [offline_replay(size, drafter), live_round(size, drafter)]
    h200 = H200Feed()
    return "\n".join([
        f"{time.strftime('%Y-%m-%d')}, {_cpu_name()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, native bf16: {native_bf16(CPU)}"
        + (" (--quick: smaller shapes than the full run)" if quick else ""), "",
        *peaks_table(peaks), "",
        "Stages on the CPU at SmolLM2's shape (share: work/s over the bound):", "",
        *stages_table(stages, peaks["cpu"], size.square), "",
        "Qwen3.6-27B, counted: what one H200 training the drafter needs per second.", "",
        *h200_table(h200), "", h200.assumptions()])


def markers_in(text: str, path: Path) -> tuple[int, int]:
    """Where the roofline block starts and ends in `text`; a clear refusal without them."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin or text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"--update-docs {path}: needs exactly one {BEGIN} followed by one {END}"
                         " to replace the text between; add them where the table belongs")
    return begin + len(BEGIN), end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="Smaller measurements (< 30 s on 2 cores), for the test.")
    ap.add_argument("--update-docs", type=Path, metavar="FILE",
                    help="Also replace the text between the roofline markers in FILE.")
    args = ap.parse_args()
    if args.update_docs is not None:  # refused before minutes of measuring, not after
        markers_in(args.update_docs.read_text(), args.update_docs)
    table = report(QUICK if args.quick else Size(), args.quick)
    print(table)
    if args.update_docs is not None:
        text = args.update_docs.read_text()
        start, stop = markers_in(text, args.update_docs)
        args.update_docs.write_text(f"{text[:start]}\n{table}\n{text[stop:]}")
        print(f"\nwrote the table into {args.update_docs}", file=sys.stderr)


if __name__ == "__main__":
    main()
