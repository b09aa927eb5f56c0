"""The drafter forward: visibility properties, positions, flex = dense, train = live."""

import math

import pytest
import torch
import torch.nn.functional as F

import dflash_train.drafter.masks as masks
from dflash_train.drafter import ContextCache, DrafterError
from dflash_train.drafter.model import chunk_shape

from .conftest import MASK_ID, VOCAB, random_batch, tiny_dflash2, tiny_drafter

# float32 forward of a 2-layer width-64 model: reordering the same sums (SDPA vs flex vs a
# shorter key list) moves logits by ~1e-6; any visibility change moves them by > 1e-2.
SAME = dict(atol=2e-5, rtol=1e-5)
CHANGED = 1e-3


def _logits(model, features, lengths, ids, anchors, attention="dense"):
    with torch.no_grad():
        return model.forward_logits(features, lengths, ids, anchors, attention=attention)


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_and_dense_paths_give_same_logits():
    # CPU runs flex_attention eagerly (forward only): same logits as the dense SDPA path.
    for seed, overrides in enumerate([{}, {"is_causal": True}, {"sliding_window": 3}]):
        model = tiny_drafter(seed, **overrides)
        batch = random_batch(model, seed, lengths=[24, 17])
        dense = _logits(model, *batch, attention="dense")
        flex = _logits(model, *batch, attention="flex")
        torch.testing.assert_close(flex, dense, **SAME)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for compiled flex")
def test_flex_matches_dense_on_cuda_with_gradients():
    model = tiny_drafter(0).cuda().train()
    batch = [t.cuda() for t in random_batch(model, 0, lengths=[24, 17])]
    grads = {}
    for attention in ("dense", "flex"):
        model.zero_grad()
        logits = model.forward_logits(*batch, attention=attention)
        logits.float().square().mean().backward()
        grads[attention] = (logits.detach(), model.fc.weight.grad.clone())
    torch.testing.assert_close(grads["flex"][0], grads["dense"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads["flex"][1], grads["dense"][1], atol=1e-4, rtol=1e-3)


def test_context_at_or_after_the_anchor_never_reaches_the_block():
    for seed in range(8):
        model = tiny_drafter(seed)
        features, lengths, ids, anchors = random_batch(model, seed)
        base = _logits(model, features, lengths, ids, anchors)
        gen = torch.Generator().manual_seed(100 + seed)
        s, blk = seed % 2, int(torch.randint(0, 4, (), generator=gen))
        a = int(anchors[s, blk])
        j = int(torch.randint(a, 24, (), generator=gen))
        changed = features.clone()
        changed[s, j] += 3 * torch.randn(changed[s, j].shape, generator=gen)
        after = _logits(model, changed, lengths, ids, anchors)
        torch.testing.assert_close(after[s, blk], base[s, blk], **SAME)
        # Blocks with a later anchor see position j and must move: the change was real.
        later = [b for b in range(4) if int(anchors[s, b]) > j]
        for b in later:
            assert _max_diff(after[s, b], base[s, b]) > CHANGED


def test_context_before_the_anchor_reaches_the_block():
    for seed in range(8):
        model = tiny_drafter(seed)
        features, lengths, ids, anchors = random_batch(model, seed)
        base = _logits(model, features, lengths, ids, anchors)
        gen = torch.Generator().manual_seed(200 + seed)
        s, blk = seed % 2, int(torch.randint(0, 4, (), generator=gen))
        a = int(anchors[s, blk])
        j = int(torch.randint(0, a, (), generator=gen))  # anchors are >= 1
        changed = features.clone()
        changed[s, j] += 3 * torch.randn(changed[s, j].shape, generator=gen)
        after = _logits(model, changed, lengths, ids, anchors)
        assert _max_diff(after[s, blk], base[s, blk]) > CHANGED


# The properties one pass of blocks must keep hold for DFlash 2 too, whose in-block convs
# live in the same layers.
KINDS = pytest.mark.parametrize("make", [tiny_drafter, tiny_dflash2], ids=["dflash", "dflash2"])


@KINDS
def test_blocks_never_see_each_other(make):
    for seed in range(8):
        model = make(seed)
        features, lengths, ids, anchors = random_batch(model, seed)
        base = _logits(model, features, lengths, ids, anchors)
        gen = torch.Generator().manual_seed(300 + seed)
        s, blk = seed % 2, int(torch.randint(0, 4, (), generator=gen))
        other = (blk + 1 + int(torch.randint(0, 3, (), generator=gen))) % 4
        changed = ids.clone()
        changed[s, other] = torch.randint(0, VOCAB - 1, (model.config.block_size,), generator=gen)
        after = _logits(model, features, lengths, changed, anchors)
        for b in range(4):
            if b != other:
                torch.testing.assert_close(after[s, b], base[s, b], **SAME)
        assert _max_diff(after[s, other], base[s, other]) > CHANGED


def test_padding_context_is_invisible():
    model = tiny_drafter(0)
    features, lengths, ids, anchors = random_batch(model, 0, lengths=[24, 12])
    anchors[1] = torch.tensor([11, 12, 12, 12])  # anchors at or past the valid length
    base = _logits(model, features, lengths, ids, anchors)
    changed = features.clone()
    changed[1, 12:] = torch.randn_like(changed[1, 12:])
    torch.testing.assert_close(_logits(model, changed, lengths, ids, anchors), base, **SAME)


@KINDS
def test_training_forward_matches_live_forward_on_every_block(make):
    for seed, overrides in enumerate([{}, {"sliding_window": 3}, {"is_causal": False}]):
        model = make(seed, **overrides)
        features, lengths, ids, anchors = random_batch(model, seed, lengths=[24, 15])
        train = model(features, lengths, ids, anchors).detach()
        for s in range(2):
            for blk in range(4):
                a = int(anchors[s, blk])
                cache = ContextCache()
                # Feed the context the way live decoding does: in uneven committed chunks.
                for start in range(0, a, 3):
                    model.extend_context(cache, features[s:s + 1, start:min(a, start + 3)])
                assert cache.length == a
                live = model.draft_block(cache, ids[s:s + 1, blk])
                torch.testing.assert_close(live[0], train[s, blk], **SAME)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@KINDS
def test_blocks_over_a_context_cache_equal_the_training_forward_under_every_attention(make):
    # Replay's path (decode_blocks over a cache, ragged lengths, any anchors) under each
    # backend the training forward offers, against the training forward itself.
    model = make(2, sliding_window=5)
    features, lengths, ids, anchors = random_batch(model, 2, lengths=[24, 15])
    with torch.no_grad():
        want = model(features, lengths, ids, anchors, attention="dense")
        cache = ContextCache()
        model.extend_context(cache, features)
        for attention in ("dense", "split", "flex"):
            for given in (lengths, None):  # None: the whole cache, masked by the anchors
                got = model.decode_blocks(cache, given, ids, anchors, attention)
                torch.testing.assert_close(got, want, **SAME, msg=f"{attention} {given}")


def test_live_drafting_names_what_is_wrong():
    model = tiny_drafter(0)
    ids = torch.full((1, model.config.block_size), MASK_ID)
    with pytest.raises(DrafterError, match="at least one context position"):
        model.draft_block(ContextCache(), ids)
    cache = ContextCache()
    model.extend_context(cache, torch.randn(1, 5, 3, 64))
    assert model.draft_block(cache, ids).shape == (1, model.config.block_size, 64)
    with pytest.raises(DrafterError, match="block_size"):
        model.draft_block(cache, ids[:, :-1])


def _block_logits_after_changing_slot(model, slot):
    features, lengths, ids, anchors = random_batch(model, 5)
    base = _logits(model, features, lengths, ids, anchors)
    changed = ids.clone()
    changed[:, :, slot] = (changed[:, :, slot] + 7) % (VOCAB - 1)
    return base, _logits(model, features, lengths, changed, anchors)


def test_sliding_layers_are_causal_within_the_block():
    model = tiny_drafter(1, layer_types=["sliding_attention"] * 2, sliding_window=64)
    base, after = _block_logits_after_changing_slot(model, slot=2)
    torch.testing.assert_close(after[:, :, :2], base[:, :, :2], **SAME)
    assert _max_diff(after[:, :, 2:], base[:, :, 2:]) > CHANGED


def test_full_layers_are_bidirectional_within_the_block():
    model = tiny_drafter(1, layer_types=["full_attention"] * 2, sliding_window=None)
    base, after = _block_logits_after_changing_slot(model, slot=2)
    for slot in range(2):
        assert _max_diff(after[:, :, slot], base[:, :, slot]) > CHANGED


def test_sliding_window_limits_each_slot_context():
    # One sliding layer, window 6, block at a = 12: slot i sees context j > 12 + i - 6.
    model = tiny_drafter(2, num_hidden_layers=1, layer_types=["sliding_attention"],
                         sliding_window=6)
    features, lengths, ids, _ = random_batch(model, 2, n=1, k=1)
    anchors = torch.tensor([[12]])
    base = _logits(model, features, lengths, ids, anchors)
    for j, slots_that_see_it in ((6, []), (7, [0]), (9, [0, 1, 2])):
        changed = features.clone()
        changed[0, j] += 3.0
        after = _logits(model, changed, lengths, ids, anchors)
        for slot in range(4):
            moved = _max_diff(after[0, 0, slot], base[0, 0, slot])
            assert (moved > CHANGED) == (slot in slots_that_see_it), (j, slot, moved)


def _rms(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x, positions, theta):
    """RoPE on pairs (x_m, x_{m + d/2}) at angle pos * theta^(-2m/d), written out."""
    half = x.shape[-1] // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angle = positions.double()[:, None, None] * freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()],
                     dim=-1)


def _reference_block_hidden(model, features, ids, a):
    """One block at anchor a, float64, from the DFlash description (docs/reference.md §1, §3) only:
    the context it is given is features[:a], attention is computed query by query."""
    cfg = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    eps, d, b = cfg.rms_norm_eps, cfg.head_dim, cfg.block_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    ctx = _rms(features[:a].flatten(1).double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = model.target_embed_tokens[ids].double()
    positions = torch.cat([torch.arange(a), a + torch.arange(b)])
    for layer in range(cfg.num_hidden_layers):
        def p(name, layer=layer):
            return w[f"layers.{layer}.{name}.weight"]

        h = _rms(x, p("input_layernorm"), eps)
        q = _rms((h @ p("self_attn.q_proj").T).view(b, heads, d), p("self_attn.q_norm"), eps)
        q = _rotate(q, positions[a:], cfg.rope_theta)
        kv_in = torch.cat([ctx, h])
        k = _rms((kv_in @ p("self_attn.k_proj").T).view(-1, kv_heads, d),
                 p("self_attn.k_norm"), eps)
        k = _rotate(k, positions, cfg.rope_theta)
        v = (kv_in @ p("self_attn.v_proj").T).view(-1, kv_heads, d)
        causal, window = cfg.layer_is_causal(layer), cfg.layer_window(layer)
        out = torch.zeros(b, heads, d, dtype=torch.float64)
        for i in range(b):
            q_pos = a + i
            keys = []
            for m, k_pos in enumerate(positions.tolist()):
                in_block = m >= a
                if in_block and causal and k_pos > q_pos:
                    continue
                if window is not None and abs(q_pos - k_pos) >= window:
                    continue
                keys.append(m)
            for head in range(heads):
                group = head // (heads // kv_heads)
                scores = k[keys, group] @ q[i, head] / math.sqrt(d)
                out[i, head] = torch.softmax(scores, 0) @ v[keys, group]
        x = x + out.flatten(1) @ p("self_attn.o_proj").T
        h = _rms(x, p("post_attention_layernorm"), eps)
        x = x + (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p(
            "mlp.down_proj").T
    return _rms(x, w["norm.weight"], eps)


def _forward_vs_reference(model):
    features, lengths, ids, anchors = random_batch(model, 3)
    with torch.no_grad():
        hidden = model(features, lengths, ids, anchors)
    return max(
        _max_diff(hidden[s, blk].double(),
                  _reference_block_hidden(model, features[s], ids[s, blk], int(anchors[s, blk])))
        for s in range(2) for blk in range(4)
    )


def test_forward_matches_a_longhand_reference():
    model = tiny_drafter(4, sliding_window=5)
    assert _forward_vs_reference(model) < 1e-4


def test_block_positions_off_by_one_is_caught(monkeypatch):
    # Invariant 3 of docs/design.md: positions a..a+B-1. Shift them to a+1..a+B and the same
    # comparison must fail, so the test above really pins the positions.
    model = tiny_drafter(4, sliding_window=5)
    monkeypatch.setattr(
        masks, "block_position_ids",
        lambda anchors, b: anchors.unsqueeze(-1) + 1 + torch.arange(b, device=anchors.device),
    )
    assert _forward_vs_reference(model) > CHANGED


def test_matches_transformers_qwen3_when_the_block_has_no_context():
    # Anchor 0 sees no context; with causal full layers the drafter is then a plain Qwen3
    # decoder stack over the block, so HF's Qwen3Model must agree, with our weight names.
    from transformers import Qwen3Config, Qwen3Model

    model = tiny_drafter(6, layer_types=["full_attention"] * 2, sliding_window=None,
                         is_causal=True)
    cfg = model.config
    hf = Qwen3Model(Qwen3Config(
        vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=64,
        attn_implementation="eager",
    )).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("fc.", "hidden_"))}
    hf.load_state_dict({**state, "embed_tokens.weight": model.target_embed_tokens}, strict=True)
    features, lengths, ids, _ = random_batch(model, 6, n=1, k=1)
    with torch.no_grad():
        ours = model(features, lengths, ids, torch.tensor([[0]]))[0, 0]
        theirs = hf(input_ids=ids[0], position_ids=torch.arange(4)[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, theirs, **SAME)


def test_borrowed_head_is_frozen_and_not_in_state_dict(model):
    names = {name for name, _ in model.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert not any("embed" in k or "lm_head" in k for k in model.state_dict())
    assert model.target_embed_tokens is not None and not model.target_embed_tokens.requires_grad


def test_training_forward_backpropagates_into_every_parameter(model):
    features, lengths, ids, anchors = random_batch(model, 0)
    model.train()
    model.forward_logits(features, lengths, ids, anchors).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_logits_can_be_applied_in_chunks(model):
    features, lengths, ids, anchors = random_batch(model, 0)
    with torch.no_grad():
        hidden = model(features, lengths, ids, anchors)
    whole = model.logits(hidden)
    chunked = torch.cat([model.logits(part) for part in hidden.split(1, dim=1)], dim=1)
    assert whole.shape == (2, 4, 4, VOCAB)
    torch.testing.assert_close(chunked, whole, **SAME)


def test_wrong_inputs_name_what_is_wrong(model):
    features, lengths, ids, anchors = random_batch(model, 0)
    with pytest.raises(DrafterError, match="context features"):
        model(features[..., :2, :], lengths, ids, anchors)
    with pytest.raises(DrafterError, match="block_size"):
        model(features, lengths, ids[..., :3], anchors)
    with pytest.raises(DrafterError, match="anchors shape"):
        model(features, lengths, ids, anchors[:, :2])
    bare = tiny_drafter(0)
    bare.target_embed_tokens = None
    with pytest.raises(DrafterError, match="attach_target_head"):
        bare(features, lengths, ids, anchors)
    with pytest.raises(DrafterError, match="lm_head"):
        bare.attach_target_head(torch.zeros(VOCAB, 64), torch.zeros(VOCAB, 63))
    assert MASK_ID == model.config.mask_token_id


def test_gradient_checkpointing_gives_the_same_gradients():
    from dflash_train.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, vocab_size=50, intermediate_size=64,
                        target_layer_ids=[0, 1], num_target_layers=3, mask_token_id=49,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, block_size=4)
    model = DFlashDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
    context = torch.randn(2, 12, 2, 32)
    lengths = torch.tensor([12, 9])
    anchors = torch.tensor([[3, 7], [2, 5]])
    ids = torch.randint(0, 49, (2, 2, 4))

    calls = []
    # A pre-hook: recomputation stops early, right after the last activation it needs.
    model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))

    def grads(checkpointing: bool):
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        calls.clear()
        model(context, lengths, ids, anchors).pow(2).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads(False)
    assert len(calls) == 1
    recomputed = grads(True)
    assert len(calls) == 2  # the layer really ran again in backward
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-6)


def _outputs_and_grads(model, batch, attention, chunk_blocks=None):
    model.zero_grad()
    model.chunk_blocks = chunk_blocks
    hidden = model(*batch, attention=attention)
    probe = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(9))
    (hidden * probe).sum().backward()  # every output counts, with unrelated weights
    # (a DFlash 2 selector is not in the forward: it has no gradient here)
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


@pytest.mark.parametrize("overrides", [{}, {"is_causal": True}, {"sliding_window": 3},
                                       {"block_size": 16, "sliding_window": 20}],
                         ids=["sliding+full", "causal", "window-3", "b16"])
@KINDS
def test_split_and_chunked_forwards_equal_the_dense_mask_path(overrides, make):
    # The dense SDPA mask over every key is the reference; fp32, ragged sequences (one
    # shorter than the padded context), several anchor counts, sliding and full layers.
    model = make(1, **overrides).train()
    for k in (1, 7):
        batch = random_batch(model, k, n=3, t=24, k=k, lengths=[24, 17, 9])
        want, want_grads = _outputs_and_grads(model, batch, "dense")
        # chunks of 4: all 3 sequences x 1 block; of 2: 2 sequences x 1 block, then 1
        for attention, chunk in (("split", None), ("split", 4), ("dense", 2)):
            got, grads = _outputs_and_grads(model, batch, attention, chunk)
            torch.testing.assert_close(got, want, **SAME, msg=f"{attention} {chunk} k={k}")
            for name, grad in grads.items():
                scale = want_grads[name].abs().max()
                torch.testing.assert_close(grad, want_grads[name], rtol=1e-4,
                                           atol=1e-5 * scale, msg=f"{name} {attention} {chunk}")
        with torch.no_grad():
            model.chunk_blocks = 2
            torch.testing.assert_close(model(*batch), want, **SAME)


def test_chunk_shape_tiles_the_blocks_within_the_bound():
    assert chunk_shape(3, 10, None) == (3, 10)
    assert chunk_shape(3, 10, 30) == (3, 10)
    for n, k, most in [(3, 10, 7), (3, 10, 2), (5, 1, 3), (1, 9, 4), (4, 4, 1)]:
        rows, cols = chunk_shape(n, k, most)
        assert 1 <= rows <= n and 1 <= cols <= k and rows * cols <= most, (n, k, most)
    assert chunk_shape(3, 10, 7) == (3, 2)  # all sequences first, then fewer of their blocks


def test_a_chunked_forward_keeps_only_its_inputs_for_backward():
    model = tiny_drafter(0).train()
    calls = []
    model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))

    def saved_bytes(k, chunk_blocks):
        model.chunk_blocks = chunk_blocks
        batch = random_batch(model, 0, n=2, t=24, k=k)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        calls.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = model(*batch)
        hidden.sum().backward()
        return sum(storages.values()) - sum(p.numel() * 4 for p in model.parameters())

    whole = saved_bytes(16, None)
    assert len(calls) == 1
    few, many = saved_bytes(4, 4), saved_bytes(16, 4)
    assert len(calls) == 2 * 8  # 8 chunks of 2 sequences x 2 blocks, each run again
    assert many < 1.2 * few and many < 0.2 * whole, (few, many, whole)


def test_an_unknown_attention_is_refused(model):
    with pytest.raises(DrafterError, match="attention must be one of"):
        model(*random_batch(model, 0), attention="sparse")
