"""Generation for `extract --regenerate`: the built-in path against OpenAI-compatible servers.

    vllm serve MODEL --dtype float32 --enforce-eager --max-model-len 2048 --port 8000 &
    python -m benchmarks.server_generate --model MODEL --data chats.jsonl --rows 16 \\
        --max-new-tokens 64 --server http://127.0.0.1:8000

Renders the same prompts extract would, generates them once with the loaded target (the
built-in path, its batches) and once through the servers (extract's requests), side by side
in one process, and prints generated tokens/s of each, how many rows came out identical,
and the share of server tokens equal to the target's own top-1 after the tokens before them
(what `store info` reports once they are stored). A benchmark: it measures, CI does not run it.
"""

import argparse
import time

import torch

from benchmarks.driver import package_errors_as_one_line
from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.data import open_source
from dflash_train.extract.prepare import (
    Counts,
    prompt_fits,
    regenerate_items,
    render_rows,
)
from dflash_train.extract.server_generate import check_servers
from dflash_train.target_model.loading import (
    load_target,
    load_target_config,
    load_tokenizer,
    target_info,
)


def top1_share(model, items) -> tuple[int, int]:
    """(answer tokens equal to the model's argmax at the token before, answer tokens)."""
    agree = total = 0
    with torch.inference_mode():
        for item in items:
            ids = torch.tensor([item.input_ids])
            top1 = model(ids).logits[0, :-1].argmax(-1)
            mask = torch.tensor(item.loss_mask[1:])
            agree += int((top1 == ids[0, 1:])[mask].sum())
            total += int(mask.sum())
    return agree, total


@package_errors_as_one_line
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Target directory (the served one).")
    ap.add_argument("--data", required=True, help="Chats as extract reads them.")
    ap.add_argument("--rows", type=int, default=16, help="First rows to generate for.")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="Tokens per prompt.")
    ap.add_argument("--server", action="append", required=True, help="Server URL (repeat).")
    ap.add_argument("--server-requests", type=int, default=32, help="Requests in flight.")
    ap.add_argument("--max-length", type=int, default=2048, help="Longest sample.")
    args = ap.parse_args()

    cfg = ExtractConfig(model=args.model, data=[args.data], out="", regenerate=True,
                        max_new_tokens=args.max_new_tokens, max_length=args.max_length,
                        servers=args.server, server_requests=args.server_requests,
                        device="cpu", dtype="float32", progress=False)
    source = open_source(cfg.data)
    tokenizer = load_tokenizer(cfg.model)
    rows = range(min(args.rows, source.num_rows))
    prompts = [k for p in render_rows(source, tokenizer, rows, cfg)
               if (k := prompt_fits(p, cfg, Counts())) is not None]
    info = target_info(cfg.model, load_target_config(cfg.model))
    need = min(cfg.max_length, max(len(p.input_ids) for p in prompts) + cfg.max_new_tokens)
    servers = check_servers(cfg.servers, [cfg.model, info.name_or_path], need, cfg.server_timeout)
    target = load_target(cfg.model, device="cpu", dtype=torch.float32, load_as=cfg.load_as,
                         revision=None, progress=False)

    timed = {}
    for name, kwargs in (("built-in", {}), ("server", {"servers": servers})):
        start = time.perf_counter()
        items = regenerate_items(target, tokenizer, prompts, cfg, 0, **kwargs)
        seconds = time.perf_counter() - start
        tokens = sum(sum(i.loss_mask) for i in items)
        timed[name] = (items, tokens, seconds)
        print(f"{name:9s} {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tok/s")
    (ours, n_ours, t_ours), (theirs, n_theirs, t_theirs) = timed["built-in"], timed["server"]
    same = sum(a.input_ids == b.input_ids for a, b in zip(ours, theirs, strict=True))
    agree, total = top1_share(target.model, theirs)
    print(f"server / built-in tokens/s: {n_theirs / t_theirs / (n_ours / t_ours):.2f}x")
    print(f"rows identical: {same} of {len(ours)}")
    print(f"server tokens equal to the target's top-1: {agree} of {total} ({agree / total:.2%})")


if __name__ == "__main__":
    main()
