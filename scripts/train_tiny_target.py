"""Train the tiny target that ships with dflash, on the standard library's own source code.

    python -m scripts.train_tiny_target            # writes dflash_train/assets/stdlib_target/
                                                   # and dflash_train/assets/prompts/*.jsonl

Everything is built from what every Python install has, so anyone can re-run it: the stdlib
.py files (tests, codec tables and duplicates left out) are split by file into train and
held-out; a byte-level BPE (Qwen's pre-tokenizer, saved as Qwen3_5Tokenizer) is trained on
the train files; a Qwen3.5 hybrid (linear + full attention) is trained on chat-shaped
"Continue this Python code:" examples cut from the train files; the embedded prompt set is
cut from the held-out files (never seen by the target) and split again into the drafter's
train and held-out prompts. The run records its wall time, held-out loss against the uniform
and unigram baselines, and how much its greedy continuations loop (repeated-4-gram share) in
TRAINING.json next to the weights. Seeded: the same Python version and torch give the same
files. The corpus is the running interpreter's stdlib, so another Python version gives a
slightly different (equally valid) target.

Answers run to the end of the code's paragraph (the next blank line, at most 8 lines), so
the target learns where an answer stops.

The shipped run (Python 3.11.7, torch 2.13.0 CPU, 1 thread on a shared 2-core machine,
defaults): 3.06M parameters, 2400 steps of 16 x 256 tokens (9.8M tokens) in 65.9 min;
held-out loss 2.64 nats/token against 7.62 uniform and 6.39 unigram (curve: 3.36 @400,
3.04 @800, 2.82 @1200, 2.70 @1600, 2.65 @2000, 2.64 @2400: flat at the end). Greedy
continuations of 64 held-out prompts (96 new tokens): 55 % end with <|im_end|> (mean 58 new
tokens); the rest mostly loop, so 56 % of all 4-grams repeat an earlier one. The previous
asset (fixed 3-8 line answers, 1100 steps) reached 3.04 nats, 20 % ended, 57 % repeated:
ending improved, looping did not; a 3M-parameter model that does not end keeps repeating.
For scale: 96-token windows of real held-out stdlib code repeat 6.8 % of their 4-grams.

More compute does not fix it: the corpus is the limit. On one H200 (2026-11-30, `--device cuda
--stdlib <this Python 3.11 stdlib> --examples 160000 --batch 256 --minutes 2.6`, 1893 steps,
124M tokens, 2.9 min) held-out loss bottomed at 2.93 after 400 steps and rose to 4.11 while
train loss fell to 0.67: the 2.56M tokens of kept train files are memorised after a few passes.
The memorised model ended 89 % of its answers and repeated only 20 % of 4-grams, but it is not
a language model of held-out code, so it was not shipped.
"""

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

# a shared CPU: spinning OpenMP workers make every step wait for a descheduled thread
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dflash_train.target_model.loading import GPU_ONLY_PACKAGES  # noqa: E402

# trained and measured on the torch linear-attention path, the one a CPU user runs
for _package in GPU_ONLY_PACKAGES:
    sys.modules.setdefault(_package, None)

from dflash_train.assets.stdlib_corpus import (  # noqa: E402
    SourceFile,
    continuation_example,
    list_sources,
    repeated_ngram_share,
    split_of,
    stdlib_root,
)
from dflash_train.assets.tiny import CHAT_TEMPLATE  # noqa: E402

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "dflash_train/assets/stdlib_target"),
                   help="Target directory to write (weights, tokenizer, TRAINING.json).")
    p.add_argument("--prompts-out", default=str(REPO / "dflash_train/assets/prompts"),
                   help="Directory of the embedded prompt set (train.jsonl, held_out.jsonl).")
    p.add_argument("--vocab", type=int, default=2048, help="Tokenizer and model vocabulary.")
    p.add_argument("--hidden", type=int, default=192, help="Model width.")
    p.add_argument("--layers", type=int, default=6,
                   help="Decoder layers; every third is full attention, the rest linear.")
    p.add_argument("--steps", type=int, default=2400, help="Optimiser steps.")
    p.add_argument("--batch", type=int, default=16, help="Sequences per step.")
    p.add_argument("--seq", type=int, default=256, help="Tokens per training sequence.")
    p.add_argument("--lr", type=float, default=3e-3, help="Peak learning rate.")
    p.add_argument("--warmup", type=int, default=100, help="Linear warmup steps.")
    p.add_argument("--examples", type=int, default=120_000, help="Training examples cut.")
    p.add_argument("--train-prompts", type=int, default=1024, help="Drafter train prompts.")
    p.add_argument("--held-out-prompts", type=int, default=128, help="Drafter held-out prompts.")
    p.add_argument("--eval-every", type=int, default=400, help="Steps between held-out evals.")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda (bf16 autocast); linear attention always takes the "
                        "torch path users run, never fla.")
    p.add_argument("--minutes", type=float, default=None,
                   help="Instead of --steps: time steps 6-25, then pick the step count that "
                        "trains for about this long (recorded in TRAINING.json).")
    p.add_argument("--stdlib", default=None,
                   help="Stdlib directory to use as the corpus (default: this Python's).")
    p.add_argument("--seed", type=int, default=0, help="Seed of everything random.")
    return p.parse_args()


def render(prompt: str, answer: str) -> str:
    """The chat text CHAT_TEMPLATE renders for one user turn and its answer."""
    return (f"<|im_start|>user\n{prompt}<|im_end|>\n"
            f"<|im_start|>assistant\n{answer}<|im_end|>\n")


def train_tokenizer(files: list[SourceFile], vocab: int):
    """Byte-level BPE with Qwen3.5's normalizer and pre-tokenizer, as a Qwen3_5Tokenizer.

    transformers rebuilds a qwen3_5 tokenizer from vocab + merges with Qwen's own
    pre-tokenizer, so the BPE is trained under that same pre-tokenizer (merges across its
    split points could never apply).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    qwen = Qwen3_5Tokenizer()._tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = qwen.normalizer
    bpe.pre_tokenizer = qwen.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # role words and the prompt prefix as they appear in every example
    chat_bits = [render("Continue this Python code:\nx = 1", "y = 2")] * 200
    bpe.train_from_iterator([f.text for f in files] + chat_bits, trainer)
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen3_5Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                           unk_token=None, eos_token="<|im_end|>", pad_token="<pad>")
    tok.add_special_tokens({"mask_token": "<|mask|>",
                            "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def cut_examples(files: list[SourceFile], n: int, seed: int) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs from files drawn in proportion to their line counts."""
    rng = random.Random(seed)
    weights = [len(f.lines) for f in files]
    out: list[tuple[str, str]] = []
    while len(out) < n:
        ex = continuation_example(rng.choices(files, weights)[0], rng)
        if ex is not None:
            out.append(ex)
    return out


def token_stream(tok, examples: list[tuple[str, str]]) -> torch.Tensor:
    ids = tok([render(p, a) for p, a in examples], add_special_tokens=False)["input_ids"]
    return torch.tensor([t for row in ids for t in row], dtype=torch.int32)


def build_model(tok, args):
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kinds = ["full_attention" if (i + 1) % 3 == 0 else "linear_attention"
             for i in range(args.layers)]
    config = Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=args.hidden // 4, linear_value_head_dim=args.hidden // 4,
        linear_conv_kernel_dim=4, layer_types=kinds, max_position_embeddings=4096,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    return model


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(stream: torch.Tensor, seq: int) -> torch.Tensor:
    n = (len(stream) - 1) // seq
    return torch.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)]).long()


@torch.no_grad()
def held_out_loss(model, chunks: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token loss in nats over every token of the held-out chunks."""
    model.eval()
    total = 0.0
    for i in range(0, len(chunks), batch):
        x = chunks[i : i + batch]
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / chunks[:, 1:].numel()


def unigram_loss(train: torch.Tensor, held_out: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of the held-out tokens under the train unigram (add-one smoothed)."""
    counts = torch.bincount(train.long(), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[held_out.long()].mean())


@torch.no_grad()
def greedy_loops(model, tok, prompts: list[str], max_new: int = 96) -> dict:
    """Greedy continuations of chat prompts: repeated-4-gram share, eos rate, a sample."""
    from dflash_train.target_model.generation import continuations

    model.eval()
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                   add_generation_prompt=True) for p in prompts]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ids]
    outs = []
    for i in range(0, len(ids), 32):
        outs += continuations(model, ids[i : i + 32], max_new_tokens=max_new,
                              eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    repeated = total = 0
    for o in outs:
        r, t = repeated_ngram_share(o)
        repeated, total = repeated + r, total + t
    return {"prompts": len(outs), "max_new_tokens": max_new,
            "repeated_4gram_share": repeated / max(1, total),
            "ended_with_eos": sum(o[-1:] == [tok.eos_token_id] for o in outs) / len(outs),
            "mean_new_tokens": sum(map(len, outs)) / len(outs),
            "example_prompt": prompts[0], "example_continuation": tok.decode(outs[0])}


def write_prompts(out: Path, files: list[SourceFile], args) -> dict[str, list[str]]:
    """The embedded prompt set from held-out files, split by file into train / held_out."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = {}
    for split, n, seed in (("train", args.train_prompts, args.seed + 2),
                           ("held_out", args.held_out_prompts, args.seed + 3)):
        # a second hash split of the target's held-out files: drafter train vs held-out
        mine = [f for f in files if (split_of(f.name + "#prompts", 20) == "held_out")
                == (split == "held_out")]
        rng, seen, rows = random.Random(seed), set(), []
        while len(rows) < n:
            ex = continuation_example(rng.choice(mine), rng)
            if ex is not None and ex[0] not in seen:
                seen.add(ex[0])
                rows.append({"prompt": ex[0], "response": ex[1]})
        with open(out / f"{split}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        prompts[split] = [r["prompt"] for r in rows]
        print(f"prompts: {len(rows)} {split} from {len(mine)} files -> {out / split}.jsonl")
    return prompts


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    files = list_sources(Path(args.stdlib) if args.stdlib else None)
    train_files = [f for f in files if split_of(f.name) == "train"]
    held_files = [f for f in files if split_of(f.name) == "held_out"]
    print(f"stdlib {args.stdlib or stdlib_root()}: {len(files)} files kept, "
          f"{len(train_files)} train, {len(held_files)} held out")

    tok = train_tokenizer(train_files, args.vocab)
    assert len(tok) == args.vocab, f"tokenizer has {len(tok)} tokens, expected {args.vocab}"
    sample = ("Continue this Python code:\nimport os", "x = 1")
    expected = tok.apply_chat_template(
        [{"role": "user", "content": sample[0]}, {"role": "assistant", "content": sample[1]}],
        tokenize=False)
    assert render(*sample) == expected, "render() drifted from CHAT_TEMPLATE"
    train_stream = token_stream(tok, cut_examples(train_files, args.examples, args.seed))
    held_stream = token_stream(tok, cut_examples(held_files, 1500, args.seed + 1))
    train_chunks, held_chunks = windows(train_stream, args.seq), windows(held_stream, args.seq)
    held_chunks = held_chunks[:160]
    uniform, unigram = math.log(args.vocab), unigram_loss(train_stream, held_stream, args.vocab)
    print(f"tokens: train {len(train_stream):,} ({len(train_chunks)} x {args.seq}), held-out "
          f"{held_chunks[:, 1:].numel():,}; baselines: uniform {uniform:.2f}, unigram "
          f"{unigram:.2f} nats/token ({time.perf_counter() - start:.0f} s)")
    prompts = write_prompts(Path(args.prompts_out), held_files, args)

    device = torch.device(args.device)
    model = build_model(tok, args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, layers {model.config.layer_types}")
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train_chunks), generator=gen)
    train_chunks, held_chunks = train_chunks.to(device), held_chunks.to(device)
    curve = []
    train_start = time.perf_counter()
    model.train()
    step = 0
    while step < args.steps:
        x = train_chunks[order[torch.arange(step * args.batch, (step + 1) * args.batch)
                               % len(order)].to(device)]
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 x[:, 1:].flatten())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        step += 1
        if step == 5:
            timing_start = time.perf_counter()  # steps 6-25: past the first-call overheads
        if args.minutes and step == 25:  # still in warmup: the schedule is not yet used
            seconds = (time.perf_counter() - timing_start) / 20
            args.steps = max(args.warmup + 1, int(args.minutes * 60 / seconds))
            print(f"--minutes {args.minutes}: {seconds:.3f} s/step -> --steps {args.steps}")
        if step % 50 == 0 or step == 1:
            elapsed = time.perf_counter() - train_start
            print(f"step {step}/{args.steps} loss {loss.item():.3f} lr {lr_at(step - 1, args):.2e}"
                  f" {elapsed:.0f} s", flush=True)
        if step % args.eval_every == 0 and step < args.steps:
            curve.append({"step": step, "held_out_loss": held_out_loss(model, held_chunks),
                          "minutes": (time.perf_counter() - train_start) / 60})
            print(f"  held-out loss {curve[-1]['held_out_loss']:.3f}", flush=True)
    train_minutes = (time.perf_counter() - train_start) / 60

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    model.to("cpu", torch.bfloat16).save_pretrained(out)  # bf16 keeps the asset a few MB
    tok.save_pretrained(out)

    # every number below is measured on the weights as shipped (bf16, computed in fp32)
    from transformers import AutoModelForCausalLM
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    final = held_out_loss(shipped, held_chunks)
    curve.append({"step": args.steps, "held_out_loss": final, "minutes": train_minutes})
    loops = greedy_loops(shipped, tok, prompts["held_out"][:64])
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "settings": vars(args) | {"out": None, "prompts_out": None},
        "python": platform.python_version(), "torch": torch.__version__,
        "files": {"kept": len(files), "train": len(train_files), "held_out": len(held_files)},
        "parameters": n_params, "train_tokens_seen": args.steps * args.batch * args.seq,
        "train_minutes": round(train_minutes, 2),
        "total_minutes": round((time.perf_counter() - start) / 60, 2),
        "held_out_loss": round(final, 4), "uniform_loss": round(uniform, 4),
        "unigram_loss": round(unigram, 4), "curve": curve, "greedy": loops,
    }
    (out / "TRAINING.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"held-out loss {final:.3f} nats/token (uniform {uniform:.2f}, unigram {unigram:.2f})"
          f"; trained {train_minutes:.1f} min; greedy repeated-4-gram share "
          f"{loops['repeated_4gram_share']:.1%}, ended with eos {loops['ended_with_eos']:.0%}")
    print(f"example: {loops['example_prompt'][-200:]!r}\n  -> "
          f"{loops['example_continuation']!r}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
