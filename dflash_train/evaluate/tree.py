"""DDTree draft trees from one drafter pass, and their acceptance (docs/reference.md §7).

A tree grows best-first by the path's summed log-prob: each pop adds one node and pushes its
next sibling (same parent, next rank) and its first child (next depth, rank 0). The budget
counts non-root nodes; the top-1 chain is not forced in. Facts from DDTree (arXiv 2604.12989,
liranringel/ddtree).

What a node's children may be is a `Candidates` table: per depth, per "row", the tokens best
first with their log-probs and the row of the next depth a child leads to.
- DFlash (`unary_candidates`): slots are independent marginals, one row per depth: depth d
  draws from slot d's top-k of the fp32 log-softmax (dflash_train.blocks.draft_topk).
- DFlash 2 (`drafter.CandidateSelector.transitions`): the selector scores slot d's candidates
  given the token before them, so a child's log-prob depends on its parent's token: one row
  per candidate of the depth before (the root's children: the anchor token's row), each the
  log-softmax of the selector's scores over the slot's candidates. The tree's first path is
  then the selector's greedy walk, the draft it proposes as a chain.

The accepted path goes from the root following, at depth d, the child whose token is the
target's token (offline: the label l_d). A label present at depth d under another parent does
not count. A chain is the tree whose node d is slot d's draft (`chain_tree`), so chain and
tree rounds are verified and accepted by the same code, live and offline.

This module owns the tree and its accepted path; it never runs a model and never reads the
store.
"""

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash_train.blocks import BlockError


@dataclass
class DraftTree:
    """A draft tree; node 0 is the root (the anchor), nodes 1.. are in the order popped."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    """Token id per node; -1 for the root."""
    parents: list[int] = field(default_factory=lambda: [-1])
    """Parent node index per node; -1 for the root. A parent's index is always smaller."""
    depths: list[int] = field(default_factory=lambda: [0])
    """Depth per node = the slot it drafts (1..B-1); 0 for the root."""
    scores: list[float] = field(default_factory=lambda: [0.0])
    """Summed log-prob of the path from the root to the node."""
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    """Per node: token id -> child node index."""

    @property
    def size(self) -> int:
        """Number of non-root nodes (what the budget counts)."""
        return len(self.tokens) - 1


@dataclass
class Candidates:
    """What a node at depth d-1 may have as children (depth d, row d-1 of each tensor), in
    the row its own token selects; every row best first."""

    logp: torch.Tensor
    """float [D, R, K]: log-prob of each candidate, descending along K."""
    ids: torch.Tensor
    """long [D, R, K]: its token id."""
    rows: torch.Tensor
    """long [D, R, K]: the row (of depth d+1) a child taking this candidate leads to."""


def unary_candidates(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor) -> Candidates:
    """DFlash: depth d's candidates are slot d's top-k whatever the parent (one row)."""
    if topk_logprobs.shape != topk_ids.shape or topk_logprobs.dim() != 2:
        raise BlockError(
            f"topk_logprobs {tuple(topk_logprobs.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [D, K]"
        )
    return Candidates(topk_logprobs[:, None], topk_ids[:, None].long(),
                      torch.zeros_like(topk_ids[:, None], dtype=torch.long))


def selector_candidates(logp: torch.Tensor, candidates: torch.Tensor) -> Candidates:
    """DFlash 2: slot d's candidates [D, C] with their log-probs given each candidate of the
    slot before [D, C, C] (drafter.CandidateSelector.transitions): row p of depth d serves a
    parent that took candidate p of depth d-1; the root's children read row 0."""
    order = logp.argsort(dim=-1, descending=True, stable=True)
    ids = candidates[:, None, :].expand_as(logp).gather(-1, order)
    return Candidates(logp.gather(-1, order), ids.long(), order)


def build_tree(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int) -> DraftTree:
    """Best-first DDTree over depths 1..D from per-depth top-k log-probs / ids [D, K] (row d-1
    holds slot d); see grow_tree."""
    return grow_tree(unary_candidates(topk_logprobs, topk_ids), budget)


def grow_tree(candidates: Candidates, budget: int) -> DraftTree:
    """Best-first DDTree of `budget` non-root nodes over depths 1..D.

    Ranks >= min(budget, K) are never used; pass K >= min(budget, V) to match DDTree exactly.
    Ties in score break by the rank path, lexicographically.
    """
    tree = DraftTree()
    depth_limit, _, k = candidates.logp.shape
    k = min(budget, k)
    if budget <= 0 or depth_limit == 0 or k == 0:
        return tree
    logp = candidates.logp[..., :k].detach().double().cpu().tolist()
    ids = candidates.ids[..., :k].detach().long().cpu().tolist()
    rows = candidates.rows[..., :k].detach().long().cpu().tolist()
    # Heap entry: (-score, rank path, parent node, depth, row, rank, parent score). The rank
    # path is unique per candidate, so ties resolve deterministically.
    heap = [(-logp[0][0][0], (0,), 0, 1, 0, 0, 0.0)]
    while heap and tree.size < budget:
        neg_score, ranks, parent, depth, row, rank, parent_score = heapq.heappop(heap)
        node = len(tree.tokens)
        token = ids[depth - 1][row][rank]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg_score)
        tree.children.append({})
        # Two siblings can share a token only if the top-k ids repeat; keep the first (the
        # better-scored) so the accepted path is unambiguous.
        tree.children[parent].setdefault(token, node)
        if rank + 1 < k:
            score = parent_score + logp[depth - 1][row][rank + 1]
            heapq.heappush(heap, (-score, ranks[:-1] + (rank + 1,), parent, depth, row,
                                  rank + 1, parent_score))
        if depth < depth_limit:
            child_row = rows[depth - 1][row][rank]
            score = -neg_score + logp[depth][child_row][0]
            heapq.heappush(heap, (-score, ranks + (0,), node, depth + 1, child_row, 0,
                                  -neg_score))
    return tree


MAX_TREE_BUDGET = 4096
"""The largest DDTree node budget taken anywhere (eval, --online, validation). A live verify
feeds the target every node in one forward under a [B, B] ancestor mask (64 MiB of float32 at
4,096 nodes, 400 MiB at 10,000), and a round commits at most one block however large its
tree; the combinatorial bound (max_tree_nodes) is no limit in practice, since the candidates
kept per slot grow with the budget."""


def budget_cap_refusal(budget: int) -> str | None:
    """None for a budget within MAX_TREE_BUDGET; else the rule, with why, for the caller's
    own error."""
    if budget <= MAX_TREE_BUDGET:
        return None
    return (f"at most {MAX_TREE_BUDGET:,} nodes: a verify feeds every node to the target in "
            f"one forward with a [B, B] mask, and a round commits at most one block")


def max_tree_nodes(depth: int, top_k: int, above: int | None = None) -> int:
    """The most non-root nodes a tree grown from one block can have, whatever the budget.

    Every node at depth d-1 may take each of depth d's `top_k` candidates as a child (grow_tree
    pushes each node's first child and each child's next sibling; a DFlash slot offers the same
    top-k under every parent, a DFlash 2 row its selector's top_k), so depth d holds up to
    top_k**d nodes: top_k + top_k**2 + ... + top_k**depth over the block's depth (block size
    - 1). A budget beyond it can never be filled. Counting stops once past `above` (the budget
    being checked): over a real vocabulary the full count has dozens of digits.
    """
    total, width = 0, 1
    for _ in range(depth):
        width *= top_k
        total += width
        if above is not None and total > above:
            break
    return total


def tree_budget_refusal(budget: int, depth: int, top_k: int) -> str | None:
    """None when a tree of `budget` nodes fits one block (max_tree_nodes); else the rule it
    breaks, with the bound and why, for the caller's own error."""
    most = max_tree_nodes(depth, top_k, above=budget)
    if budget <= most:
        return budget_cap_refusal(budget)
    return (f"at most {most:,} nodes, the most a DDTree grown from one block holds: "
            f"{top_k:,} candidates per depth over {depth} depths ({top_k} + {top_k}^2 + ... + "
            f"{top_k}^{depth})")


def chain_tree(tokens: Sequence[int]) -> DraftTree:
    """The chain of drafts d_1..d_D as a tree: node d is slot d's draft, child of node d-1."""
    tree = DraftTree()
    for d, token in enumerate(tokens, start=1):
        tree.tokens.append(int(token))
        tree.parents.append(d - 1)
        tree.depths.append(d)
        tree.scores.append(0.0)
        tree.children.append({})
        tree.children[d - 1][int(token)] = d
    return tree


def path_tokens(tree: DraftTree, path: Sequence[int]) -> list[int]:
    """The tokens of nodes `path` (a root path without the root)."""
    return [tree.tokens[n] for n in path]


def best_branch(tree: DraftTree, path: Sequence[int]) -> list[int]:
    """`path` (a root path without the root) continued by each node's first (best-scored)
    child down to a leaf: the nodes one forward can check after the path."""
    branch = list(path)
    while tree.children[branch[-1] if branch else 0]:
        branch.append(next(iter(tree.children[branch[-1] if branch else 0].values())))
    return branch


def accepted_path(
    tree: DraftTree, labels: Sequence[int], valid: Sequence[bool] | None = None
) -> list[int]:
    """Node indices matched from the root: at depth d the child whose token is labels[d-1].

    labels / valid are indexed by depth (slot d at index d-1); the path stops at the first
    depth with no matching child or an invalid label.
    """
    path: list[int] = []
    node = 0
    for d, label in enumerate(labels):
        if valid is not None and not valid[d]:
            break
        child = tree.children[node].get(int(label))
        if child is None:
            break
        path.append(child)
        node = child
    return path
