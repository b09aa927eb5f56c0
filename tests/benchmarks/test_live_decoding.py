"""benchmarks/live_decoding.py on the tiny Qwen3 target that ends its turns early: with its
end-of-turn check on, answers stop at EOS; with --ignore-eos, every loop decodes exactly the
asked length, the cached and no-cache loops agree, and the tokens are transformers' own
greedy continuation past EOS."""

import pytest

import benchmarks.live_decoding as bench
from dflash_train.evaluate.online import CachedVerifier, StopRule, speculative_decode
from dflash_train.target_model.generation import eos_token_ids
from dflash_train.target_model.loading import load_tokenizer
from tests.evaluate.conftest import (
    MAX_NEW_TOKENS,
    fitted_drafter_dir,
    regenerated_store,
    save_eos_target,
)

NEW_TOKENS = 3 * MAX_NEW_TOKENS
PROMPTS = 3


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    model = save_eos_target(tmp_path_factory.mktemp("live_target"))
    store = regenerated_store(tmp_path_factory, "live", model, 6, MAX_NEW_TOKENS)
    checkpoint = fitted_drafter_dir(tmp_path_factory, store, 30, "live_drafter")
    store, target, drafter = bench.load(model, store, checkpoint)
    eos = eos_token_ids(target.target.model, load_tokenizer(model))
    return target, drafter, bench.prompts_of(store, PROMPTS), eos


def test_with_its_end_of_turn_check_an_answer_stops_before_the_asked_length(loaded):
    target, drafter, prompts, eos = loaded
    stop = StopRule(eos, max_new_tokens=NEW_TOKENS, max_length=10**9)
    rows = bench.measure(target, drafter, prompts, stop, [4], no_cache_trees=False)
    assert rows["greedy"]["tokens"] < PROMPTS * NEW_TOKENS
    assert rows["cached chain"]["tokens"] == rows["greedy"]["tokens"]


def test_ignore_eos_decodes_every_loop_to_the_asked_length_as_generate_does(loaded):
    target, drafter, prompts, eos = loaded
    stop = StopRule([], max_new_tokens=NEW_TOKENS, max_length=10**9)
    rows = bench.measure(target, drafter, prompts, stop, [4], no_cache_trees=True)
    for name, row in rows.items():
        assert row["tokens"] == PROMPTS * NEW_TOKENS, name
    assert rows["cached chain"]["tau"] == rows["no-cache chain"]["tau"]
    verifier = CachedVerifier(target)
    for prompt in prompts:
        expected = bench.greedy(target, prompt, NEW_TOKENS, [])
        run = speculative_decode(verifier, drafter, prompt, stop, 8)
        assert run.tokens[len(prompt):] == expected
        assert any(t in eos for t in expected), "no end-of-turn token was passed"


def test_measure_stops_when_the_cached_loop_commits_other_tokens(loaded):
    target, drafter, prompts, _ = loaded
    stop = StopRule([], max_new_tokens=8, max_length=10**9)
    run = speculative_decode(CachedVerifier(target), drafter, prompts[0], stop, 8)
    other = speculative_decode(CachedVerifier(target), drafter, prompts[0], stop, 8)
    other.tokens[-1] += 1
    bench.check_same(run, run, 0)
    with pytest.raises(SystemExit, match="prompt 0"):
        bench.check_same(run, other, 0)
