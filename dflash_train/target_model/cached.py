"""The target with a cache, as live speculative decoding runs it: prefill a prompt, verify a
draft tree in one forward (a chain is a tree whose nodes each have the previous as parent),
then keep the root and the accepted path.

The protocol, and who reads or writes the cache when (one sequence at a time):
1. `CachedTarget.prefill(tokens)` starts a sequence: a new cache holding `tokens`; returns
   their `Verified` states.
2. `CachedTarget.verify(tokens, parents)` runs the nodes in one forward and returns a
   `PendingVerify`: what the target computed at each node (read as a `Verified`), and what
   keeping a path needs: the tree, each linear-attention layer's states from before the pass
   and its inputs in the pass. The forward appends every node to the attention layers' cache.
3. `PendingVerify.keep(path)` keeps the root and one accepted path and drops every other
   node: the cache then holds the committed tokens only, as a prefill of them would. It is
   the only writer between two verifies and runs once per verify.
Refused with a TargetError: a verify before any prefill, a verify while the last one is
pending (keep its path first), a second keep, a keep after a prefill started a new sequence,
a path that is not a root path of its tree. A prefill drops a pending verify.

- Attention layers keep their keys/values across rounds. A tree is verified under a mask
  where each node sees the cache, its ancestors and itself, at position cache length + its
  depth; `keep` moves the kept nodes' keys/values into place (a chain's rejected tail is
  simply cropped).
- Linear-attention layers (Qwen3.5's Gated DeltaNet) carry a convolution and a recurrent state
  that cannot be cropped. Each has one `_LinearTap` as its forward, installed once per layer by
  the first CachedTarget on a model: outside a verify it is the layer's own forward; during
  one it records the layer's input and, on a tree, runs the nodes from each parent's state
  (gated_delta.py: the cache read, never written), so siblings never leak into each other.
  On a chain the layer's own forward advances its state over every node. Unless a whole chain
  is kept, `keep` sets each such layer back to its snapshot and runs it again, alone, on its
  recorded inputs at the kept nodes (no other layer reruns).

Owns what it relies on of transformers' DynamicCache (a layer's keys/values, or its conv and
recurrent states) and refuses any other cache layer by name. Changes the model in that one
way only (the taps); never writes a file.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_train.target_model.capture import hooked_layers
from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.gated_delta import is_gated_delta_layer, tree_forward
from dflash_train.target_model.loading import Target
from dflash_train.target_model.verifier import head_logits, verifier_topk

States = tuple[torch.Tensor, torch.Tensor]
"""A linear-attention layer's (convolution, recurrent) states: [1, C, K], [1, Hv, dk, dv]."""


@dataclass
class Verified:
    """What the target computed at the nodes of one forward."""

    features: torch.Tensor
    """[1, N, n, H]: the context layers' outputs at each node, in the target's dtype."""
    hidden: torch.Tensor
    """[N, H]: the last layer's final-norm output at each node, what the head reads."""
    lm_head: nn.Module
    _top1: dict[int, int] = field(default_factory=dict, repr=False)

    @torch.inference_mode()
    def top1(self, node: int) -> int:
        """The target's greedy next token after `node` (negative: from the end). Computed
        when first asked: a walk asks along the path it accepts, so the head (all of its
        [V, H] weights read per call) runs on a node or two a round, not on every node
        verified, nor on every prompt token."""
        node %= self.hidden.shape[0]
        if node not in self._top1:
            # the store's labels' chunked top-k, so ties break the same way
            top, _, _ = verifier_topk(self.hidden[node : node + 1], self.lm_head, 1)
            self._top1[node] = int(top[0, 0])
        return self._top1[node]

    @torch.inference_mode()
    def logits(self, node: int) -> torch.Tensor:
        """The target's full next-token logits after `node`, float32 [V] (negative: from the
        end): what a draw at T > 0 reads. The head runs on that one row only, as `top1` does;
        a walk asks each node at most once."""
        node %= self.hidden.shape[0]
        return head_logits(self.hidden[node : node + 1], self.lm_head)[0]


def is_chain(parents: list[int]) -> bool:
    return all(p == n - 1 for n, p in enumerate(parents))


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """bool [N, N]: row n is True at n and at each of its ancestors."""
    n = len(parents)
    sees = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            sees[node] |= sees[parent]
    return sees


@dataclass(frozen=True)
class _Tree:
    """The nodes of one forward, measured once: what the mask, the positions, the linear
    taps and `keep` read."""

    parents: list[int]
    """Per node, its parent's index; -1 for the root, which follows the cache."""
    chain: bool
    sees: torch.Tensor | None = None
    """bool [N, N], ancestor_mask; None for a chain, which the causal mask serves."""
    depth: torch.Tensor | None = None
    """long [N]: each node's distance from the root; None for a chain (its index)."""

    @classmethod
    def of(cls, parents: list[int]) -> "_Tree":
        if not parents or parents[0] != -1 or any(not 0 <= p < n for n, p in
                                                  enumerate(parents) if n):
            raise TargetError(f"a draft tree's parents must be [-1, p1, ...] with p_n < n: "
                              f"{parents}")
        if is_chain(parents):  # a prompt's thousands of tokens never build an [N, N] mask
            return cls(list(parents), chain=True)
        sees = ancestor_mask(parents)
        return cls(list(parents), chain=False, sees=sees, depth=sees.sum(dim=1) - 1)

    def check_path(self, path: list[int]) -> None:
        if not path or path[0] != 0 or any(self.parents[b] != a for a, b in
                                           zip(path, path[1:], strict=False)):
            raise TargetError(f"keep {path}: not a path from the root of this verify")


class _LinearTap:
    """A linear-attention layer's forward, installed once: the layer's own forward unless a
    verify has armed it; armed, it records the layer's input and, on a tree, runs the nodes
    from their parents' states instead (transformers' forward would run them as one
    sequence, each node after its siblings)."""

    def __init__(self, mixer: nn.Module, index: int):
        self.mixer, self.index = mixer, index
        self.own = mixer.forward  # whatever it was (accelerate may wrap it), kept as is
        self.armed: tuple[_Tree, States, dict[int, torch.Tensor]] | None = None

    def __call__(self, hidden_states, *args, **kwargs):
        if self.armed is None:
            return self.own(hidden_states, *args, **kwargs)
        tree, (conv, rec), inputs = self.armed
        inputs[self.index] = hidden_states
        if tree.chain:
            return self.own(hidden_states, *args, **kwargs)
        return tree_forward(self.mixer, hidden_states, tree.parents, conv, rec)

    @classmethod
    def on(cls, mixer: nn.Module, index: int) -> "_LinearTap":
        """The layer's tap, installed now unless another CachedTarget already did."""
        tap = mixer.__dict__.get("forward")
        if not isinstance(tap, cls):
            tap = cls(mixer, index)
            mixer.forward = tap
        return tap


def _states(cache, i: int) -> States:
    """Cache layer i's live (convolution, recurrent) states, for reading or copying into."""
    layer = cache.layers[i]
    return layer.conv_states[0], layer.recurrent_states[0]


@dataclass(kw_only=True)
class PendingVerify(Verified):
    """What one `verify` computed at its nodes, while the cache still holds every one of them:
    `keep(path)` keeps the root and one accepted path, once."""

    cached: "CachedTarget" = field(repr=False)
    """The target whose cache holds the nodes."""
    tree: _Tree = field(repr=False)
    snapshot: dict[int, States] = field(repr=False)
    """Per linear-attention layer (cache index), its states from before the verify."""
    inputs: dict[int, torch.Tensor] = field(repr=False)
    """Per linear-attention layer, its input [1, N, H] in the verify pass."""
    kept: bool = False

    @torch.inference_mode()
    def keep(self, path: list[int]) -> None:
        """Keep the root and an accepted path (node indices, each the child of the one
        before, path[0] == 0); drop every other node from the cache."""
        cached = self.cached
        if cached.pending is not self:
            why = "its path was kept already" if self.kept else \
                "a prefill started a new sequence since"
            raise TargetError(f"keep {path}: this verify is no longer pending ({why})")
        self.tree.check_path(path)
        _keep_keys_values(cached.cache, cached.length, path, cached.target.device)
        whole_chain = self.tree.chain and len(path) == len(self.tree.parents)
        if self.snapshot and not whole_chain:
            self._replay_linear(path)
        cached.length += len(path)
        cached.pending, self.kept = None, True
        self.snapshot, self.inputs = {}, {}  # a caller holding this object holds no states

    def _replay_linear(self, path: list[int]) -> None:
        """Set each linear-attention layer back to its snapshot and run it alone over the
        kept nodes' inputs from the verify pass: its states then follow the kept path."""
        cached = self.cached
        index = torch.tensor(path, device=cached.target.device)
        for i, (conv, rec) in self.snapshot.items():
            live_conv, live_rec = _states(cached.cache, i)
            live_conv.copy_(conv)
            live_rec.copy_(rec)
            mixer = cached.decoder.layers[i].linear_attn  # its tap, disarmed: its own forward
            mixer(hidden_states=self.inputs[i].index_select(1, index), cache=cached.cache,
                  attention_mask=None)


def _keep_keys_values(cache, length: int, path: list[int], device) -> None:
    """The attention layers' keys/values: the first `length` and then the path's nodes."""
    prefix = path == list(range(len(path)))
    index = torch.tensor(path, device=device) + length
    for layer in cache.layers:
        if hasattr(layer, "keys") and layer.keys is not None and layer.keys.numel():
            if prefix:
                end = length + len(path)
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
            else:
                head = slice(None, length)
                layer.keys = torch.cat([layer.keys[..., head, :],
                                        layer.keys.index_select(-2, index)], dim=-2)
                layer.values = torch.cat([layer.values[..., head, :],
                                          layer.values.index_select(-2, index)], dim=-2)


class CachedTarget:
    """A target and its cache for one sequence at a time (`prefill` starts a new one)."""

    def __init__(self, target: Target, layer_ids: list[int]):
        self.target = target
        self.layer_ids = list(layer_ids)
        self.cache = None
        self.length = 0
        """Tokens in the cache, not counting the nodes of a pending verify."""
        self.pending: PendingVerify | None = None
        """The verify whose nodes the cache holds until its `keep`; written by verify,
        keep and prefill only."""
        self._taps = {i: _LinearTap.on(layer.linear_attn, i)
                      for i, layer in enumerate(self.decoder.layers)
                      if hasattr(layer, "linear_attn")}

    @property
    def decoder(self):
        return self.target.decoder

    def _linear(self) -> list[int]:
        """Indices of the cache's linear-attention layers."""
        return [i for i, layer in enumerate(self.cache.layers)
                if hasattr(layer, "recurrent_states")]

    def _check_cache(self) -> None:
        for i, layer in enumerate(self.cache.layers):
            if hasattr(layer, "recurrent_states"):
                if i not in self._taps:
                    raise TargetError(f"target layer {i}: a linear-attention cache layer "
                                      "without a `linear_attn` module; the cached --online "
                                      "loop cannot bring its state back after a rejected "
                                      "draft (use --no-cache)")
            elif type(layer).__name__ != "DynamicLayer":
                raise TargetError(f"target layer {i}: cache layer {type(layer).__name__} "
                                  "(sliding window or static) is not supported by the cached "
                                  "--online loop; use --no-cache")

    @torch.inference_mode()
    def prefill(self, tokens: list[int]) -> Verified:
        """A new cache holding `tokens`; the states and argmax at every position."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.decoder.config)
        self.length, self.pending = 0, None
        out = self._forward(tokens, _Tree.of(list(range(-1, len(tokens) - 1))))
        self._check_cache()
        self.length = len(tokens)
        return out

    @torch.inference_mode()
    def verify(self, tokens: list[int], parents: list[int]) -> PendingVerify:
        """Run the nodes (token per node, parent index per node: -1 for the root, which
        follows the cache) in one forward; the cache holds them until the result's `keep`."""
        tree = _Tree.of(parents)
        if self.cache is None:
            raise TargetError("verify before prefill: there is no sequence to extend")
        if self.pending is not None:
            raise TargetError("verify while the last verify is pending: keep a path of it "
                              "first (its nodes are still in the cache)")
        linear = self._linear()
        if linear and not tree.chain:
            self._check_tree_layers(linear)
        snapshot = {i: tuple(s.clone() for s in _states(self.cache, i)) for i in linear}
        with self._armed(tree, snapshot) as inputs:
            out = self._forward(tokens, tree)
        self.pending = PendingVerify(features=out.features, hidden=out.hidden,
                                     lm_head=out.lm_head, cached=self, tree=tree,
                                     snapshot=snapshot, inputs=inputs)
        return self.pending

    def _check_tree_layers(self, linear: list[int]) -> None:
        for i in linear:
            if not is_gated_delta_layer(self.decoder.layers[i].linear_attn):
                raise TargetError(
                    f"target layer {i} ({type(self.decoder.layers[i].linear_attn).__name__})"
                    ": a tree on this linear-attention layer needs per-node state "
                    "stepping, which exists for Qwen3.5's Gated DeltaNet only; decode "
                    "chains (no --tree-budget) with this target")

    @contextmanager
    def _armed(self, tree: _Tree, snapshot: dict[int, States]):
        """The snapshotted layers' taps armed for one forward; yields the inputs they record."""
        inputs: dict[int, torch.Tensor] = {}
        for i, states in snapshot.items():
            self._taps[i].armed = (tree, states, inputs)
        try:
            yield inputs
        finally:
            for i in snapshot:
                self._taps[i].armed = None

    def _forward(self, tokens: list[int], tree: _Tree) -> Verified:
        ids = torch.tensor([tokens], device=self.target.device)
        kwargs = {}
        if not tree.chain:
            kwargs["position_ids"] = (tree.depth + self.length).to(self.target.device)[None]
            kwargs["attention_mask"] = self._tree_mask(tree.sees)
        with hooked_layers(self.decoder.layers, self.layer_ids) as captured:
            out = self.decoder(input_ids=ids, cache=self.cache, use_cache=True, **kwargs)
        features = torch.stack([captured[k] for k in self.layer_ids], dim=2)
        return Verified(features, out.last_hidden_state[0], self.target.lm_head)

    def _tree_mask(self, sees: torch.Tensor):
        """The additive mask [1, 1, N, cache + N] of a tree (0 where a node may look); a dict
        by layer type for a hybrid, whose linear layers take no mask."""
        dtype = self.target.dtype
        n = sees.shape[0]
        mask = torch.full((n, self.length + n), torch.finfo(dtype).min, dtype=dtype)
        mask[:, : self.length] = 0
        mask[:, self.length:][sees] = 0
        mask = mask[None, None].to(self.target.device)
        types = set(getattr(self.decoder.config, "layer_types", None) or ["full_attention"])
        if types == {"full_attention"}:
            return mask
        return {kind: (None if kind == "linear_attention" else mask) for kind in types}
