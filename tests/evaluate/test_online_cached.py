"""The cached --online loop commits what the no-cache reference commits, round by round:
chains and DDTrees, DFlash and DFlash 2 drafters, on an attention-only target (tiny Qwen3) and
on a hybrid (tiny Qwen3.5: Gated DeltaNet layers beside full attention, float32)."""

import pytest
import torch

from dflash_train.drafter import load_drafter, save_drafter
from dflash_train.drafter.model import dflash2_from
from dflash_train.evaluate.online import (
    CachedVerifier,
    RecomputeVerifier,
    StopRule,
    load_online_target,
    prompt_of,
    speculative_decode,
)
from dflash_train.evaluate.pipeline import load_drafters
from dflash_train.evaluate.samples import EvalSample
from dflash_train.store_schema import open_store
from tests.evaluate.conftest import EOS_ID

BUDGETS = (None, 3, 12)
"""Chains, a tree smaller than a block, a tree with many branches."""
PROMPTS = 5
"""The stores' first prompts decoded (each by 2 drafters x 3 walks x 2 loops)."""


def dflash2_dir(dflash_dir: str, store_url: str, out) -> str:
    """The DFlash drafter warm-started as DFlash 2, its selector random enough to override
    some argmax picks (so its walk and tree differ from the unary ones)."""
    base = load_drafter(dflash_dir)
    rows = open_store(store_url).target_rows()
    base.attach_target_head(rows["embed_tokens"].float(), rows["lm_head"].float())
    d2 = dflash2_from(base, selector_rank=8, selector_top_k=4)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in d2.candidate_selector.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "hidden" in name else 1.0))
    return str(save_drafter(d2, out / "d2"))


def decode_both(store_url: str, target_dir: str, drafter_dirs: list[str]) -> list[tuple]:
    store = open_store(store_url)
    target = load_online_target(target_dir, store.meta, device="cpu")
    _, drafters = load_drafters(store, drafter_dirs, device=torch.device("cpu"),
                                dtype=torch.float32)
    stop = StopRule([EOS_ID], max_new_tokens=24, max_length=store.meta.source.max_length)
    cached, recompute = CachedVerifier(target), RecomputeVerifier(target)
    out = []
    samples = [(part.index, i, s) for part in store.parts()
               for i, s in enumerate(part.iter_samples())][:PROMPTS]
    for part, i, s in samples:
        prompt = prompt_of(EvalSample.from_sample(part, i, s))
        for name, drafter in drafters.items():
            for budget in BUDGETS:
                runs = [speculative_decode(v, drafter, prompt, stop, 16, budget)
                        for v in (cached, recompute)]
                out.append(((part, i), name, budget, *runs))
    return out


def assert_same_rounds(decoded: list[tuple]) -> list[int]:
    taus = []
    for key, name, budget, cached, recompute in decoded:
        where = f"sample {key}, {name}, budget {budget}"
        assert cached.tokens == recompute.tokens, where
        assert [(r.anchor, r.tau) for r in cached.rounds] == \
            [(r.anchor, r.tau) for r in recompute.rounds], where
        taus += [r.tau for r in cached.rounds]
    return taus


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_cached_loop_equals_the_recompute_loop_chains_and_trees(
        kind, request, tmp_path, regen_store, eos_target_dir, trained_drafter_dir,
        hybrid_store, hybrid_target_dir, hybrid_drafter_dir):
    store, target, dflash = {
        "attention": (regen_store, eos_target_dir, trained_drafter_dir),
        "hybrid": (hybrid_store, hybrid_target_dir, hybrid_drafter_dir)}[kind]
    decoded = decode_both(store, target, [dflash, dflash2_dir(dflash, store, tmp_path)])
    taus = assert_same_rounds(decoded)
    # a real test: partial acceptance (a rejected tail to drop) and trees that go deeper
    # than their chain somewhere
    assert len(set(taus)) >= 4, taus
    deeper = [k for k, n, b, c, _ in decoded if b is not None and
              sum(r.tau for r in c.rounds) and len(c.rounds) < len(next(
                  x for x in decoded if x[:2] == (k, n) and x[2] is None)[3].rounds)]
    assert deeper, "no tree ever beat its chain: the tree path is untested"
