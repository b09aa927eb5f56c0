"""DDTree construction and offline tree acceptance: hand-built trees and brute force."""

import itertools

import pytest
import torch

from dflash_train.blocks import IGNORE_LABEL, BlockError
from dflash_train.drafter.dflash2 import CandidateSelector
from dflash_train.evaluate.metrics import acceptance_lengths
from dflash_train.evaluate.tree import (
    accepted_path,
    best_branch,
    build_tree,
    chain_tree,
    grow_tree,
    selector_candidates,
)


def tree_accept(tree, labels, valid=None):
    """tau of a tree against labels by depth: accepted depth + the bonus."""
    return len(accepted_path(tree, labels, valid)) + 1


def _topk(rows):
    """[(token, logprob), ...] per depth -> (logprobs [D, K], ids [D, K])."""
    lp = torch.tensor([[p for _, p in row] for row in rows], dtype=torch.float32)
    ids = torch.tensor([[t for t, _ in row] for row in rows])
    return lp, ids


def _edges(tree):
    return [(tree.tokens[tree.parents[i]], tree.tokens[i]) for i in range(1, len(tree.tokens))]


CHAIN = [
    [(10, -0.1), (11, -2.5)],
    [(20, -0.2), (21, -3.0)],
    [(30, -0.3), (31, -1.0)],
]


def test_hand_built_tree_grows_best_first():
    lp, ids = _topk(CHAIN)
    # pops: 10 (-0.1), 20 (-0.3), 30 (-0.6), 31 (-1.3), 11 (-2.5)
    tree = build_tree(lp, ids, budget=5)
    assert tree.tokens == [-1, 10, 20, 30, 31, 11]
    assert tree.parents == [-1, 0, 1, 2, 2, 0]
    assert tree.depths == [0, 1, 2, 3, 3, 1]
    assert tree.scores == pytest.approx([0.0, -0.1, -0.3, -0.6, -1.3, -2.5])
    assert tree.size == 5


def test_hand_built_acceptance_depends_on_the_budget():
    lp, ids = _topk(CHAIN)
    labels = [10, 20, 31]
    assert tree_accept(build_tree(lp, ids, 3), labels) == 3  # 31 not yet in the tree
    assert tree_accept(build_tree(lp, ids, 4), labels) == 4
    assert tree_accept(build_tree(lp, ids, 0), labels) == 1  # root only
    assert tree_accept(build_tree(lp, ids, 5), [11, 20, 30]) == 2  # 11 has no children yet


def test_a_label_under_another_parent_does_not_count():
    lp, ids = _topk(
        [
            [(10, -0.7), (11, -0.8)],
            [(20, -0.2), (21, -2.0)],
        ]
    )
    # pops: 10 (-0.7), 11 (-0.8), 20 under 10 (-0.9) | 20 under 11 (-1.0)
    tree = build_tree(lp, ids, budget=3)
    assert _edges(tree) == [(-1, 10), (-1, 11), (10, 20)]
    # 20 is in depth 2's top-k and in the tree, but under 10, not under the label 11
    assert tree_accept(tree, [11, 20]) == 2
    assert tree_accept(tree, [10, 20]) == 3
    assert tree_accept(build_tree(lp, ids, budget=4), [11, 20]) == 3


def test_the_top1_chain_is_not_forced_in():
    lp, ids = _topk(
        [
            [(10, -0.01), (11, -0.02)],
            [(20, -5.0), (21, -6.0)],
        ]
    )
    tree = build_tree(lp, ids, budget=2)
    assert _edges(tree) == [(-1, 10), (-1, 11)]
    assert tree_accept(tree, [10, 20]) == 2


def test_invalid_labels_stop_the_walk():
    lp, ids = _topk(CHAIN)
    tree = build_tree(lp, ids, 10)
    assert tree_accept(tree, [10, 20, 30], valid=[True, True, False]) == 3
    assert tree_accept(tree, [10, 20, 30], valid=[False, True, True]) == 1


def test_budget_caps_ranks_used_per_depth():
    lp, ids = _topk([[(10, -0.1), (11, -0.2), (12, -0.3)]])
    tree = build_tree(lp, ids, budget=2)  # k = min(2, 3): rank 2 never enters
    assert tree.tokens == [-1, 10, 11]


def _random_topk(gen, depth, k, vocab=50):
    lp = torch.log_softmax(torch.randn(depth, vocab, generator=gen) * 2, dim=-1).topk(k)
    return lp.values, lp.indices


def _brute_force_nodes(lp, ids, budget):
    """Rank paths of the `budget` best-scored paths among all ranks < min(budget, K)."""
    depth, k = lp.shape
    k = min(budget, k)
    scored = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = sum(float(lp[i, r]) for i, r in enumerate(ranks))
            scored.append((-score, ranks))
    scored.sort()
    return {ranks for _, ranks in scored[:budget]}


def _rank_paths(tree, ids):
    out = set()
    for node in range(1, len(tree.tokens)):
        ranks = []
        while node != 0:
            d = tree.depths[node]
            ranks.append(ids[d - 1].tolist().index(tree.tokens[node]))
            node = tree.parents[node]
        out.add(tuple(reversed(ranks)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_tree_is_the_budget_best_paths_by_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    lp, ids = _random_topk(gen, depth=3, k=4)
    for budget in [1, 2, 5, 11, 30, 84, 200]:
        tree = build_tree(lp, ids, budget)
        assert tree.size == min(budget, 4 + 16 + 64)
        assert _rank_paths(tree, ids) == _brute_force_nodes(lp, ids, budget)
        # pop order is best-first: scores never increase, parents come first
        assert all(a >= b for a, b in zip(tree.scores[1:], tree.scores[2:], strict=False))
        assert all(tree.parents[i] < i for i in range(1, len(tree.tokens)))
        assert all(
            tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, len(tree.tokens))
        )


def _naive_tree_tau(tree, labels):
    """1 + longest label prefix that is a root path of the tree, by token sequences."""
    paths = set()
    for node in range(1, len(tree.tokens)):
        toks = []
        while node != 0:
            toks.append(tree.tokens[node])
            node = tree.parents[node]
        paths.add(tuple(reversed(toks)))
    m = 0
    while m < len(labels) and tuple(labels[: m + 1]) in paths:
        m += 1
    return m + 1


def test_tree_accept_matches_a_naive_prefix_search():
    gen = torch.Generator().manual_seed(7)
    for _ in range(40):
        lp, ids = _random_topk(gen, depth=5, k=6, vocab=8)
        tree = build_tree(lp, ids, int(torch.randint(1, 60, (1,), generator=gen)))
        # labels drawn from the top-3 so long matches actually happen
        labels = [int(ids[d, torch.randint(0, 3, (1,), generator=gen)]) for d in range(5)]
        assert tree_accept(tree, labels) == _naive_tree_tau(tree, labels)
        assert len(accepted_path(tree, labels)) + 1 == tree_accept(tree, labels)


def _blocks(seed, n=12, block=6, k=16, vocab=10):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, block, vocab, generator=gen) * 2
    top = torch.log_softmax(logits, dim=-1).topk(min(k, vocab))
    labels = torch.where(
        torch.rand(n, block, generator=gen) < 0.7,
        top.indices[..., 0],
        torch.randint(0, vocab, (n, block), generator=gen),
    )
    valid = torch.rand(n, block, generator=gen) < 0.95
    valid[:, 0] = False
    labels[~valid] = IGNORE_LABEL
    return top.values, top.indices, labels, valid


def _block_taus(lp, ids, labels, valid, budget):
    return torch.tensor([tree_accept(build_tree(lp[n, 1:], ids[n, 1:], budget),
                                     labels[n, 1:].tolist(), valid[n, 1:].tolist())
                         for n in range(labels.shape[0])])


def test_a_smaller_budget_grows_the_first_nodes_of_a_larger_tree():
    lp, ids, _, _ = _blocks(8, vocab=10, k=10)
    for n in range(lp.shape[0]):
        big = build_tree(lp[n, 1:], ids[n, 1:], 64)
        for b in (1, 2, 3, 8, 20):
            small = build_tree(lp[n, 1:], ids[n, 1:], b)
            assert small.tokens == big.tokens[: b + 1] and small.parents == big.parents[: b + 1]


def test_tree_acceptance_never_falls_with_budget_and_budget_one_is_one_slot():
    lp, ids, labels, valid = _blocks(9)
    budgets = [1, 4, 16, 64, 256]
    got = {b: _block_taus(lp, ids, labels, valid, b) for b in budgets}
    for small, big in itertools.pairwise(budgets):
        assert torch.all(got[big] >= got[small])
    linear = acceptance_lengths(ids[..., 0], labels, valid)
    assert torch.equal(got[1], linear.clamp(max=2))


def test_a_deep_enough_budget_contains_the_top1_chain():
    lp, ids, labels, valid = _blocks(10, block=5, k=4, vocab=4)
    # budget = every path of ranks < 4 over 4 depths: the whole k-ary tree
    full = sum(4**d for d in range(1, 5))
    got = _block_taus(lp, ids, labels, valid, full)
    assert torch.all(got >= acceptance_lengths(ids[..., 0], labels, valid))


def test_a_chain_tree_accepts_the_linear_streak():
    _, ids, labels, valid = _blocks(12)
    linear = acceptance_lengths(ids[..., 0], labels, valid)
    for n in range(ids.shape[0]):
        chain = chain_tree(ids[n, 1:, 0].tolist())
        assert chain.parents == list(range(-1, ids.shape[1] - 1))
        assert tree_accept(chain, labels[n, 1:].tolist(), valid[n, 1:].tolist()) == linear[n]


def test_best_branch_follows_the_best_child_down_to_a_leaf():
    lp, ids = _topk(CHAIN)
    tree = build_tree(lp, ids, budget=5)  # 10 -> 20 -> {30, 31}, and 11
    assert best_branch(tree, []) == [1, 2, 3]
    assert best_branch(tree, [5]) == [5]
    assert best_branch(tree, [1, 2, 4]) == [1, 2, 4]


def test_a_selector_tree_grows_the_selector_walk_first_and_scores_children_by_parent():
    gen = torch.Generator().manual_seed(4)
    selector = CandidateSelector(hidden_size=16, vocab_size=40, rank=6, top_k=5)
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    hidden = torch.randn(7, 16, generator=gen)  # 7 slots
    logits = torch.randn(7, 40, generator=gen) * 2
    anchor = torch.tensor(3)
    with torch.no_grad():
        logp, candidates = selector.transitions(hidden, logits, anchor)
        walk = selector.walk(hidden, logits, anchor).tolist()
    tree = grow_tree(selector_candidates(logp, candidates), budget=60)
    branch = [tree.tokens[n] for n in best_branch(tree, [])]
    assert len(branch) >= 3 and branch == walk[: len(branch)]
    # a child's log-prob is its row's: the selector given its parent's token
    for node in range(1, len(tree.tokens)):
        parent, depth = tree.parents[node], tree.depths[node]
        row = 0 if parent == 0 else candidates[depth - 2].tolist().index(tree.tokens[parent])
        col = candidates[depth - 1].tolist().index(tree.tokens[node])
        step = tree.scores[node] - tree.scores[parent]
        assert step == pytest.approx(float(logp[depth - 1, row, col]), abs=1e-6)


def test_shape_errors_are_refused():
    lp, ids, labels, valid = _blocks(11)
    with pytest.raises(BlockError):
        build_tree(lp[0], ids[0, :, :3], 4)
