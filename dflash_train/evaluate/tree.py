"""DDTree draft trees from one drafter pass, and their offline acceptance (docs/reference.md §7).

Slots 1..B-1 are treated as independent marginals: depth d of the tree draws from slot d's
top-k of the fp32 log-softmax (dflash_train.blocks.draft_topk). The tree grows best-first by the
path's summed log-prob; each pop adds one node and pushes its next sibling (same parent,
next rank) and its first child (next depth, rank 0). The budget counts non-root nodes; the
top-1 chain is not forced in. Facts from DDTree (arXiv 2604.12989, liranringel/ddtree).

Offline acceptance walks from the root following, at depth d, the child whose token is the
label l_d. A label present in depth d's top-k but under another parent does not count.

Not for DFlash 2 drafters (eval leaves their tree figures empty): their selector scores a
candidate given the token before it, so a tree over the unary marginals would measure them
with the selector off; a selector-aware tree (children scored with the parent's token as
predecessor) is not built yet.

This module owns the tree and the walk; it never runs a model and never reads the store.
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


def build_tree(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int) -> DraftTree:
    """Best-first DDTree over depths 1..D from per-depth top-k log-probs / ids [D, K].

    Row d-1 holds slot d. Ranks >= min(budget, K) are never used; pass K >= min(budget, V)
    to match DDTree exactly. Ties in score break by the rank path, lexicographically.
    """
    if topk_logprobs.shape != topk_ids.shape or topk_logprobs.dim() != 2:
        raise BlockError(
            f"topk_logprobs {tuple(topk_logprobs.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [D, K]"
        )
    tree = DraftTree()
    depth_limit, k = topk_logprobs.shape
    k = min(budget, k)
    if budget <= 0 or depth_limit == 0 or k == 0:
        return tree
    logp = topk_logprobs[:, :k].detach().double().cpu().tolist()
    ids = topk_ids[:, :k].detach().long().cpu().tolist()
    # Heap entry: (-score, rank path, parent node, depth, rank, parent score). The rank path
    # is unique per candidate, so ties resolve deterministically.
    heap = [(-logp[0][0], (0,), 0, 1, 0, 0.0)]
    while heap and tree.size < budget:
        neg_score, ranks, parent, depth, rank, parent_score = heapq.heappop(heap)
        node = len(tree.tokens)
        token = ids[depth - 1][rank]
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg_score)
        tree.children.append({})
        # Two siblings can share a token only if the top-k ids repeat; keep the first (the
        # better-scored) so the walk is unambiguous.
        tree.children[parent].setdefault(token, node)
        if rank + 1 < k:
            score = parent_score + logp[depth - 1][rank + 1]
            heapq.heappush(
                heap, (-score, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, parent_score)
            )
        if depth < depth_limit:
            score = -neg_score + logp[depth][0]
            heapq.heappush(heap, (-score, ranks + (0,), node, depth + 1, 0, -neg_score))
    return tree


def accepted_path(
    tree: DraftTree, labels: Sequence[int], valid: Sequence[bool] | None = None
) -> list[int]:
    """Node indices matched from the root: at depth d the child whose token is labels[d-1].

    labels / valid are indexed by depth (slot d at index d-1); the walk stops at the first
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


def tree_accept(
    tree: DraftTree,
    labels: Sequence[int],
    valid: Sequence[bool] | None = None,
    budget: int | None = None,
) -> int:
    """Acceptance length tau = accepted depth + 1, optionally for the tree cut at `budget`.

    Nodes are numbered in pop order, so the first `budget` nodes of a tree built with a
    larger budget are exactly the tree built with `budget` (a rank-r node needs r earlier
    sibling pops); the cut tree's path is the prefix of nodes with index <= budget.
    """
    path = accepted_path(tree, labels, valid)
    if budget is None:
        return len(path) + 1
    return sum(1 for node in path if node <= budget) + 1


def tree_acceptance_lengths(
    draft_logprobs: torch.Tensor,
    draft_ids: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    budgets: Sequence[int],
) -> dict[int, torch.Tensor]:
    """tau per block [N] for each node budget, from per-slot top-k [N, B, K] and labels [N, B].

    Slot 0 (the anchor) is dropped here; depth d uses slot d. One tree with the largest
    budget serves every smaller budget (see tree_accept). K should be >= max(budgets) (or V).
    """
    if draft_logprobs.shape != draft_ids.shape or draft_logprobs.dim() != 3:
        raise BlockError(
            f"draft_logprobs {tuple(draft_logprobs.shape)} and draft_ids "
            f"{tuple(draft_ids.shape)} must both be [N, B, K]"
        )
    if labels.shape != draft_ids.shape[:2] or valid.shape != labels.shape:
        raise BlockError(
            f"labels {tuple(labels.shape)} and valid {tuple(valid.shape)} must be [N, B] = "
            f"{tuple(draft_ids.shape[:2])}"
        )
    if not budgets:
        return {}
    largest = max(budgets)
    label_rows = labels[:, 1:].long().cpu().tolist()
    valid_rows = valid[:, 1:].bool().cpu().tolist()
    out = {b: torch.empty(labels.shape[0], dtype=torch.long) for b in budgets}
    for n in range(labels.shape[0]):
        tree = build_tree(draft_logprobs[n, 1:], draft_ids[n, 1:], largest)
        path = accepted_path(tree, label_rows[n], valid_rows[n])
        for b in budgets:
            out[b][n] = sum(1 for node in path if node <= b) + 1
    return out
