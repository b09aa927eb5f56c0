"""The target with a cache, as live speculative decoding runs it: prefill a prompt, verify a
draft tree in one forward (a chain is a tree whose nodes each have the previous as parent),
then keep the root and the accepted path.

- Attention layers keep their keys/values across rounds. A tree is verified under a mask
  where each node sees the cache, its ancestors and itself, at position cache length + its
  depth; afterwards the kept nodes' keys/values are moved into place (a chain's rejected tail
  is simply cropped).
- Linear-attention layers (Qwen3.5's Gated DeltaNet) carry a convolution and a recurrent state
  that cannot be cropped. They are snapshotted before a round; unless a whole chain was kept,
  each such layer is set back and run again, alone, on the inputs it saw in the verify pass at
  the kept nodes (no other layer reruns). A tree on such a layer is verified node by node from
  each parent's state (gated_delta.py), so siblings never leak into each other.

Owns what it relies on of transformers' DynamicCache (a layer's keys/values, or its conv and
recurrent states) and refuses any other cache layer by name. Never writes anything.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_train.target_model.capture import hooked_layers
from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.gated_delta import is_gated_delta_layer, tree_forward
from dflash_train.target_model.loading import Target
from dflash_train.target_model.verifier import verifier_topk


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


class CachedTarget:
    """A target and its cache for one sequence at a time (`prefill` starts a new one)."""

    def __init__(self, target: Target, layer_ids: list[int]):
        self.target = target
        self.layer_ids = list(layer_ids)
        self.cache = None
        self.length = 0
        """Tokens in the cache."""
        self._inputs: dict[int, torch.Tensor] = {}
        self._snapshot: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last_parents: list[int] = []

    @property
    def decoder(self):
        return self.target.decoder

    def _layers(self):
        return self.cache.layers

    def _linear(self) -> list[int]:
        """Indices of the cache's linear-attention layers."""
        return [i for i, layer in enumerate(self._layers()) if hasattr(layer, "recurrent_states")]

    def _check_cache(self) -> None:
        for i, layer in enumerate(self._layers()):
            if hasattr(layer, "recurrent_states"):
                mixer = getattr(self.decoder.layers[i], "linear_attn", None)
                if mixer is None:
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
        self.length = 0
        out = self._forward(tokens, list(range(-1, len(tokens) - 1)))
        self._check_cache()
        self.length = len(tokens)
        return out

    @torch.inference_mode()
    def verify(self, tokens: list[int], parents: list[int]) -> Verified:
        """Run the nodes (token per node, parent index per node: -1 for the root, which
        follows the cache) in one forward; the cache holds them until `keep`."""
        if not parents or parents[0] != -1 or any(not 0 <= p < n for n, p in
                                                  enumerate(parents) if n):
            raise TargetError(f"a draft tree's parents must be [-1, p1, ...] with p_n < n: "
                              f"{parents}")
        linear = self._linear()
        if linear and not is_chain(parents):
            for i in linear:
                if not is_gated_delta_layer(self.decoder.layers[i].linear_attn):
                    raise TargetError(
                        f"target layer {i} ({type(self.decoder.layers[i].linear_attn).__name__})"
                        ": a tree on this linear-attention layer needs per-node state "
                        "stepping, which exists for Qwen3.5's Gated DeltaNet only; decode "
                        "chains (no --tree-budget) with this target")
        self._snapshot = {i: self._states(i, clone=True) for i in linear}
        self._last_parents = list(parents)
        return self._forward(tokens, parents)

    @torch.inference_mode()
    def keep(self, nodes: list[int]) -> None:
        """Keep the root and an accepted path of the last `verify` (node indices, each the
        child of the one before, nodes[0] == 0); drop every other node."""
        parents = self._last_parents
        if not nodes or nodes[0] != 0 or any(parents[b] != a for a, b in
                                              zip(nodes, nodes[1:], strict=False)):
            raise TargetError(f"keep {nodes}: not a path from the root of the last verify")
        prefix = nodes == list(range(len(nodes)))
        index = torch.tensor(nodes, device=self.target.device) + self.length
        for layer in self._layers():
            if hasattr(layer, "keys") and layer.keys is not None and layer.keys.numel():
                if prefix:
                    end = self.length + len(nodes)
                    layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
                else:
                    head = slice(None, self.length)
                    layer.keys = torch.cat([layer.keys[..., head, :],
                                            layer.keys.index_select(-2, index)], dim=-2)
                    layer.values = torch.cat([layer.values[..., head, :],
                                              layer.values.index_select(-2, index)], dim=-2)
        whole_chain = is_chain(parents) and len(nodes) == len(parents)
        if self._snapshot and not whole_chain:
            self._replay_linear(nodes)
        self.length += len(nodes)

    def _states(self, i: int, clone: bool) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self._layers()[i]
        conv, rec = layer.conv_states[0], layer.recurrent_states[0]
        return (conv.clone(), rec.clone()) if clone else (conv, rec)

    def _replay_linear(self, nodes: list[int]) -> None:
        """Set each linear-attention layer back to its snapshot and run it alone over the
        kept nodes' inputs from the verify pass: its states then follow the kept path."""
        index = torch.tensor(nodes, device=self.target.device)
        for i, (conv, rec) in self._snapshot.items():
            live_conv, live_rec = self._states(i, clone=False)
            live_conv.copy_(conv)
            live_rec.copy_(rec)
            mixer = self.decoder.layers[i].linear_attn
            mixer(hidden_states=self._inputs[i].index_select(1, index), cache=self.cache,
                  attention_mask=None)

    def _forward(self, tokens: list[int], parents: list[int]) -> Verified:
        device = self.target.device
        ids = torch.tensor([tokens], device=device)
        chain = is_chain(parents)
        kwargs = {}
        if not chain:
            depth = ancestor_mask(parents).sum(dim=1) - 1
            kwargs["position_ids"] = (depth + self.length).to(device)[None]
            kwargs["attention_mask"] = self._tree_mask(parents)
        self._inputs = {}
        with hooked_layers(self.decoder.layers, self.layer_ids) as captured, \
                self._linear_inputs(parents):
            out = self.decoder(input_ids=ids, cache=self.cache, use_cache=True, **kwargs)
        features = torch.stack([captured[k] for k in self.layer_ids], dim=2)
        return Verified(features, out.last_hidden_state[0], self.target.lm_head)

    def _tree_mask(self, parents: list[int]):
        """The additive mask [1, 1, N, cache + N] of a tree (0 where a node may look); a dict
        by layer type for a hybrid, whose linear layers take no mask."""
        dtype = self.target.dtype
        sees = ancestor_mask(parents)
        mask = torch.full((len(parents), self.length + len(parents)), torch.finfo(dtype).min,
                          dtype=dtype)
        mask[:, : self.length] = 0
        mask[:, self.length:][sees] = 0
        mask = mask[None, None].to(self.target.device)
        types = set(getattr(self.decoder.config, "layer_types", None) or ["full_attention"])
        if types == {"full_attention"}:
            return mask
        return {kind: (None if kind == "linear_attention" else mask) for kind in types}

    @contextmanager
    def _linear_inputs(self, parents: list[int]):
        """Record each linear-attention layer's input; on a tree, run it node by node."""
        linear = [] if self.cache is None or not self.length else self._linear()
        tree = not is_chain(parents)
        handles, swapped = [], []
        for i in linear:
            mixer = self.decoder.layers[i].linear_attn
            if tree:
                conv, rec = self._states(i, clone=False)

                def node_by_node(hidden_states, *args, i=i, mixer=mixer, conv=conv, rec=rec,
                                 **kwargs):
                    self._inputs[i] = hidden_states
                    return tree_forward(mixer, hidden_states, parents, conv, rec)

                mixer.forward = node_by_node
                swapped.append(mixer)
            else:
                def record(_module, args, kwargs, i=i):
                    self._inputs[i] = kwargs["hidden_states"] if "hidden_states" in kwargs \
                        else args[0]

                handles.append(mixer.register_forward_pre_hook(record, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for mixer in swapped:
                del mixer.forward
