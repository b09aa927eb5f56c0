"""Live greedy speculative decoding, and the proof that offline replay equals it."""

from types import SimpleNamespace

import pytest
import torch

from dflash_train.assets.tiny import VOCAB_SIZE
from dflash_train.drafter import ContextCache, load_drafter, save_drafter
from dflash_train.drafter.model import dflash2_from
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.drafting import Draft
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.online import (
    RecomputeVerifier,
    StopRule,
    evaluate_online,
    load_online_target,
    speculative_decode,
)
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.evaluate.replay import evaluate_replay
from dflash_train.evaluate.results import CheckpointResults
from dflash_train.evaluate.samples import EvalSample
from dflash_train.store_schema import open_store
from tests.evaluate.conftest import EOS_ID, MAX_NEW_TOKENS, fit_drafter, mapped_drafter

# -- the must-show: offline --mode replay tau == --online tau, prompt by prompt -------------


def test_offline_replay_equals_live_speculative_decoding_prompt_by_prompt(
        regen_store, eos_target_dir, trained_drafter_dir, random_drafter_dir):
    stored = [s for p in open_store(regen_store).parts() for s in p.iter_samples()]
    responses = [s.input_ids[s.loss_mask].tolist() for s in stored]
    # The store exercises both ends of a generation: EOS, and max_new_tokens without EOS.
    assert any(r[-1] == EOS_ID for r in responses)
    assert any(len(r) == MAX_NEW_TOKENS and EOS_ID not in r for r in responses)

    cfg = EvalConfig(store=regen_store, checkpoints=[trained_drafter_dir, random_drafter_dir],
                     settings=EvalSettings(mode="replay", tree_budgets=(4, 16),
                                           position_bin=8),
                     online=True, model=eos_target_dir, progress=False)
    out = run_eval(cfg)

    # The live loop regenerated exactly the stored text (the store IS the greedy output) ...
    by_key = {(p.index, i): s for p in open_store(regen_store).parts()
              for i, s in enumerate(p.iter_samples())}
    assert sorted(out.generated) == sorted(by_key)
    for key, tokens in out.generated.items():
        assert tokens == by_key[key].input_ids.tolist(), key
    # ... and every prompt visited the same anchors with the same tau, for both drafters.
    for name in ("trained", "rand"):
        assert out.offline[name].walks[None].rounds == out.online[name].walks[None].rounds, name
        # each DDTree budget walked offline as it is decoded live: a + the tree's own tau
        assert _walk_rounds(out.offline[name]) == _walk_rounds(out.online[name]), name
        # the whole summary, tau by anchor position (chain and each budget) included
        assert out.offline[name].summary().to_json() == out.online[name].summary().to_json(), name
    by_position = out.online["trained"].summary().to_json()["tau_by_position"]["bins"]
    assert len(by_position) >= 3 and len({b["mean_tau"] for b in by_position}) >= 2
    trees = _walk_rounds(out.online["trained"])
    assert trees[16] != out.online["trained"].walks[None].rounds, "the trees moved on as chains did"
    assert sum(map(len, trees[16].values())) < sum(map(len, trees[4].values()))
    # The trained drafter makes this a real test: streaks of many lengths, full blocks too.
    taus = [t for seq in out.online["trained"].walks[None].rounds.values() for _, t in seq]
    assert len(set(taus)) >= 4 and max(taus) == 8
    check = out.report["online_check"]
    assert check["same_text"] == check["prompts"] == len(stored)
    assert check["same_taus"] == {"trained": len(stored), "rand": len(stored)}
    assert check["same_tree_taus"] == {n: {"4": len(stored), "16": len(stored)}
                                       for n in ("trained", "rand")}


def test_a_draft_vocabulary_drafter_replays_offline_what_it_drafts_live(
        tmp_path, regen_store, eos_target_dir):
    # half the vocabulary: some labels are off the map, misses it cannot avoid
    model = fit_drafter(mapped_drafter(regen_store, VOCAB_SIZE // 2, seed=1), regen_store, 60)
    mapped = str(save_drafter(model, tmp_path / "mapped"))
    out = run_eval(EvalConfig(store=regen_store, checkpoints=[mapped], online=True,
                              model=eos_target_dir, progress=False,
                              settings=EvalSettings(mode="replay", tree_budgets=(4,))))
    assert out.offline["mapped"].walks[None].rounds == out.online["mapped"].walks[None].rounds
    assert out.offline["mapped"].summary().to_json() == out.online["mapped"].summary().to_json()
    taus = [t for seq in out.online["mapped"].walks[None].rounds.values() for _, t in seq]
    assert len(set(taus)) >= 3, "acceptance too uniform to test"


def test_offline_replay_equals_live_decoding_on_a_hybrid_linear_attention_target(
        hybrid_store, hybrid_target_dir, hybrid_drafter_dir):
    # Qwen3.5's recurrent state cannot be cropped after a rejected draft; the cached loop
    # snapshots it and replays the committed tokens, so its rounds must match replay exactly.
    cfg = EvalConfig(store=hybrid_store, checkpoints=[hybrid_drafter_dir],
                     settings=EvalSettings(mode="replay", tree_budgets=(8,)),
                     online=True, model=hybrid_target_dir, progress=False)
    out = run_eval(cfg)
    check = out.report["online_check"]
    assert check["same_text"] == check["prompts"] == open_store(hybrid_store).num_samples
    name = "hybrid_drafter"
    assert out.offline[name].walks[None].rounds == out.online[name].walks[None].rounds
    # the tree verified live on the hybrid (Gated DeltaNet stepped node by node) is the one
    # replay walks
    assert _walk_rounds(out.offline[name]) == _walk_rounds(out.online[name])
    assert check["same_tree_taus"] == {name: {"8": check["prompts"]}}
    taus = [t for seq in out.online[name].walks[None].rounds.values() for _, t in seq]
    assert len(set(taus)) >= 4


# -- the loop itself, against a scripted target and drafter --------------------------------


class ScriptedTarget:
    """Greedy target that continues `script` (and says FILLER off it or past its end).
    Features at position t are all t, so the drafter can check which positions it gets."""

    FILLER = 9

    def __init__(self, script: list[int]):
        self.script = script

    def __call__(self, tokens: list[int]):
        argmax = []
        for t in range(len(tokens)):
            on_script = t + 1 < len(self.script) and tokens[: t + 1] == self.script[: t + 1]
            argmax.append(self.script[t + 1] if on_script else self.FILLER)
        features = torch.arange(len(tokens), dtype=torch.float).view(1, -1, 1, 1)
        return features, torch.tensor(argmax)


class ScriptedDrafter:
    """Drafts the script, wrong at `wrong` positions; FILLER past its end. Asserts that each
    block at anchor a sees exactly the context positions 0 .. a-1."""

    def __init__(self, script: list[int], wrong: set[int], block_size: int):
        self.script, self.wrong, self.block_size = script, wrong, block_size
        self.config = SimpleNamespace(vocab_size=VOCAB_SIZE)
        self.anchors: list[int] = []
        self.walks = False  # drafts by argmax: DDTree applies

    def _check(self, cache, features):
        start = cache.length
        assert features[0, :, 0, 0].tolist() == list(range(start, start + features.shape[1]))

    def context_cache(self, features):
        cache = ContextCache(keys=[torch.zeros(1)], values=[torch.zeros(1)], length=0)
        self._check(cache, features)
        cache.length = features.shape[1]
        return cache

    def extend(self, cache, features):
        self._check(cache, features)
        cache.length += features.shape[1]

    def draft(self, cache, anchors, anchor_tokens, top_k, transitions=False):
        a = int(anchors[0, 0])
        assert cache.length == a, "the block must see context < a and never a itself"
        assert int(anchor_tokens[0, 0]) == self.script[a]
        self.anchors.append(a)
        ids = self.block(a, top_k)[None, None]
        return Draft(torch.zeros(ids.shape), ids)

    def block(self, a: int, top_k: int) -> torch.Tensor:
        """Draft ids [B, top_k] of the block at a (rank 0 only; slot 0 is -1)."""
        ids = torch.full((self.block_size, top_k), -1)
        for k in range(1, self.block_size):
            p = a + k
            token = self.script[p] if p < len(self.script) else ScriptedTarget.FILLER
            ids[k, 0] = (token + 1) % VOCAB_SIZE if p in self.wrong else token
        return ids


class ScriptedReplayDrafter(ScriptedDrafter):
    """The same drafts through offline replay's interface: blocks at any anchors of a
    whole stored context."""

    def context_cache(self, features):
        return ContextCache(keys=[torch.zeros(1)], values=[torch.zeros(1)],
                            length=features.shape[1])

    def draft(self, cache, anchors, anchor_tokens, top_k, transitions=False):
        ids = torch.stack([torch.stack([self.block(int(a), top_k) for a in row])
                           for row in anchors])
        return Draft(torch.zeros(ids.shape), ids)


PROMPT = [10, 11, 12]


def _decode(continuation, wrong, block_size, stop):
    script = PROMPT + continuation
    drafter = ScriptedDrafter(script, wrong, block_size)
    run = speculative_decode(RecomputeVerifier(ScriptedTarget(script)), drafter, PROMPT, stop,
                             top_k=1)
    return run, drafter


def test_round_commits_the_matching_prefix_plus_the_bonus():
    # positions 3..9 = 20 21 22 23 24 25 EOS; B = 4.
    # a=3: drafts 4, 5 ok, 6 wrong -> commit 21 22 + bonus 23, tau 3.
    # a=6: drafts 24 25 EOS all ok -> the EOS is a committed draft: stop; the round
    # committed those 3 tokens and no bonus, tau 3.
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=100)
    run, drafter = _decode([20, 21, 22, 23, 24, 25, EOS_ID], {6}, 4, stop)
    assert run.tokens == PROMPT + [20, 21, 22, 23, 24, 25, EOS_ID]
    assert [(r.anchor, r.tau) for r in run.rounds] == [(3, 3), (6, 3)]
    assert drafter.anchors == [3, 6]


def test_eos_as_the_bonus_token_ends_the_generation():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=100)
    run, _ = _decode([20, 21, 22, 23, 24, 25, EOS_ID], {6, 9}, 4, stop)
    assert run.tokens == PROMPT + [20, 21, 22, 23, 24, 25, EOS_ID]
    assert [(r.anchor, r.tau) for r in run.rounds] == [(3, 3), (6, 3)]


def test_drafts_past_max_new_tokens_do_not_count():
    # B = 8: at a=3 all 7 drafts match the target, but only 5 new tokens are allowed
    # (positions 3..7): 4 drafts are committed and no bonus, so tau = 4.
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=5, max_length=100)
    run, _ = _decode(list(range(20, 40)), set(), 8, stop)
    assert run.tokens == PROMPT + [20, 21, 22, 23, 24]
    assert [(r.anchor, r.tau) for r in run.rounds] == [(3, 4)]


def test_max_length_ends_the_generation_like_extract_truncates():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=6)
    run, _ = _decode(list(range(20, 40)), {5}, 4, stop)
    # a=3: 4 ok, 5 wrong -> 21 + bonus 22 (length 6: stop), tau 2.
    assert run.tokens == PROMPT + [20, 21, 22]
    assert [(r.anchor, r.tau) for r in run.rounds] == [(3, 2)]


def _online_and_replay(continuation, wrong, block_size, stop):
    """The live run, and offline replay of its text stored as `extract --regenerate`
    stores it (verifier argmax = the target's over the stored text)."""
    run, _ = _decode(continuation, wrong, block_size, stop)
    script = PROMPT + continuation
    ids = torch.tensor(run.tokens)
    stored = EvalSample(0, 0, 0, ids, torch.arange(len(ids)) >= len(PROMPT),
                        torch.zeros(len(ids), 1, 1), ScriptedTarget(script)(run.tokens)[1])
    results = CheckpointResults("s", block_size, EvalSettings(tree_budgets=(),
                                                              recall_at=(1,)))
    evaluate_replay(ScriptedReplayDrafter(script, wrong, block_size), [stored], results, 1)
    return run, results.walks[None].rounds[(0, 0)]


def test_a_token_cap_inside_the_accepted_drafts_counts_the_tokens_produced_online_and_offline():
    # B = 8, 7 new tokens allowed: positions 3..9, the one at 3 from the prefill.
    # a=3: drafts 4, 5 ok, 6 wrong -> 21 22 + the bonus 23: tau 3.
    # a=6: all 7 drafts (positions 7..13) match, but the cap stops after 7, 8, 9: three
    # tokens and no bonus: tau 3 (counting a bonus would say 4).
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=7, max_length=100)
    run, replayed = _online_and_replay(list(range(20, 40)), {6}, 8, stop)
    assert run.tokens == PROMPT + list(range(20, 27))
    assert [(r.anchor, r.tau) for r in run.rounds] == [(3, 3), (6, 3)]
    assert replayed == [(3, 3), (6, 3)]
    # Each generated token but the prefill's is committed by exactly one round.
    assert sum(r.tau for r in run.rounds) == len(run.tokens) - len(PROMPT) - 1


def test_an_eos_inside_the_accepted_drafts_counts_the_tokens_produced_online_and_offline():
    # positions 3..9 = 20 21 22 23 24 25 EOS, and the target goes on 27 28 ... after it.
    # a=3: draft 4 ok, 5 wrong -> 21 + the bonus 22: tau 2.
    # a=5: all 7 drafts (23 24 25 EOS 27 28 29) match; generation stops at the EOS: four
    # tokens, no bonus: tau 4 (counting a bonus would say 5).
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=100)
    continuation = [20, 21, 22, 23, 24, 25, EOS_ID, 27, 28, 29, 30, 31]
    run, replayed = _online_and_replay(continuation, {5}, 8, stop)
    assert run.tokens == PROMPT + continuation[:7]
    assert [(r.anchor, r.tau) for r in run.rounds] == [(3, 2), (5, 4)]
    assert replayed == [(3, 2), (5, 4)]
    assert sum(r.tau for r in run.rounds) == len(run.tokens) - len(PROMPT) - 1


def test_first_token_eos_drafts_nothing():
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=100)
    run, drafter = _decode([EOS_ID], set(), 4, stop)
    assert run.tokens == PROMPT + [EOS_ID] and run.rounds == [] and drafter.anchors == []


def test_online_metrics_use_the_generated_text_as_labels():
    script = PROMPT + [20, 21, 22, 23, 24, 25, EOS_ID]
    sample = EvalSample(0, 0, 0, torch.tensor(script), torch.arange(len(script)) >= 3,
                        torch.empty(0), torch.tensor(script[1:] + [0]))
    settings = EvalSettings(tree_budgets=(), recall_at=(1,))
    stop = StopRule(eos_ids=[EOS_ID], max_new_tokens=100, max_length=100)
    results, generated = evaluate_online(
        ScriptedTarget(script), {"s": ScriptedDrafter(script, {6}, 4)}, [sample], settings,
        stop, cached=False)
    assert generated == {(0, 0): script}
    assert results["s"].walks[None].rounds == {(0, 0): [(3, 3), (6, 3)]}
    assert results["s"].summary().to_json()["slot_accuracy"] == pytest.approx([1.0, 1.0, 0.5])


def test_online_refuses_a_model_that_is_not_the_store_target(tmp_path, regen_store,
                                                            eos_target_dir):
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    config = AutoConfig.from_pretrained(eos_target_dir).to_dict()
    config.update(num_hidden_layers=3, layer_types=config["layer_types"][:3])
    config = AutoConfig.for_model(**config)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(eos_target_dir).save_pretrained(tmp_path)
    with pytest.raises(EvalError, match=r"num_hidden_layers: --model 3, store 4"):
        load_online_target(str(tmp_path), open_store(regen_store).meta, device="cpu")


# -- DFlash 2: replay and --online follow the selector walk ---------------------------------


def _selector_drafters(trained_drafter_dir: str, regen_store: str, tmp_path) -> list[str]:
    """The trained DFlash drafter warm-started as DFlash 2 (free and factorised codebooks),
    its selector set to rescore strongly enough to override some argmax picks: their unary
    logits ARE the DFlash drafter's, only the walk differs."""
    base = load_drafter(trained_drafter_dir)
    rows = open_store(regen_store).target_rows()
    base.attach_target_head(rows["embed_tokens"].float(), rows["lm_head"].float())
    dirs = []
    for codebooks, scale in (("free", 1.0), ("factorised", 0.25)):
        d2 = dflash2_from(base, selector_rank=8, selector_top_k=4, selector_codebooks=codebooks)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in d2.candidate_selector.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "hidden" in name else
                                                               scale))
        dirs.append(str(save_drafter(d2, tmp_path / f"d2_{codebooks}")))
    return dirs


def test_dflash2_replay_equals_live_decoding_chain_and_tree_and_follows_the_walk(
        regen_store, eos_target_dir, trained_drafter_dir, tmp_path):
    free, factorised = _selector_drafters(trained_drafter_dir, regen_store, tmp_path)
    cfg = EvalConfig(store=regen_store, checkpoints=[trained_drafter_dir, free, factorised],
                     settings=EvalSettings(mode="replay", tree_budgets=(4,)),
                     online=True, model=eos_target_dir, progress=False)
    out = run_eval(cfg)
    unary = out.offline["trained"].walks[None].rounds  # the same unary logits, drafted by argmax
    for name in ("d2_free", "d2_factorised"):
        assert out.offline[name].walks[None].rounds == out.online[name].walks[None].rounds, name
        assert out.offline[name].summary().to_json() == out.online[name].summary().to_json(), name
        # the selector changed drafts, so counting the unary argmax would measure another
        # drafter (TorchSpec #177)
        assert out.offline[name].walks[None].rounds != unary, name
        taus = [t for seq in out.online[name].walks[None].rounds.values() for _, t in seq]
        assert len(set(taus)) >= 3, (name, taus)
        # the selector-aware DDTree is decoded live round by round as replay walks it
        assert _walk_rounds(out.offline[name]) == _walk_rounds(out.online[name]), name
        tree_taus = [t for seq in out.online[name].walks[4].rounds.values() for _, t in seq]
        assert len(set(tree_taus)) >= 3, (name, tree_taus)
    check = out.report["online_check"]
    assert check["same_taus"] == {"trained": 12, "d2_free": 12, "d2_factorised": 12}
    assert check["same_tree_taus"] == {n: {"4": 12} for n in ("trained", "d2_free",
                                                                "d2_factorised")}


def _walk_rounds(results) -> dict:
    """Each walk's rounds per sample (None: the chain, else a DDTree budget)."""
    return {b: w.rounds for b, w in results.walks.items()}
