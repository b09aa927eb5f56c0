"""What a live round costs: plain greedy decoding, the cached chain loop, the cached DDTree loop
per budget and the no-cache reference loop, on one target in one process, the same prompts.

    python -m benchmarks.live_decoding --model DIR --store HELD.zarr --checkpoint CKPT \
        --prompts 4 --new-tokens 128,512 --out OUT

For each generation length, the first --prompts prompts of the store (their tokens before the
first response token) are decoded one after the other by:
- `greedy`: the target alone, one token a step with its cache (transformers' generate);
- `cached chain` and `cached tree@B`: `eval --online`'s loop (evaluate/online.py) with the
  target's cache, chains and a DDTree of B nodes per round;
- `no-cache chain` (and trees with --no-cache-trees): the same loop recomputing the whole
  sequence every round, the reference the cached loop is checked against.
Each reports new tokens per second (the prefill included), rounds and tau; the cached and
no-cache loops must commit the same tokens and the same per-round tau, or the run stops.
`--ignore-eos` decodes past the end-of-turn token to exactly --new-tokens (a serving
benchmark's ignore_eos), so every loop is measured at the length asked for.
Tokens/s here are this loop's on this machine, not a serving engine's. Writes live.json and
live.md into OUT. A benchmark: it measures, CI does not run it.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.driver import package_errors_as_one_line, writable_dir

TOP_K = 64
"""Candidates each loop drafts per slot (speculative_decode's top_k)."""


def refuse_unfillable_budgets(drafter, budgets: list[int]) -> None:
    """A --budgets value no tree of this drafter can reach (evaluate.tree.max_tree_nodes over
    its drafted slots) is refused before any decoding."""
    from dflash_train.evaluate.tree import tree_budget_refusal

    per_depth = (drafter.model.candidate_selector.top_k if drafter.walks
                 else min(TOP_K, drafter.config.draft_vocab))
    for budget in budgets:
        rule = tree_budget_refusal(budget, drafter.block_size - 1, per_depth)
        if rule is not None:
            raise SystemExit(f"--budgets {budget}: must be {rule}")


def load(model: str, store_url: str, checkpoint: str):
    from dflash_train.evaluate.online import load_online_target
    from dflash_train.evaluate.pipeline import load_drafters
    from dflash_train.store_schema import open_store

    store = open_store(store_url)
    target = load_online_target(model, store.meta, device="cpu")
    _, drafters = load_drafters(store, [checkpoint], device=torch.device("cpu"),
                                dtype=torch.float32)
    return store, target, next(iter(drafters.values()))


def prompts_of(store, count: int) -> list[list[int]]:
    from dflash_train.evaluate.online import prompt_of
    from dflash_train.evaluate.samples import EvalSample

    out = []
    for part in store.parts():
        for i, s in enumerate(part.iter_samples()):
            prompt = prompt_of(EvalSample.from_sample(part.index, i, s))
            if prompt is not None:
                out.append(prompt)
            if len(out) == count:
                return out
    return out


def greedy(target, prompt: list[int], new_tokens: int, eos: list[int]) -> list[int]:
    """The target's own cached greedy decoding; `eos` empty: it never stops before new_tokens
    (an empty list, not None: generate fills None from the model's generation config)."""
    model = target.target.model
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, eos_token_id=eos, temperature=None,
                         top_p=None, top_k=None, pad_token_id=eos[0] if eos else 0)
    return out[0, len(prompt):].tolist()


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def measure(target, drafter, prompts, stop, budgets, no_cache_trees: bool) -> dict:
    from dflash_train.evaluate.online import (
        CachedVerifier,
        RecomputeVerifier,
        speculative_decode,
    )

    cached, recompute = CachedVerifier(target), RecomputeVerifier(target)
    loops = {"cached chain": (cached, None)}
    loops |= {f"cached tree@{b}": (cached, b) for b in budgets}
    loops["no-cache chain"] = (recompute, None)
    if no_cache_trees:
        loops |= {f"no-cache tree@{b}": (recompute, b) for b in budgets}
    rows = {"greedy": {"tokens": 0, "seconds": 0.0, "rounds": 0}}
    rows |= {name: {"tokens": 0, "seconds": 0.0, "rounds": 0, "committed": 0} for name in loops}
    decodes = {}
    for p, prompt in enumerate(prompts):
        text, seconds = timed(lambda prompt=prompt: greedy(target, prompt, stop.max_new_tokens,
                                                           stop.eos_ids))
        rows["greedy"]["tokens"] += len(text)
        rows["greedy"]["seconds"] += seconds
        for name, (verifier, budget) in loops.items():
            decode, seconds = timed(lambda v=verifier, b=budget, prompt=prompt: speculative_decode(
                v, drafter, prompt, stop, TOP_K, b))
            row = rows[name]
            row["tokens"] += len(decode.tokens) - len(prompt)
            row["seconds"] += seconds
            row["rounds"] += len(decode.rounds)
            row["committed"] += sum(r.tau for r in decode.rounds)
            decodes[(name, p)] = decode
        for name in loops:
            if name.startswith("no-cache"):
                check_same(decodes[(name, p)], decodes[(name.replace("no-cache", "cached"), p)],
                           p)
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        if row.get("rounds"):
            row["tau"] = row["committed"] / row["rounds"]
    return rows


def check_same(reference, cached, prompt: int) -> None:
    same = reference.tokens == cached.tokens and \
        [(r.anchor, r.tau) for r in reference.rounds] == [(r.anchor, r.tau) for r in cached.rounds]
    if not same:
        raise SystemExit(f"prompt {prompt}: the cached loop committed other tokens or rounds "
                         "than the no-cache loop")


def markdown(results: dict) -> str:
    lines = [f"{results['target']}, drafter {results['checkpoint']}, {results['prompts']} "
             f"prompts decoded one after the other, {results['date']}, {results['threads']} "
             "torch threads" + (", past end-of-turn (--ignore-eos)" if results["ignore_eos"]
                                else "") + "\n"]
    for length, rows in results["lengths"].items():
        base = rows["no-cache chain"]["seconds"]
        greedy_rate = rows["greedy"]["tokens_per_s"]
        lines += [f"\nmax {length} new tokens:\n",
                  "| loop | new tokens/s | vs greedy | no-cache chain time / this | rounds | tau |",
                  "|---|---|---|---|---|---|"]
        for name, row in rows.items():
            tau = f"{row['tau']:.3f}" if "tau" in row else "-"
            lines.append(f"| {name} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / greedy_rate:.2f}x | "
                         f"{base / row['seconds']:.1f}x | {row.get('rounds') or '-'} | {tau} |")
    return "\n".join(lines) + "\n"


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="The store's target (directory).")
    parser.add_argument("--store", required=True, help="A regenerated held-out store.")
    parser.add_argument("--checkpoint", required=True, help="The drafter.")
    parser.add_argument("--prompts", type=int, default=4, help="Prompts decoded per loop.")
    parser.add_argument("--new-tokens", default="128,512",
                        help="Generation lengths (comma list).")
    parser.add_argument("--budgets", default="16,32,64", help="DDTree budgets (comma list).")
    parser.add_argument("--no-cache-trees", action="store_true",
                        help="Also time the no-cache loop with trees (slow).")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Decode past the end-of-turn token to exactly --new-tokens.")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        lengths = [int(x) for x in args.new_tokens.split(",")]
        budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        parser.error("--new-tokens and --budgets take comma-separated integers")
    if args.prompts < 1 or min(lengths) < 1 or any(b < 1 for b in budgets):
        parser.error("--prompts, --new-tokens and --budgets must be at least 1")
    writable_dir("--out", args.out)
    from dflash_train.evaluate.online import StopRule
    from dflash_train.target_model.generation import eos_token_ids
    from dflash_train.target_model.loading import load_tokenizer

    store, target, drafter = load(args.model, args.store, args.checkpoint)
    refuse_unfillable_budgets(drafter, budgets)
    prompts = prompts_of(store, args.prompts)
    eos = [] if args.ignore_eos else eos_token_ids(target.target.model,
                                                   load_tokenizer(args.model))
    results = {"date": time.strftime("%Y-%m-%d"), "target": Path(args.model).name,
               "checkpoint": Path(args.checkpoint).name, "prompts": len(prompts),
               "threads": torch.get_num_threads(), "ignore_eos": args.ignore_eos,
               "lengths": {}}
    for length in lengths:
        stop = StopRule(eos, max_new_tokens=length, max_length=10**9)
        results["lengths"][str(length)] = measure(target, drafter, prompts, stop, budgets,
                                                  args.no_cache_trees)
        print(markdown(results))
    (args.out / "live.json").write_text(json.dumps(results, indent=1))
    (args.out / "live.md").write_text(markdown(results))


if __name__ == "__main__":
    main()
