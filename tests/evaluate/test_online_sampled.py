"""`eval --online` at temperature > 0: sample-and-match with the store's keyed draws.

Plain sampled generation (what `extract --regenerate --temperature` stores), live chain
decoding and live tree decoding commit the same tokens, cached and recomputed; offline
`--mode replay` on the sampled store equals `--online` round by round, chain and trees, on an
attention-only target (tiny Qwen3) and on a hybrid (tiny Qwen3.5)."""

import pytest
import torch

from dflash_train.assets.tiny import make_chats, write_jsonl
from dflash_train.drafter import save_drafter
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.online import (
    CachedVerifier,
    RecomputeVerifier,
    StopRule,
    TargetChoice,
    load_online_target,
    prompt_of,
    speculative_decode,
)
from dflash_train.evaluate.pipeline import EvalConfig, load_drafters, run_eval
from dflash_train.evaluate.samples import read_samples
from dflash_train.store_schema import open_store
from dflash_train.target_model.generation import continuations
from dflash_train.target_model.sampling import SamplingConfig
from tests.evaluate.conftest import EOS_ID, LAYERS, fit_drafter, random_drafter
from tests.extract.conftest import run_extract_cfg

NEW_TOKENS = 24
SETTINGS = {"t0.7-top_p0.9": SamplingConfig(temperature=0.7, top_p=0.9, seed=11),
            "t1": SamplingConfig(temperature=1.0, seed=12)}
BUDGETS = (None, 8, 16)
"""Chains, then DDTrees of 8 and 16 nodes."""


CASES = [(t, s) for t in ("attention", "hybrid") for s in SETTINGS]


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}-{s}" for t, s in CASES])
def sampled(request, tmp_path_factory, eos_target_dir, hybrid_target_dir):
    """(target dir, sampled store, a drafter fitted on it, the settings) per target and
    setting: the drafter is fitted a few steps so that acceptance varies."""
    kind, name = request.param
    target = {"attention": eos_target_dir, "hybrid": hybrid_target_dir}[kind]
    tmp = tmp_path_factory.mktemp(f"sampled-{kind}-{name}")
    data = write_jsonl(tmp / "chats.jsonl", make_chats(8))
    store = str(tmp / "store.zarr")
    run_extract_cfg(target, data, store, regenerate=True, max_new_tokens=NEW_TOKENS,
                    layers=",".join(map(str, LAYERS)), sampling=SETTINGS[name])
    drafter = str(save_drafter(fit_drafter(random_drafter(seed=1), store, steps=25),
                               tmp / "drafter"))
    return target, store, drafter, SETTINGS[name]


def test_sampled_store_labels_are_the_stored_next_tokens(sampled):
    _, store, _, cfg = sampled
    meta = open_store(store).meta
    assert meta.sampling == {"temperature": cfg.temperature, "top_p": cfg.top_p,
                             "top_k": cfg.top_k, "seed": cfg.seed}
    differ = 0
    for s, stored in zip(read_samples(open_store(store)),
                         (x for p in open_store(store).parts() for x in p.iter_samples()),
                         strict=True):
        assert s.top1[:-1].tolist() == s.input_ids[1:].tolist()
        answer = s.loss_mask[1:]
        differ += int((stored.topk_ids[:-1, 0].long() != s.top1[:-1])[answer].sum())
    assert differ, "every draw was the argmax: the labels' source is untested"


def test_plain_sampling_equals_live_chain_and_tree_decoding_cached_and_not(sampled):
    target_dir, store_url, drafter_dir, cfg = sampled
    store = open_store(store_url)
    target = load_online_target(target_dir, store.meta, device="cpu")
    _, drafters = load_drafters(store, [drafter_dir], device=torch.device("cpu"),
                                dtype=torch.float32)
    drafter = next(iter(drafters.values()))
    stop = StopRule([EOS_ID], max_new_tokens=NEW_TOKENS,
                    max_length=store.meta.source.max_length)
    samples = [s for s in read_samples(store) if prompt_of(s) is not None][:4]
    prompts = [prompt_of(s) for s in samples]
    rows = [s.source_row for s in samples]
    plain = continuations(target.target.model, prompts, max_new_tokens=NEW_TOKENS,
                          eos_ids=[EOS_ID], pad_id=0, sampling=cfg, sample_ids=rows)
    greedy = continuations(target.target.model, prompts, max_new_tokens=NEW_TOKENS,
                           eos_ids=[EOS_ID], pad_id=0)
    assert plain != greedy, "the draws are the greedy text: sampling is untested"
    taus = []
    for s, prompt, answer in zip(samples, prompts, plain, strict=True):
        assert s.input_ids.tolist() == prompt + answer  # the store holds the plain draws
        choice = TargetChoice(cfg, s.source_row)
        for verifier in (CachedVerifier(target), RecomputeVerifier(target)):
            for budget in BUDGETS:
                run = speculative_decode(verifier, drafter, prompt, stop, 16, budget, choice)
                where = f"row {s.source_row}, {type(verifier).__name__}, budget {budget}"
                assert run.tokens == prompt + answer, where
                taus += [r.tau for r in run.rounds]
    assert max(taus) > 1, "no draft was ever accepted: matching is untested"


def test_offline_replay_equals_online_sample_and_match_round_by_round(sampled):
    target_dir, store, drafter_dir, cfg = sampled
    budgets = tuple(b for b in BUDGETS if b is not None)
    out = run_eval(EvalConfig(store=store, checkpoints=[drafter_dir], online=True,
                              model=target_dir, progress=False,
                              settings=EvalSettings(mode="replay", tree_budgets=budgets)),
                   echo=lambda _: None)
    name = "drafter"
    check = out.report["online_check"]
    assert check["same_text"] == check["prompts"] == open_store(store).num_samples
    assert out.offline[name].walks[None].rounds == out.online[name].walks[None].rounds
    assert _walk_rounds(out.offline[name]) == _walk_rounds(out.online[name])
    assert out.offline[name].summary().to_json() == out.online[name].summary().to_json()
    assert check["same_tree_taus"] == {name: {str(b): check["prompts"] for b in budgets}}
    taus = [t for seq in out.online[name].walks[None].rounds.values() for _, t in seq]
    assert len(set(taus)) >= 2, taus
    # the report names the sampling; answers unequal to the top-1 are no warning here
    report = out.report
    assert report["sampling"] == open_store(store).meta.sampling
    assert report["warning"] is None and report["agreement"] is None
    assert f"sampled at temperature {cfg.temperature}" in out.text
    assert f"with seed {cfg.seed}" in out.text and "WARNING" not in out.text


def _walk_rounds(results) -> dict:
    """Each walk's rounds per sample (None: the chain, else a DDTree budget)."""
    return {b: w.rounds for b, w in results.walks.items()}
