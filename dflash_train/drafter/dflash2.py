"""DFlash 2's two additions to the DFlash drafter: in-block convolutions and a selector.

The facts are those of z-lab's reference inference code (`dflash==0.1.0`, dflash/model.py):

- `GroupedDynamicCausalConv`, two per decoder layer (`attention_conv`, `mlp_conv`), wraps its
  sublayer on both sides. One `kernel_projection(x)` (Linear H -> 2 * k * H/g, laid out
  [2, k, H/g]) of the sublayer's normed input gives the deltas (d_in, d_out); `prepare(x)`
  returns (conv(x; base[0] + d_in), d_out) and `finish(y, d_out)` returns
  conv(y; base[1] + d_out), with conv(x; K)[i, c] = sum_{t<k} K[i, t, c] * x[i - t, c]:
  tap 0 is the slot itself, channel c takes the delta of its group c // g (g contiguous
  channels), and slots before the block's anchor read zeros. z-lab runs one block per
  forward, so its zeros are the block start; here a forward holds many blocks laid out
  [N, K*B, H], so the conv runs per block and nothing crosses a block boundary.
- `CandidateSelector` rescores the top-K logits of each slot: score = unary +
  <A[pred] * hidden_projection(h), B[cand]>, A / B the predecessor / successor codebooks
  [V, r]. The walk starts with pred = the block's anchor token and moves pred to each slot's
  chosen candidate; greedy (T = 0) chooses the argmax.

Init (ours; z-lab ships no training code): both convs the exact identity (base tap 0 = 1,
the other taps and the projection 0) and the successor codebook 0, so a fresh DFlash 2
drafter computes what the DFlash drafter with the same backbone weights computes and the
walk picks each slot's argmax. The predecessor codebook and hidden projection start random,
or the pairwise term would get no gradient at all.

Factorised codebooks (ours, `selector_codebooks="factorised"`): A = E W_A, B = E W_B with E
the target's frozen token embedding and W [H, r] trained, so the selector costs 2 H r
instead of 2 V r parameters; export writes E W under the codebooks' names.

Tensor names are the checkpoint's: `base_kernel`, `kernel_projection.weight`,
`hidden_projection.weight`, and the two codebooks as bare [V, r] tensors (no `.weight`:
z-lab's from_pretrained maps them onto its nn.Embedding's weight).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


def causal_shift(x: torch.Tensor, taps: int) -> torch.Tensor:
    """x shifted `taps` slots along dim -2, zeros first: out[..., i, :] = x[..., i-taps, :]."""
    if taps == 0:
        return x
    return F.pad(x[..., :-taps, :], (0, 0, taps, 0))


def grouped_causal_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """conv(x; base + delta) over blocks x [..., B, H] (slots along dim -2): base [k, H] per
    channel, delta [..., B, k, H / group_size] per slot, shared by each group's channels."""
    groups = x.shape[-1] // group_size
    out = torch.zeros_like(x).unflatten(-1, (groups, group_size))
    for t in range(base.shape[0]):
        kernel = base[t].to(x.dtype).view(groups, group_size) + delta[..., t, :, None]
        out = out + kernel * causal_shift(x, t).unflatten(-1, (groups, group_size))
    return out.flatten(-2)


class GroupedDynamicCausalConv(nn.Module):
    """A sublayer's two in-block convolutions, before (prepare) and after (finish) it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        """[before / after, tap, channel]."""
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups,
                                           bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The exact identity: tap 0 of both base kernels 1, everything else 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (-1, self.block_size))  # [N, K*B, H] -> [N, K, B, H]

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's input convolved, the after-delta for `finish`) of x [N, K*B, H]."""
        blocks = self._blocks(x)
        deltas = self.kernel_projection(blocks).unflatten(-1, (2, self.kernel_size, self.groups))
        out = grouped_causal_conv(blocks, self.base_kernel[0], deltas[..., 0, :, :],
                                  self.group_size)
        return out.flatten(1, 2), deltas[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [N, K*B, H] convolved with the delta `prepare` returned."""
        out = grouped_causal_conv(self._blocks(y), self.base_kernel[1], delta, self.group_size)
        return out.flatten(1, 2)


SelectorCodebooks = Literal["free", "factorised"]
FACTORS = {"predecessor_codebook": "predecessor_factor", "successor_codebook": "successor_factor"}
"""Codebook name -> the [H, r] factor W a factorised selector trains in its place (A = E W)."""


CODEBOOK_ROWS = 16384
"""Embedding rows per matmul when a factorised codebook E W is materialised."""


@torch.no_grad()
def embedded_codebook(embed: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """E W [V, r] in factor's dtype and device, CODEBOOK_ROWS rows of E at a time: a whole
    float32 copy of a 248K x 5120 bf16 embedding would be 5 GB beside the run."""
    return torch.cat([embed[a:a + CODEBOOK_ROWS].to(factor.device, factor.dtype) @ factor
                      for a in range(0, embed.shape[0], CODEBOOK_ROWS)])


class CandidateSelector(nn.Module):
    """Rescores each slot's top-K candidates by its predecessor token; walks a block.

    codebooks: `free` trains A and B as [V, r] tensors (z-lab's form, every open trainer's);
    `factorised` trains W_A, W_B [H, r] and reads A = E W_A, B = E W_B through the target's
    frozen token embedding E [V, H], which every call that reads a codebook then takes
    (`embed`). `materialised` gives the [V, r] pair an engine loads either way.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int,
                 codebooks: SelectorCodebooks = "free"):
        super().__init__()
        self.top_k, self.codebooks = top_k, codebooks
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        rows = vocab_size if codebooks == "free" else hidden_size
        if codebooks == "free":
            self.predecessor_codebook = nn.Parameter(torch.empty(rows, rank))
            """A: [V, r], row of the token before the slot."""
            self.successor_codebook = nn.Parameter(torch.empty(rows, rank))
            """B: [V, r], row of the candidate."""
        else:
            self.predecessor_factor = nn.Parameter(torch.empty(rows, rank))
            """W_A: [H, r], A = E W_A."""
            self.successor_factor = nn.Parameter(torch.empty(rows, rank))
            """W_B: [H, r], B = E W_B."""
        self.reset_parameters()

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) for free codebooks, (W_A, W_B) for factorised ones."""
        if self.codebooks == "free":
            return self.predecessor_codebook, self.successor_codebook
        return self.predecessor_factor, self.successor_factor

    def reset_parameters(self, std: float = 0.02) -> None:
        """Pairwise term 0 (successor table 0) with gradients: the rest ~ N(0, std)."""
        predecessor, successor = self._tables()
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.normal_(predecessor, std=std)
        nn.init.zeros_(successor)

    def rows(self, which: int, ids: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor:
        """Codebook rows [..., r] of token ids [...]: which 0 = A (predecessor), 1 = B."""
        table = self._tables()[which]
        if self.codebooks == "free":
            return F.embedding(ids, table)
        if embed is None:
            raise ValueError("a factorised selector reads its codebooks through the target's "
                             "token embedding; attach the target head first")
        return F.embedding(ids, embed).to(table.dtype) @ table

    @torch.no_grad()
    def materialised(self, embed: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """{'predecessor_codebook': A, 'successor_codebook': B}, each [V, r], as engines load."""
        if self.codebooks == "free":
            return {"predecessor_codebook": self.predecessor_codebook.detach(),
                    "successor_codebook": self.successor_codebook.detach()}
        if embed is None:
            raise ValueError("materialising factorised codebooks needs the target's token "
                             "embedding; attach the target head first")
        return {name: embedded_codebook(embed, getattr(self, factor).detach())
                for name, factor in FACTORS.items()}

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, token ids) [..., K] of the top-K logits [..., V], best first."""
        return torch.topk(logits, self.top_k, dim=-1)

    def scores(self, projected: torch.Tensor, predecessors: torch.Tensor,
               unary: torch.Tensor, candidates: torch.Tensor,
               embed: torch.Tensor | None = None) -> torch.Tensor:
        """unary + <A[pred] * projected, B[cand]>, [..., K]: projected [..., r] (the slot's
        hidden_projection), predecessors [...], unary / candidates [..., K]."""
        query = self.rows(0, predecessors, embed) * projected
        keys = self.rows(1, candidates, embed)
        return unary + (keys @ query.unsqueeze(-1)).squeeze(-1)

    def transitions(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
                    embed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's candidates [..., S, K] and their fp32 log-probs given each possible
        predecessor [..., S, K, K]: row p of slot s is conditioned on candidate p of slot s-1
        (every row of slot 0 on the anchor token), the log-softmax of `scores` over the K
        candidates. The greedy `walk` takes, at each slot, the argmax of the row its previous
        choice selects (a draft tree's best path: evaluate/tree.py)."""
        unary, candidates = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        k = candidates.shape[-1]
        anchors = anchor_ids[..., None, None].expand(*anchor_ids.shape, 1, k)
        predecessors = torch.cat([anchors, candidates[..., :-1, :]], dim=-2)  # [..., S, K]
        scores = self.scores(projected[..., None, :], predecessors, unary[..., None, :],
                             candidates[..., None, :], embed)
        return torch.log_softmax(scores.float(), dim=-1), candidates

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor,
             anchor_ids: torch.Tensor, embed: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy tokens [..., S] of S consecutive slots (hidden [..., S, H], their logits
        [..., S, V]) after anchor tokens [...]: each slot's best-scored candidate given the
        token chosen before it."""
        unary, candidates = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        chosen, previous = [], anchor_ids
        for s in range(hidden.shape[-2]):
            score = self.scores(projected[..., s, :], previous, unary[..., s, :],
                                candidates[..., s, :], embed)
            previous = candidates[..., s, :].gather(-1, score.argmax(-1, keepdim=True))[..., 0]
            chosen.append(previous)
        return torch.stack(chosen, dim=-1)
