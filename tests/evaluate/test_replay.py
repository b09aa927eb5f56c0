"""Offline replay: the drafting path, anchor order, and metrics against hand-computed blocks."""

import math
from types import SimpleNamespace

import pytest
import torch

from dflash_train.drafter import ContextCache, build_block_ids, save_drafter
from dflash_train.evaluate.checkpoints import layer_selection
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.drafting import BlockDrafter, Draft, walk_first
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.evaluate.replay import evaluate_all, evaluate_offline, evaluate_replay
from dflash_train.evaluate.report import estimate_warning
from dflash_train.evaluate.results import Agreement, CheckpointResults
from dflash_train.evaluate.samples import EvalSample, pick_samples, read_samples
from dflash_train.store_schema import open_store
from dflash_train.train.config import ModelConfig
from dflash_train.train.drafter_shape import initial_drafter
from dflash_train.train.errors import TrainError
from tests.evaluate.conftest import (
    VOCAB_SIZE,
    random_drafter,
    synthetic_meta,
    synthetic_sample,
    write_synthetic_store,
)

# -- the drafting path --------------------------------------------------------------------


def _with_head(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    model.attach_target_head(torch.randn(VOCAB_SIZE, 64, generator=gen),
                             torch.randn(VOCAB_SIZE, 64, generator=gen))
    return model


def test_block_drafter_matches_the_drafter_forward_at_any_anchors():
    # A causal sliding layer and a bidirectional full layer: both mask rules are exercised.
    model = _with_head(random_drafter(seed=3, block_size=4, sliding_window=5,
                                      layer_types=["sliding_attention", "full_attention"]))
    gen = torch.Generator().manual_seed(1)
    context = torch.randn(2, 20, 3, 64, generator=gen)
    anchors = torch.tensor([[1, 7, 19], [3, 9, 14]])
    tokens = torch.randint(0, VOCAB_SIZE, (2, 3), generator=gen)
    ids = build_block_ids(tokens, model.config.mask_token_id, 4)
    want = model(context, torch.tensor([20, 15]), ids, anchors, attention="dense")
    drafter = BlockDrafter(model)
    got = drafter.hidden(drafter.context_cache(context), anchors, tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_block_drafter_matches_the_live_draft_block_over_an_incremental_cache():
    model = _with_head(random_drafter(seed=4, block_size=4))
    gen = torch.Generator().manual_seed(2)
    context = torch.randn(1, 12, 3, 64, generator=gen)
    token = torch.tensor([[17]])
    live = ContextCache()
    model.extend_context(live, context[:, :5])
    model.extend_context(live, context[:, 5:])
    want = model.draft_block(live, build_block_ids(token[0], model.config.mask_token_id, 4))
    drafter = BlockDrafter(model)
    got = drafter.hidden(drafter.context_cache(context), torch.tensor([[12]]), token)
    torch.testing.assert_close(got[:, 0], want, atol=1e-5, rtol=1e-5)


def test_drafter_reading_fewer_layers_takes_them_from_the_store_by_id():
    meta = synthetic_meta(regenerated=True, layers=[0, 1, 3])
    model = _with_head(random_drafter(seed=5, target_layer_ids=[3, 1]))
    index = layer_selection(model.config, meta)
    assert index == [2, 1]
    context = torch.randn(1, 10, 3, 64, generator=torch.Generator().manual_seed(3))
    anchors, tokens = torch.tensor([[4, 8]]), torch.tensor([[5, 6]])
    via_store = BlockDrafter(model, index)
    direct = BlockDrafter(model)
    got = via_store.hidden(via_store.context_cache(context), anchors, tokens)
    want = direct.hidden(direct.context_cache(context[:, :, [2, 1]]), anchors, tokens)
    assert torch.equal(got, want)


# -- a drafter whose drafts are crafted: every number below is computed by hand ------------

LOGP = [-0.1, -2.0] + [-3.0 - r for r in range(400)]
"""Log-prob of rank r in every slot of the crafted drafter."""


class CraftedDrafter:
    """Drafts the true next token at rank 0, except at the `wrong[sample]` positions, where
    rank 0 is wrong and the truth is rank 1. Contexts carry the sample id, so it knows which
    sample each batch row is."""

    def __init__(self, samples: dict[int, EvalSample], wrong: dict[int, set[int]],
                 block_size: int):
        self.samples, self.wrong, self.block_size = samples, wrong, block_size
        self.config = SimpleNamespace(vocab_size=VOCAB_SIZE)
        self.walks = False  # drafts by argmax: DDTree applies

    def context_cache(self, features):
        ids = features[:, 0, 0, 0].reshape(-1, 1, 1, 1)
        return ContextCache(keys=[ids], values=[ids], length=features.shape[1])

    def draft(self, cache, anchors, anchor_tokens, top_k, transitions=False):
        n, k = anchors.shape
        ids = torch.full((n, k, self.block_size, top_k), -1)
        logp = torch.zeros(n, k, self.block_size, top_k)
        for r in range(n):
            sid = int(cache.keys[0][r, 0, 0, 0])
            s = self.samples[sid]
            assert int(s.input_ids[anchors[r, 0]]) == int(anchor_tokens[r, 0])
            for j in range(k):
                for slot in range(1, self.block_size):
                    p = int(anchors[r, j]) + slot
                    truth = int(s.input_ids[p]) if p < len(s.input_ids) else 0
                    ranks = [(truth + 1 + i) % VOCAB_SIZE for i in range(top_k)]
                    ranks.insert(1 if p in self.wrong[sid] else 0, truth)
                    ids[r, j, slot] = torch.tensor(ranks[:top_k])
                    logp[r, j, slot] = torch.tensor(LOGP[:top_k])
        return Draft(logp, ids)


def _sample(sid: int, prompt: int, length: int) -> EvalSample:
    """A regenerated-like sample: the verifier's argmax at t is the stored token t+1."""
    ids = torch.tensor([(7 * t + 3 * sid + 11) % VOCAB_SIZE for t in range(length)])
    mask = torch.arange(length) >= prompt
    top1 = torch.cat([ids[1:], ids[-1:]])
    context = torch.full((length, 1, 1), float(sid))
    return EvalSample(0, sid, 100 + sid, ids, mask, context, top1)


SETTINGS = EvalSettings(tree_budgets=(1, 2, 64), recall_at=(1, 2))


def _crafted(wrong: dict[int, set[int]], *samples: EvalSample, block_size: int = 4,
             settings: EvalSettings = SETTINGS):
    drafter = CraftedDrafter({s.index: s for s in samples}, wrong, block_size)
    return drafter, CheckpointResults("crafted", block_size, settings)


def test_replay_visits_first_response_token_then_jumps_by_tau():
    # Prompt 0..2, response 3..11, B = 4 (slots 1..3); drafts wrong at positions 5 and 9.
    # a=3: 4 ok, 5 wrong -> streak 1, tau 2.  a=5: 6, 7, 8 ok -> tau 4.
    # a=9: 10, 11 ok and the text ends there (12 is past it): generation is over, no bonus
    # follows, tau 2 (= the streak); next anchor 11 has nothing left to predict.
    s = _sample(0, prompt=3, length=12)
    drafter, results = _crafted({0: {5, 9}}, s)
    evaluate_replay(drafter, [s], results, SETTINGS.top_k(VOCAB_SIZE))
    assert results.walks[None].rounds[(0, 0)] == [(3, 2), (5, 4), (9, 2)]
    summary = results.summary().to_json()
    assert summary["n_blocks"] == 3
    assert summary["mean_tau"] == pytest.approx(8 / 3)  # 2 + 4 + 2: the 9 response tokens
    assert summary["mean_streak"] == pytest.approx(2.0)  # accepted drafts 1, 3, 2
    assert summary["streak_hist"] == [0, 1, 1, 1]
    # slot 1: reached 3, accepted 3. slot 2: reached 3, accepted 2 (a=3 fails at 5).
    # slot 3: reached only at a=5 (a=3 stopped, a=9 has no label there), accepted.
    assert summary["cond_accept"] == pytest.approx([1.0, 2 / 3, 1.0])
    # marginal: slot 2 labels at 5, 7, 11 (5 wrong); slot 3 labels at 6, 8 only.
    assert summary["slot_accuracy"] == pytest.approx([1.0, 2 / 3, 1.0])
    assert summary["slot_valid"] == [3, 3, 2]
    assert summary["topk_recall"]["2"] == pytest.approx([1.0, 1.0, 1.0])


def test_each_budget_walks_its_own_tree_as_a_tree_decoder_moves_on():
    s = _sample(0, prompt=3, length=12)
    drafter, results = _crafted({0: {5, 9}}, s)
    evaluate_replay(drafter, [s], results, SETTINGS.top_k(VOCAB_SIZE))
    # Response 3..11, B = 4, wrong rank 0 at positions 5 and 9 (the truth is rank 1 there).
    # budget 1: the one node is slot 1's rank 0 (positions 4, 6, 8, 10: all right): tau 2
    # every round, next anchor a + 2; at a=9 only 10, 11 are left: tau 2.
    assert results.walks[1].rounds == {(0, 0): [(3, 2), (5, 2), (7, 2), (9, 2)]}
    # budget 2: the rank-0 chain of slots 1, 2. a=3: 4 ok, 5 wrong -> 2. a=5: 6, 7 -> 3.
    # a=8: 9 wrong -> 1. a=9: 10, 11 and the text ends: 2 (no bonus).
    assert results.walks[2].rounds == {(0, 0): [(3, 2), (5, 3), (8, 1), (9, 2)]}
    # budget 64: every path with one rank 1 is in (score -2.2 and up). a=3: 4, 5 (rank 1),
    # 6 -> tau 4. a=7: 8, 9 (rank 1), 10 -> depth 3, 4 tokens left (8..11): tau 4.
    assert results.walks[64].rounds == {(0, 0): [(3, 4), (7, 4)]}
    assert results.summary().to_json()["tree"]["2"]["mean_tau"] == pytest.approx(8 / 4)
    assert results.summary().to_json()["tree"]["2"]["rounds"] == 4
    assert results.summary().to_json()["tree"]["64"]["rounds"] == 2
    # the chain walked its own anchors, untouched by the trees
    assert results.walks[None].rounds == {(0, 0): [(3, 2), (5, 4), (9, 2)]}


def test_mode_all_scores_every_eligible_anchor():
    s = _sample(0, prompt=3, length=12)
    drafter, results = _crafted({0: {5, 9}}, s)
    evaluate_all(drafter, [s], results, SETTINGS, SETTINGS.top_k(VOCAB_SIZE))
    # Anchors 3..10 (a+1 must be a response token). Streak = leading slots whose position
    # is < 12 and not 5 or 9; tau = streak + 1, but a streak that runs to the end of the
    # text (a=9: 10, 11; a=10: 11) has no bonus after it.
    chain = results.table()  # the chain's rows come first
    n = chain["tree_budget"].count(None)
    assert chain["anchor"][:n] == list(range(3, 11))
    assert chain["tau"][:n] == [2, 1, 4, 3, 2, 1, 2, 1]
    # every budget's tree at every one of those anchors too (no walk in --mode all)
    for b in SETTINGS.tree_budgets:
        assert [a for a, tb in zip(chain["anchor"], chain["tree_budget"], strict=True)
                if tb == b] == list(range(3, 11))


def test_replay_steps_many_sequences_together_without_mixing_them():
    samples = [_sample(0, 3, 12), _sample(1, 5, 30), _sample(2, 2, 9), _sample(3, 4, 5)]
    wrong = {0: {5, 9}, 1: {8, 9, 15, 22}, 2: {3}, 3: set()}
    expected = {}
    for s in samples:  # each alone
        drafter, results = _crafted(wrong, s)
        evaluate_replay(drafter, [s], results, SETTINGS.top_k(VOCAB_SIZE))
        expected.update(results.walks[None].rounds)
    drafter, results = _crafted(wrong, *samples)
    evaluate_replay(drafter, samples, results, SETTINGS.top_k(VOCAB_SIZE))
    assert results.walks[None].rounds == expected
    # sample 3: prompt 0..3, response 4 only -> no anchor with a label: no block at all.
    assert (0, 3) not in results.walks[None].rounds


def _bins(by_position: dict) -> list[tuple[int, int, float]]:
    return [(b["start"], b["n_blocks"], b["mean_tau"]) for b in by_position["bins"]]


def test_tau_by_anchor_position_bins_the_replay_rounds():
    samples = [_sample(0, 3, 12), _sample(1, 5, 30), _sample(2, 2, 9)]
    wrong = {0: {5, 9}, 1: {8, 9, 15, 22}, 2: {3}}
    settings = EvalSettings(tree_budgets=(2,), recall_at=(1, 2), position_bin=8)
    drafter, results = _crafted(wrong, *samples, settings=settings)
    evaluate_replay(drafter, samples, results, settings.top_k(VOCAB_SIZE))
    # B = 4. Sample 1 (prompt 0..4, text to 29, wrong at 8, 9, 15, 22): a=5: 6, 7 ok, 8
    # wrong -> 3. a=8: 9 wrong -> 1. a=9: 10..12 -> 4. a=13: 14, 15 wrong -> 2. a=15: 4.
    # a=19: 20, 21, 22 wrong -> 3. a=22: 4. a=26: 27..29 and the text ends: 3 (no bonus).
    # Sample 2 (prompt 0..1, text to 8, wrong at 3): a=2: 1. a=3: 4. a=7: 8, then the end: 1.
    assert results.walks[None].rounds == {
        (0, 0): [(3, 2), (5, 4), (9, 2)],
        (0, 1): [(5, 3), (8, 1), (9, 4), (13, 2), (15, 4), (19, 3), (22, 4), (26, 3)],
        (0, 2): [(2, 1), (3, 4), (7, 1)]}
    summary = results.summary().to_json()
    # bins of 8 by anchor, prompt included: 0..7 {2, 4, 3, 1, 4, 1}, 8..15 {2, 1, 4, 2, 4},
    # 16..23 {3, 4}, 24..31 {3}
    assert _bins(summary["tau_by_position"]) == [(0, 6, 2.5), (8, 5, 2.6), (16, 2, 3.5),
                                                 (24, 1, 3.0)]
    assert summary["tau_by_position"]["bin_tokens"] == 8
    ci = [b["tau_ci95"] for b in summary["tau_by_position"]["bins"]]
    half = 1.959963984540054 * math.sqrt(9.5 / 5 / 6)  # squared deviations 9.5, n - 1 = 5
    assert ci[0] == pytest.approx([2.5 - half, 2.5 + half])
    half = 1.959963984540054 * math.sqrt(0.5 / 2)  # {3, 4}: squared deviations 0.5
    assert ci[2] == pytest.approx([3.5 - half, 3.5 + half])
    assert ci[3] is None
    # budget 2 walks its own anchors (sample 0: (3, 2), (5, 3), (8, 1), (9, 2), see
    # test_each_budget_walks_its_own_tree...), binned the same way
    tree = results.walks[2].rounds
    assert tree[(0, 0)] == [(3, 2), (5, 3), (8, 1), (9, 2)]
    rounds = [r for seq in tree.values() for r in seq]
    want = {}
    for anchor, tau in rounds:
        want.setdefault(anchor // 8 * 8, []).append(tau)
    assert _bins(summary["tree"]["2"]["tau_by_position"]) == [
        (start, len(t), pytest.approx(sum(t) / len(t))) for start, t in sorted(want.items())]


def test_blocks_per_forward_and_batch_size_change_nothing():
    samples = [_sample(0, 3, 12), _sample(1, 5, 30), _sample(2, 2, 9)]
    wrong = {0: {5, 9}, 1: {8, 9, 15, 22}, 2: {3}}
    for mode, bins in (("all", 8), ("replay", 7)):  # all: anchors 2..28; replay: 2..26
        runs = []
        for batch_tokens, per_forward in ((10_000, 64), (1, 1), (40, 3)):
            drafter, _ = _crafted(wrong, *samples)
            settings = EvalSettings(mode=mode, tree_budgets=(1, 2, 64), recall_at=(1, 2),
                                    batch_tokens=batch_tokens, blocks_per_forward=per_forward,
                                    position_bin=4)
            results, _ = evaluate_offline({"crafted": drafter}, samples, settings)
            runs.append((results["crafted"].table(), results["crafted"].summary().to_json()))
        assert runs[0] == runs[1] == runs[2]
        assert len(runs[0][1]["tau_by_position"]["bins"]) == bins  # bins of 4 tokens


# -- real drafter on a store: batching invariance, sample choice, agreement ----------------


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    samples = []
    for row in range(7):
        length = 10 + 5 * row
        ids = torch.randint(0, VOCAB_SIZE, (length,), generator=gen).tolist()
        prompt = 3 + row % 3
        top1 = ids[1:] + [0]
        top1[prompt + 2] = (top1[prompt + 2] + 1) % VOCAB_SIZE  # one disagreement each
        samples.append(synthetic_sample(ids, [t >= prompt for t in range(length)], top1, row,
                                        gen))
    return write_synthetic_store(str(tmp_path_factory.mktemp("s") / "s.zarr"), samples,
                                 regenerated=False)


def test_a_real_drafter_gives_the_same_blocks_whatever_the_batching(small_store):
    store = open_store(small_store)
    model = _with_head(random_drafter(seed=6))
    drafter = {"d": BlockDrafter(model)}
    rows = []
    for mode in ("all", "replay"):
        per_mode = []
        for batch_tokens, per_forward in ((100_000, 64), (1, 2)):
            settings = EvalSettings(mode=mode, batch_tokens=batch_tokens,
                                    blocks_per_forward=per_forward, position_bin=8)
            results, _ = evaluate_offline(drafter, read_samples(store), settings)
            per_mode.append((results["d"].table(), results["d"].summary().to_json()))
        assert per_mode[0] == per_mode[1]
        rows.append(per_mode[0])
    assert len(rows[0][0]["tau"]) > len(rows[1][0]["tau"]) > 0  # all scores more anchors
    assert len(rows[0][1]["tau_by_position"]["bins"]) > 2


def test_limit_draws_reproducible_samples_by_seed(small_store):
    store = open_store(small_store)
    a, b, c = (pick_samples(store, 3, seed) for seed in (0, 0, 1))
    assert a == b and a != c
    assert len(a) == 3 and a == sorted(a) and len(set(a)) == 3
    assert pick_samples(store, 100, 0) is None  # more than there are: every sample
    assert [s.key for s in read_samples(store, a)] == a


def test_agreement_rate_counts_stored_tokens_that_are_the_verifier_argmax(small_store):
    store = open_store(small_store)
    agreement = Agreement()
    samples = list(read_samples(store))
    for s in samples:
        agreement.add(s)
    # Every response token but the first is predicted at a response position or the last
    # prompt one: L - prompt of them per sample, one of which was made to disagree.
    total = sum(int(s.loss_mask.sum()) for s in samples)
    assert (agreement.matches, agreement.total) == (total - len(samples), total)
    warning = estimate_warning(store.meta, agreement)
    assert "estimate" in warning and f"{100 * agreement.rate:.2f}%" in warning


def test_no_warning_for_a_regenerated_store_that_agrees_fully():
    meta = synthetic_meta(regenerated=True)
    assert estimate_warning(meta, Agreement(10, 10)) is None
    assert "estimate" in estimate_warning(meta, Agreement(9, 10))


def test_a_dflash2_drafter_warm_started_from_dflash_replays_its_tau_exactly(
        regen_store, trained_drafter_dir, tmp_path):
    # `--set model.init_from=DFLASH --set model.kind=dflash2` at step 0: identity convs and a
    # zero successor codebook, so the walk is the DFlash drafter's argmax, block for block.
    warm = initial_drafter(ModelConfig(kind="dflash2", init_from=trained_drafter_dir,
                                       selector_rank=8, selector_top_k=4, conv_kernel_size=3))
    assert warm.config.kind == "dflash2"
    warm_dir = str(save_drafter(warm, tmp_path / "warm"))
    cfg = EvalConfig(store=regen_store, checkpoints=[trained_drafter_dir, warm_dir],
                     settings=EvalSettings(mode="replay", tree_budgets=(4,)), progress=False)
    out = run_eval(cfg)
    dflash, dflash2 = out.offline["trained"], out.offline["warm"]
    assert dflash.summary().to_json()["mean_tau"] > 2  # a trained drafter: the equality has teeth
    assert dflash2.walks[None].rounds == dflash.walks[None].rounds
    assert dflash2.summary().to_json()["mean_tau"] == dflash.summary().to_json()["mean_tau"]
    with pytest.raises(TrainError, match="is a DFlash 2 drafter; pass --set model.kind"):
        initial_drafter(ModelConfig(init_from=warm_dir))


def test_walk_first_leads_with_the_walk_and_keeps_the_other_ids_in_order():
    ids = torch.tensor([[7, 3, 9, 1], [5, 6, 8, 2]])
    logp = -torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0]])
    walk, walk_logp = torch.tensor([9, 4]), torch.tensor([-0.3, -9.0])  # 4: not listed
    got_logp, got_ids = walk_first(logp, ids, walk, walk_logp, 3)
    assert got_ids.tolist() == [[9, 7, 3], [4, 5, 6]]
    assert torch.equal(got_logp, torch.tensor([[-0.3, -0.1, -0.2], [-9.0, -1.0, -2.0]]))
