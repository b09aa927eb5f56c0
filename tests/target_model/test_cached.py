"""The cached target verifies trees (and chains) as a full recompute of each root path would,
and keeps exactly the accepted path: attention-only (tiny Qwen3) and hybrid (tiny Qwen3.5)."""

import random

import pytest
import torch

from dflash_train.assets.tiny import save_qwen3, save_qwen3_5
from dflash_train.target_model import cached as cached_module
from dflash_train.target_model.cached import CachedTarget, ancestor_mask
from dflash_train.target_model.capture import forward_states
from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.loading import load_target
from dflash_train.target_model.verifier import verifier_topk

LAYERS = [0, 1, 2]


@pytest.fixture(scope="module", params=["attention", "hybrid"])
def target(request, tmp_path_factory):
    save = save_qwen3 if request.param == "attention" else save_qwen3_5
    path = save(tmp_path_factory.mktemp(request.param))
    return load_target(path, device="cpu", dtype=torch.float32, load_as="causal-lm",
                       progress=False)


def recomputed(target, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """Features and argmax at the last of `tokens`, from a forward over all of them."""
    ids = torch.tensor([tokens], device=target.device)
    context, final = forward_states(target.decoder, LAYERS, ids, torch.ones_like(ids))
    top, _, _ = verifier_topk(final[0], target.lm_head, 1)
    return context[0, -1], int(top[-1, 0])


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 rounding of a different order of operations (a cache, a tree
    mask, the delta rule stepped per node instead of chunked): 1e-4 of the largest value."""
    return float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_ancestor_mask_sees_ancestors_and_self_only():
    sees = ancestor_mask([-1, 0, 0, 1, 3, 2])
    assert [torch.nonzero(row).flatten().tolist() for row in sees] == \
        [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4], [0, 2, 5]]


def check_rounds(target, rounds: int = 6) -> None:
    """Prefill, then rounds of chains and random trees: every node's features and argmax
    equal a recompute over its root path; after each, a chain, a prefix or a branch is kept."""
    rng = random.Random(0)
    committed = [rng.randrange(5, 300) for _ in range(11)]
    cached = CachedTarget(target, LAYERS)
    prefill = cached.prefill(committed)
    for t in range(len(committed)):
        features, top1 = recomputed(target, committed[: t + 1])
        assert close(prefill.features[0, t], features)
        assert prefill.top1(t) == top1
    for round_ in range(rounds):
        n = 10
        chain = round_ % 3 == 0
        parents = list(range(-1, n - 1)) if chain else \
            [-1] + [rng.randrange(0, m) for m in range(1, n)]
        tokens = [rng.randrange(5, 300) for _ in range(n)]
        out = cached.verify(tokens, parents)
        for node in range(n):
            path = committed + [tokens[m] for m in root_path(parents, node)]
            features, top1 = recomputed(target, path)
            assert close(out.features[0, node], features), (round_, node)
            assert out.top1(node) == top1, (round_, node)
        # keep a whole chain, a prefix, or a random branch
        last = n - 1 if round_ == 0 else rng.randrange(0, n)
        kept = root_path(parents, last)
        out.keep(kept)
        committed += [tokens[m] for m in kept]
        assert cached.length == len(committed)


def test_every_node_sees_what_a_recompute_of_its_root_path_sees(target):
    check_rounds(target)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_hybrid_every_node_sees_what_a_recompute_sees(tmp_path):
    """On CUDA transformers runs Gated DeltaNet through fla's kernels when fla is installed
    (its chunked rule continuing from the cached state); the tree path steps nodes in torch."""
    path = save_qwen3_5(tmp_path / "hybrid")
    check_rounds(load_target(path, device="cuda", dtype=torch.float32, load_as="causal-lm",
                             progress=False))


def test_keep_refuses_what_is_not_a_root_path(target):
    cached = CachedTarget(target, LAYERS)
    cached.prefill([5, 6, 7])
    pending = cached.verify([8, 9, 10, 11], [-1, 0, 0, 1])
    with pytest.raises(TargetError, match="not a path from the root"):
        pending.keep([0, 2, 3])  # 3 is 1's child, not 2's
    with pytest.raises(TargetError, match="parents"):
        cached.verify([8, 9], [0, 0])


def test_a_tree_on_an_unknown_linear_layer_is_refused_by_name(target, monkeypatch):
    cached = CachedTarget(target, LAYERS)
    cached.prefill([5, 6, 7])
    monkeypatch.setattr(cached_module, "is_gated_delta_layer", lambda _layer: False)
    if not any(hasattr(layer, "linear_attn") for layer in target.decoder.layers):
        cached.verify([8, 9, 10], [-1, 0, 0])  # attention only: nothing to step per node
        return
    with pytest.raises(TargetError, match=r"target layer 0 \(Qwen3_5GatedDeltaNet\).*"
                                          r"Qwen3.5's Gated DeltaNet only"):
        cached.verify([8, 9, 10], [-1, 0, 0])
    cached.verify([8, 9, 10], [-1, 0, 1])  # a chain is the layer's own sequence: fine


def test_the_head_runs_only_on_the_nodes_a_walk_asks_for(target, monkeypatch):
    # A round reads the target's argmax along the accepted path only: the [V, H] head on 64
    # tree nodes (or on every prompt token) would cost more than the path it decides.
    rows = []

    def counting(hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return verifier_topk(hidden, *args, **kwargs)

    monkeypatch.setattr(cached_module, "verifier_topk", counting)
    cached = CachedTarget(target, LAYERS)
    prefill = cached.prefill([5, 6, 7, 8, 9])
    assert rows == []
    last = prefill.top1(-1)
    assert rows == [1] and prefill.top1(4) == last and rows == [1]
    out = cached.verify([last, 20, 21, 22, 23, 24], [-1, 0, 1, 2, 0, 4])
    first = out.top1(0)
    out.top1(0)
    out.top1(4)
    assert rows == [1, 1, 1]
    assert first == recomputed(target, [5, 6, 7, 8, 9, last])[1]


def cache_states(cached: CachedTarget) -> list[torch.Tensor]:
    """Every tensor the cache holds: attention keys/values, linear conv/recurrent states."""
    out = []
    for layer in cached.cache.layers:
        if hasattr(layer, "recurrent_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


@pytest.mark.parametrize("shape", ["whole chain", "chain prefix", "tree branch"])
def test_keep_leaves_the_cache_a_prefill_of_the_committed_tokens_leaves(target, shape):
    cached = CachedTarget(target, LAYERS)
    cached.prefill([5, 6, 7, 8])
    tokens = [9, 10, 11, 12, 13]
    parents, path = {"whole chain": ([-1, 0, 1, 2, 3], [0, 1, 2, 3, 4]),
                     "chain prefix": ([-1, 0, 1, 2, 3], [0, 1, 2]),
                     "tree branch": ([-1, 0, 0, 2, 1], [0, 1, 4])}[shape]
    cached.verify(tokens, parents).keep(path)
    fresh = CachedTarget(target, LAYERS)
    fresh.prefill([5, 6, 7, 8] + [tokens[n] for n in path])
    assert cached.length == fresh.length == 4 + len(path)
    got, want = cache_states(cached), cache_states(fresh)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(close(g, w) for g, w in zip(got, want, strict=True))


def test_a_pending_verify_is_kept_once(target):
    cached = CachedTarget(target, LAYERS)
    cached.prefill([5, 6, 7])
    pending = cached.verify([8, 9, 10], [-1, 0, 0])
    assert cached.pending is pending
    pending.keep([0, 2])
    assert cached.pending is None and cached.length == 5
    with pytest.raises(TargetError, match="no longer pending .its path was kept already"):
        pending.keep([0, 2])
    assert cached.length == 5


def test_a_verify_while_one_is_pending_is_refused_and_the_pending_one_still_keeps(target):
    cached = CachedTarget(target, LAYERS)
    cached.prefill([5, 6, 7])
    pending = cached.verify([8, 9, 10], [-1, 0, 1])
    with pytest.raises(TargetError, match="verify while the last verify is pending"):
        cached.verify([8, 9], [-1, 0])
    pending.keep([0, 1, 2])
    nxt = cached.verify([11, 12], [-1, 0])
    assert nxt.top1(1) == recomputed(target, [5, 6, 7, 8, 9, 10, 11, 12])[1]


def test_a_prefill_drops_the_pending_verify(target):
    cached = CachedTarget(target, LAYERS)
    with pytest.raises(TargetError, match="verify before prefill"):
        cached.verify([8, 9], [-1, 0])
    cached.prefill([5, 6, 7])
    stale = cached.verify([8, 9], [-1, 0])
    cached.prefill([5, 6])
    with pytest.raises(TargetError, match="a prefill started a new sequence since"):
        stale.keep([0])
    assert cached.length == 2
    cached.verify([8], [-1]).keep([0])  # the new sequence goes on as usual


def test_linear_layers_are_tapped_once_and_run_as_their_own_outside_a_verify(target,
                                                                           monkeypatch):
    mixers = [layer.linear_attn for layer in target.decoder.layers
              if hasattr(layer, "linear_attn")]  # none on the attention-only target
    CachedTarget(target, LAYERS)
    taps = [m.forward for m in mixers]
    CachedTarget(target, LAYERS)  # a second cached target shares the first one's taps
    assert [m.forward for m in mixers] == taps
    assert all(tap.armed is None for tap in taps)
    # the no-cache loop runs the same model: an unarmed tap computes what the layer does
    tapped = recomputed(target, [5, 6, 7, 8])
    for m in mixers:
        monkeypatch.delattr(m, "forward")
    plain = recomputed(target, [5, 6, 7, 8])
    assert torch.equal(tapped[0], plain[0]) and tapped[1] == plain[1]
