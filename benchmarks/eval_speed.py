"""Eval speed: offline replay vs `--online` live decoding vs a naive per-block loop.

All three score the same drafter on the same held-out store (made with --regenerate, so
offline replay visits the anchors live decoding visits) and the same embedded target:
  offline  evaluate_offline: store read + drafter over cached context, no target at all
  online   evaluate_online: the target recomputed over the sequence every round (no cache)
  naive    per replayed block: the target over the prefix, a fresh drafter context, one draft
Blocks/s is the result; timings exclude loading the models. Not a test.
"""

import time

import torch

from benchmarks.report import Row

GOAL = 5.0


def _blocks(results) -> int:
    return sum(r.walks[None].taus.summary().to_json()["n"] for r in results.values())


def naive_blocks(target, drafter, samples, sequences, top_k: int, limit: int) -> int:
    """Re-run target and drafter from scratch for each of the first `limit` replayed blocks."""
    done = 0
    for s in samples:
        for anchor, _ in sequences.get(s.key, []):
            if done >= limit:
                return done
            features, _ = target(s.input_ids[:anchor].tolist())
            cache = drafter.context_cache(features)
            drafter.draft(cache, torch.tensor([[anchor]]), s.input_ids[anchor:anchor + 1][None],
                          top_k)
            done += 1
    return done


def bench(store_url: str, checkpoint: str, naive_limit: int = 64) -> tuple[list[Row], dict]:
    """Rows of item 5 and the offline summary (item 6 compares it across codecs)."""
    from dflash_train.assets.embedded import target_dir
    from dflash_train.evaluate.config import EvalSettings
    from dflash_train.evaluate.online import StopRule, evaluate_online, load_online_target
    from dflash_train.evaluate.pipeline import load_drafters
    from dflash_train.evaluate.replay import evaluate_offline
    from dflash_train.evaluate.samples import read_samples
    from dflash_train.evaluate.tokenizer import store_tokenizer
    from dflash_train.store_schema import open_store
    from dflash_train.target_model.generation import eos_token_ids

    store = open_store(store_url)
    _, drafters = load_drafters(store, [checkpoint], device=torch.device("cpu"),
                                dtype=torch.float32)
    settings = EvalSettings()
    target = load_online_target(str(target_dir()), store.meta, device="cpu")
    stop = StopRule(eos_ids=eos_token_ids(target.target.model, store_tokenizer(store)),
                    max_new_tokens=int(store.meta.extra["max_new_tokens"]),
                    max_length=store.meta.source.max_length)

    start = time.perf_counter()
    offline, _ = evaluate_offline(drafters, read_samples(store), settings)
    offline_s = time.perf_counter() - start
    samples = list(read_samples(store))
    start = time.perf_counter()
    online, generated = evaluate_online(target, drafters, samples, settings, stop)
    online_s = time.perf_counter() - start
    (name, drafter), = drafters.items()
    top_k = settings.top_k(drafter.config.vocab_size)
    start = time.perf_counter()
    naive = naive_blocks(target, drafter, samples, offline[name].walks[None].rounds, top_k,
                         naive_limit)
    naive_s = time.perf_counter() - start

    off_rate = _blocks(offline) / offline_s
    on_rate = _blocks(online) / online_s
    naive_rate = naive / naive_s
    same = sum(offline[name].walks[None].rounds.get(k) == online[name].walks[None].rounds.get(k)
               for k in generated)
    summary = offline[name].summary().to_json()
    rows = [
        Row("5 eval", "offline replay / --online blocks/s",
            f"{off_rate / on_rate:.1f}x ({off_rate:.0f} vs {on_rate:.1f} blocks/s)",
            f">= {GOAL:.0f}x", off_rate / on_rate >= GOAL),
        Row("5 eval", "offline replay / naive per-block loop",
            f"{off_rate / naive_rate:.1f}x ({naive_rate:.1f} blocks/s over {naive} blocks)"),
        Row("5 eval", "tau offline vs online, prompts with equal taus",
            f"{summary['mean_tau']:.3f} vs {online[name].summary().to_json()['mean_tau']:.3f}; "
            f"{same}/{len(generated)}"),
    ]
    return rows, summary


def offline_summary(store_url: str, checkpoint: str) -> dict:
    """The offline replay metrics of one checkpoint on a store (all samples, defaults)."""
    from dflash_train.evaluate.config import EvalSettings
    from dflash_train.evaluate.pipeline import load_drafters
    from dflash_train.evaluate.replay import evaluate_offline
    from dflash_train.evaluate.samples import read_samples
    from dflash_train.store_schema import open_store

    store = open_store(store_url)
    _, drafters = load_drafters(store, [checkpoint], device=torch.device("cpu"),
                                dtype=torch.float32)
    offline, _ = evaluate_offline(drafters, read_samples(store), EvalSettings())
    (result,) = offline.values()
    return result.summary().to_json()
