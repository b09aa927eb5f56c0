"""Training step time and peak RSS on the CPU, against sequence length and anchors per sequence.

    python -m benchmarks.train_memory [--width tiny|smollm2 ...] [--length 128 512 ...]
        [--anchors 16 64 256 512 ...] [--batch-tokens N] [--steps 3] [--threads N]
        [--set KEY=VALUE ...]

For each (width, length, anchors) it writes a synthetic store (`--samples` rows of `length`
tokens of a target of that width), then trains `--steps` steps of `dflash train` defaults
(`train()` itself: loader, noise statistics, drafter, loss, optimiser) in a fresh process and
reports the median step time of the steps after the first and that process's peak RSS
(VmHWM, not ru_maxrss, which Linux carries from a big parent across fork + exec). `--set`
passes settings as `dflash train --set` does, e.g. --set run.chunk_blocks=0 or
--set run.attention=dense (the reference path: every block's keys under one mask). `--threads`
sets torch's intra-op threads (on a shared machine 1 thread is steadier). Not a test.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES = 48
TOP_K = 8

WIDTHS = {
    # the tiny target of the issue report: hidden 64
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, num_hidden_layers=8),
    # HuggingFaceTB/SmolLM2-135M's shape (config.json), 5 context layers
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    num_hidden_layers=30),
}


def build_store(url: str, width: str, length: int, samples: int = SAMPLES) -> None:
    """One finished part of `samples` rows of `length` random tokens (a 4-token prompt)."""
    import torch

    from dflash_train.store_schema import (
        CreatedWith,
        Sample,
        SourceInfo,
        StoreMeta,
        TargetInfo,
        TokenizerInfo,
        create_store,
    )

    shape = WIDTHS[width]
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    layers = [1, 2] if width == "tiny" else [1, 8, 15, 22, 26]
    meta = StoreMeta(
        target=TargetInfo(width, None, "llama", shape["num_hidden_layers"], hidden, vocab,
                          "0" * 64),
        tokenizer=TokenizerInfo("0" * 64, None, False),
        source=SourceInfo(["synthetic"], ["0" * 64], length, True, samples),
        created_with=CreatedWith("bench", torch.__version__, "-", "cpu", "torch"),
        context_layer_ids=layers, top_k=TOP_K, hidden_dtype="bfloat16", num_parts=1,
        extra={"mask_token_id": vocab - 1})
    store = create_store(url, meta)
    gen = torch.Generator().manual_seed(0)
    store.write_target_rows(torch.randn(vocab, hidden, generator=gen),
                            torch.randn(vocab, hidden, generator=gen) / hidden**0.5,
                            torch.ones(hidden))
    target = dict(shape, model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0)
    store.write_files("target", {"config.json": json.dumps(target).encode()})
    writer = store.part_writer(0, 0, samples)
    for row in range(samples):
        ids = torch.randint(0, vocab - 1, (length,), generator=gen)
        mask = torch.ones(length, dtype=torch.bool)
        mask[:4] = False
        writer.append(Sample(
            input_ids=ids.int(), loss_mask=mask,
            context=torch.randn(length, len(layers), hidden, generator=gen).bfloat16(),
            topk_ids=torch.randint(0, vocab, (length, TOP_K), generator=gen).int(),
            topk_logits=torch.linspace(5, 1, TOP_K).expand(length, TOP_K).contiguous(),
            lse=torch.full((length,), 6.0), source_row=row))
    writer.finish()


def child(store: str, out: str, steps: int, anchors: int, batch_tokens: int | None,
          sets: list[str], threads: int | None) -> None:
    """Train `steps` steps in this process; print step times and VmHWM (KiB) as JSON."""
    import torch

    from dflash_train.train.config import load_train_config
    from dflash_train.train.log_summary import read_log
    from dflash_train.train.loop import train

    overrides = {"stores": [store], "run.out_dir": out, "run.device": "cpu",
                 "optim.max_steps": steps, "run.anchors_per_seq": anchors,
                 "run.progress": False, "run.checkpoint_every": 10**6}
    if batch_tokens is not None:
        overrides["loader.batch_tokens"] = batch_tokens
    for item in sets:
        key, _, value = item.partition("=")
        overrides[key] = value
    if threads:
        torch.set_num_threads(threads)
    train(load_train_config(None, overrides), echo=lambda *_: None)
    records = read_log(out)
    status = Path("/proc/self/status").read_text()
    hwm = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])
    print(json.dumps({"step_s": [r.step_s for r in records],
                      "blocks": [r.blocks for r in records],
                      "samples": [r.samples for r in records], "hwm_kib": hwm}))


def measure(root: Path, width: str, length: int, anchors: int, args) -> dict:
    store = root / f"{width}-{length}x{args.samples}.zarr"
    if not store.exists():
        build_store(str(store), width, length, args.samples)
    out = tempfile.mkdtemp(dir=root)
    cmd = [sys.executable, __file__, "--child", str(store), "--out", out,
           "--steps", str(args.steps), "--anchors", str(anchors)]
    if args.batch_tokens is not None:
        cmd += ["--batch-tokens", str(args.batch_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    for item in args.set:
        cmd += ["--set", item]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return {"error": last[0]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    times = result["step_s"][1:] or result["step_s"]
    return {"step_s": statistics.median(times), "first_s": result["step_s"][0],
            "rss_mib": result["hwm_kib"] / 1024, "samples": result["samples"][0],
            "blocks": result["blocks"][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", nargs="+", default=["tiny", "smollm2"], choices=WIDTHS)
    parser.add_argument("--length", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--anchors", nargs="+", type=int, default=[16, 64, 256, 512])
    parser.add_argument("--batch-tokens", type=int, help="default: dflash train's")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=SAMPLES, help="rows per store")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    parser.add_argument("--dir", help="where stores and runs go (default: a temp dir)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.out, args.steps, args.anchors[0], args.batch_tokens, args.set,
              args.threads)
        return
    from benchmarks.driver import writable_dir  # here: a child runs this file as a script

    root = writable_dir("--dir", Path(args.dir or tempfile.mkdtemp(prefix="train-memory-")))
    print(f"batch tokens {args.batch_tokens or 'default'}, threads {args.threads or 'default'}, "
          f"settings {' '.join(args.set) or 'default'}")
    print("| width | tokens/seq | anchors/seq | seqs/step | blocks/step | step s | "
          "first step s | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for width in args.width:
        for length in args.length:
            for anchors in args.anchors:
                r = measure(root, width, length, anchors, args)
                if "error" in r:
                    print(f"| {width} | {length} | {anchors} | | | {r['error']} | | |",
                          flush=True)
                    continue
                print(f"| {width} | {length} | {anchors} | {r['samples']} | {r['blocks']} | "
                      f"{r['step_s']:.2f} | {r['first_s']:.2f} | {r['rss_mib']:.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
