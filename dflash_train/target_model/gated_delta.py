"""Gated DeltaNet (Qwen3.5's linear attention) run over a draft tree: every node's convolution
window and recurrent state follow its own path from the root, so siblings never see each other.

transformers runs the layer over one sequence; a tree is many sequences sharing prefixes. The
layer's own projections and gated norm are reused here; the two parts that read earlier
tokens are done per node (the math of the layer's one-token recurrent form):
- the causal depthwise convolution (kernel K) of node n reads the inputs of its K-1 nearest
  ancestors, then the cached inputs before the root, then its own;
- the gated delta rule steps node n's state from its parent's (the cached state for the root):
  S = exp(g) S_parent, S += k (beta (v - S^T k))^T, out = S^T q, with q and k l2-normalised
  and q scaled by 1/sqrt(d_k).
Nodes of one depth step together: one step per depth, and a [nodes, heads, d_k, d_v] state per
layer while that layer runs. The cache is read, never written (target_model/cached.py sets the
state of the path it keeps). Never loads or runs a whole model.
"""

import torch
import torch.nn.functional as F
from torch import nn

LAYER_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log",
               "dt_bias", "norm", "out_proj")
"""The submodules and parameters of transformers' Qwen3_5GatedDeltaNet this module reads."""


def is_gated_delta_layer(module: nn.Module) -> bool:
    """Whether `module` has the layout tree_forward computes (Qwen3.5's Gated DeltaNet)."""
    return all(hasattr(module, name) for name in LAYER_PARTS) and \
        getattr(module, "activation", None) == "silu"


def window_rows(parents: list[int], kernel: int, cached: int) -> torch.Tensor:
    """Per node, the K rows of [cached inputs; node inputs] its convolution reads, oldest
    first: long [N, K]. Node n's own input is row `cached + n`; past the root the window goes
    on into the cached rows, newest (row cached - 1) first."""
    rows = []
    for n in range(len(parents)):
        window, node, back = [], n, 0
        while len(window) < kernel:
            if node >= 0:
                window.append(cached + node)
                node = parents[node]
            else:
                back += 1
                window.append(cached - back)
        rows.append(window[::-1])
    return torch.tensor(rows, dtype=torch.long)


def _conv(layer: nn.Module, x: torch.Tensor, parents: list[int],
          conv_state: torch.Tensor) -> torch.Tensor:
    """The layer's causal depthwise convolution + activation per node: x [N, C] -> [N, C]."""
    weight = layer.conv1d.weight[:, 0, :]  # [C, K], tap K-1 reads the node itself
    kernel = weight.shape[-1]
    past = conv_state[0].transpose(0, 1)  # [K_state, C], oldest first
    table = torch.cat([past.to(weight.dtype), x.to(weight.dtype)])
    windows = table[window_rows(parents, kernel, past.shape[0]).to(x.device)]  # [N, K, C]
    out = (windows * weight.transpose(0, 1)).sum(dim=1)
    if layer.conv1d.bias is not None:
        out = out + layer.conv1d.bias
    return F.silu(out).to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def _delta_rule(q, k, v, g, beta, parents: list[int], state: torch.Tensor) -> torch.Tensor:
    """Outputs [N, Hv, dv] of the gated delta rule stepped node by node from each parent's
    state (`state` [1, Hv, dk, dv] before the root); inputs float32 [N, Hv, d] / [N, Hv]."""
    depths = _depths(parents)
    parent = torch.tensor(parents, device=q.device)
    states = q.new_empty(q.shape[0], *state.shape[1:])
    out = v.new_empty(v.shape)
    for d in range(max(depths) + 1):
        idx = torch.tensor([n for n, nd in enumerate(depths) if nd == d], device=q.device)
        before = state.float().expand(len(idx), -1, -1, -1) if d == 0 else states[parent[idx]]
        s = before * g[idx].exp()[..., None, None]
        remembered = (s * k[idx][..., None]).sum(dim=-2)
        delta = (v[idx] - remembered) * beta[idx][..., None]
        s = s + k[idx][..., None] * delta[..., None, :]
        out[idx] = (s * q[idx][..., None]).sum(dim=-2)
        states[idx] = s
    return out


@torch.no_grad()
def tree_forward(layer: nn.Module, hidden: torch.Tensor, parents: list[int],
                 conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
    """The layer's output [1, N, H] for tree nodes hidden [1, N, H] (parents[n] < n, -1 for
    the root), after the cached states (conv [1, C, K_state], recurrent [1, Hv, dk, dv])."""
    n_nodes = hidden.shape[1]
    h = hidden[0]
    x = _conv(layer, layer.in_proj_qkv(h), parents, conv_state)
    q, k, v = torch.split(x, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(n_nodes, -1, layer.head_k_dim)
    k = k.reshape(n_nodes, -1, layer.head_k_dim)
    v = v.reshape(n_nodes, -1, layer.head_v_dim)
    if layer.num_v_heads != layer.num_k_heads:  # each key head serves consecutive value heads
        q = q.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
        k = k.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
    beta = layer.in_proj_b(h).sigmoid().float()
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(h).float() + layer.dt_bias)
    q = _l2norm(q.float()) / (layer.head_k_dim ** 0.5)
    k = _l2norm(k.float())
    out = _delta_rule(q, k, v.float(), g, beta, parents, recurrent_state).to(hidden.dtype)
    z = layer.in_proj_z(h).reshape(-1, layer.head_v_dim)
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z)
    return layer.out_proj(out.reshape(1, n_nodes, -1))
