"""The DFlash 2 kind: identity init, the convolution and the walk longhand, config, files."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.drafter import (
    DFlashDrafter,
    DrafterError,
    export_checkpoint,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from dflash_train.drafter.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from dflash_train.drafter.hf_config import config_to_dict
from dflash_train.drafter.model import dflash2_from

from .conftest import DFLASH2, HIDDEN, random_batch, tiny_config, tiny_dflash2, tiny_drafter

DFLASH2_KEYS = {"attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight"}
BOTH = ("dflash", "dflash2")
SELECTOR_KEYS = {"candidate_selector.hidden_projection.weight",
                 "candidate_selector.predecessor_codebook",
                 "candidate_selector.successor_codebook"}


def test_a_fresh_dflash2_drafter_computes_what_the_dflash_one_does():
    dflash = tiny_drafter(4)
    fresh = DFlashDrafter(tiny_config(**DFLASH2))
    missing, unexpected = fresh.load_state_dict(dflash.state_dict(), strict=False)
    layers = {f"layers.{i}.{key}" for i in range(2) for key in DFLASH2_KEYS}
    assert (set(missing), unexpected) == (layers | SELECTOR_KEYS, [])
    fresh.attach_target_head(dflash.target_embed_tokens, dflash.target_lm_head)
    batch = random_batch(dflash, 4)
    with torch.no_grad():
        want, got = dflash(*batch), fresh(*batch)
        assert torch.equal(got, want)  # exact: the identity convs add zeros
        anchors = batch[2][:, :, 0]
        assert torch.equal(fresh.propose(got[:, :, 1:], anchors),
                           dflash.propose(want[:, :, 1:], anchors))
        # ...and the walk then is each slot's argmax (pairwise term 0, whatever the anchor).
        assert torch.equal(fresh.propose(got[:, :, 1:], anchors),
                           fresh.logits(got[:, :, 1:]).argmax(-1))


def longhand_conv(x, base, delta, group_size, block_size):
    """conv(x; base + delta)[i, c] = sum_t (base[t, c] + delta[i, t, c // g]) * x[i-t, c],
    i - t inside i's block, one scalar at a time."""
    out = torch.zeros_like(x)
    n, length, h = x.shape
    for s in range(n):
        for i in range(length):
            for t in range(base.shape[0]):
                if i % block_size - t < 0:
                    continue
                for c in range(h):
                    weight = base[t, c] + delta[s, i, t, c // group_size]
                    out[s, i, c] += weight * x[s, i - t, c]
    return out


def test_the_convolution_is_the_in_block_causal_sum_longhand():
    torch.manual_seed(0)
    k, g, b = 3, 4, 4
    conv = GroupedDynamicCausalConv(16, k, g, b)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x, y = torch.randn(2, 3 * b, 16), torch.randn(2, 3 * b, 16)  # 3 blocks per row
    with torch.no_grad():
        deltas = conv.kernel_projection(x).view(2, 3 * b, 2, k, 16 // g)
        before, after = conv.prepare(x)
        finished = conv.finish(y, after)
    torch.testing.assert_close(before, longhand_conv(x, conv.base_kernel[0], deltas[:, :, 0],
                                                     g, b))
    torch.testing.assert_close(finished, longhand_conv(y, conv.base_kernel[1], deltas[:, :, 1],
                                                       g, b))


def test_a_fresh_convolution_is_the_exact_identity():
    conv = GroupedDynamicCausalConv(HIDDEN, 2, 16, 4)
    x = torch.randn(3, 8, HIDDEN)
    before, after = conv.prepare(x)
    assert torch.equal(before, x) and torch.equal(conv.finish(x, after), x)


def test_the_walk_picks_the_best_candidate_given_the_token_chosen_before():
    torch.manual_seed(1)
    selector = CandidateSelector(8, 30, rank=4, top_k=5)
    with torch.no_grad():
        for param in selector.parameters():
            param.normal_()
    hidden, logits = torch.randn(2, 6, 8), torch.randn(2, 6, 30)
    anchors = torch.tensor([3, 17])
    with torch.no_grad():
        walk = selector.walk(hidden, logits, anchors)
        projected = selector.hidden_projection(hidden)
    a, b = selector.predecessor_codebook.detach(), selector.successor_codebook.detach()
    for s in range(2):
        previous = int(anchors[s])
        for slot in range(6):
            top = sorted(range(30), key=lambda v: -logits[s, slot, v])[:5]
            score = {v: float(logits[s, slot, v] + (a[previous] * projected[s, slot] * b[v]).sum())
                     for v in top}
            previous = max(score, key=score.get)
            assert int(walk[s, slot]) == previous, f"row {s} slot {slot}"
    assert not torch.equal(walk, logits.argmax(-1))  # the pairwise term changed some choice


def test_the_walk_takes_any_leading_shape():
    model = tiny_dflash2(2)
    features, lengths, ids, anchors = random_batch(model, 2)
    with torch.no_grad():
        hidden = model(features, lengths, ids, anchors)[:, :, 1:]  # [N, K, B-1, H]
        walks = model.propose(hidden, ids[:, :, 0])
        for s in range(2):
            for k in range(4):
                one = model.propose(hidden[s, k][None], ids[s, k, :1])[0]
                assert torch.equal(walks[s, k], one)
        # chunked over blocks (logits [S, V] of `chunk_blocks` blocks at a time): the same walks
        for chunk in (1, 3):
            assert torch.equal(model.propose(hidden, ids[:, :, 0], chunk_blocks=chunk), walks)


def test_the_convs_learn_from_their_identity_init():
    # The identity is no dead point: the training forward sends gradients into both convs'
    # projections and base kernels (the selector learns from its own loss, not this one).
    model = DFlashDrafter(tiny_config(**DFLASH2))
    model.attach_target_head(torch.randn(100, HIDDEN), torch.randn(100, HIDDEN))
    model.train()
    model.forward_logits(*random_batch(model, 0)).square().mean().backward()
    for name, param in model.named_parameters():
        if name.startswith("candidate_selector."):
            assert param.grad is None, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("field, value, words", [
    ("kind", "eagle3", "kind 'eagle3'"),
    ("conv_group_size", 24, "conv_group_size 24 does not divide hidden_size 64"),
    ("conv_kernel_size", 0, "conv_kernel_size 0"),
    ("selector_rank", 0, "selector_rank 0"),
    ("selector_top_k", 101, "selector_top_k 101 exceeds the vocabulary"),
])
def test_invalid_dflash2_config_names_the_field(field, value, words):
    with pytest.raises(DrafterError, match=words):
        tiny_config(**{**DFLASH2, field: value})


def test_dflash2_fields_are_not_checked_for_a_dflash_drafter():
    assert tiny_config(conv_group_size=24).kind == "dflash"


def test_describe_names_the_dflash2_shape():
    assert tiny_config(**DFLASH2).describe().endswith(
        "; DFlash 2: convs of 2 taps in groups of 16, selector rank 8 over the top 5, free "
        "codebooks")
    assert "DFlash 2" not in tiny_config().describe()


def test_dflash2_round_trip_writes_the_published_names_and_fields(tmp_path):
    model = tiny_dflash2(5)
    out = save_drafter(model, tmp_path / "d")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in DFLASH2 if k != "kind"} == {
        k: v for k, v in DFLASH2.items() if k != "kind"}
    names = set(load_file(str(out / "model.safetensors")))
    dflash_names = set(tiny_drafter(5).state_dict())
    layers = {f"layers.{i}.{key}" for i in range(2) for key in DFLASH2_KEYS}
    assert names == dflash_names | layers | SELECTOR_KEYS
    loaded = load_drafter(out, kinds=BOTH)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_dflash2_loads_only_where_the_caller_takes_it_and_exports(tmp_path):
    # A caller that drafts by argmax logits would measure a DFlash 2 drafter with its
    # selector off, so load_drafter refuses it unless the caller opts in.
    model = tiny_dflash2(6)
    out = save_drafter(model, tmp_path / "d")
    with pytest.raises(DrafterError, match=r"a DFlash2DraftModel \(dflash2\) drafter; this "
                       r"step takes DFlashDraftModel only .*selector walk"):
        load_drafter(out)
    exported = export_checkpoint(out, tmp_path / "export", dtype=None)
    assert json.loads((exported / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"]
    again = load_drafter(exported, kinds=BOTH)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_dflash_config_is_written_as_before():
    raw = config_to_dict(tiny_config(), torch.float32)
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert not set(DFLASH2) & set(raw["dflash_config"])


@pytest.mark.parametrize("change, words", [
    ({"architectures": ["DFlashDraftModel"]}, "conv_kernel_size is a DFlash 2 field"),
    ({"architectures": ["DFlashDraftModel", "DFlash2DraftModel"]}, "architectures"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"output_multiplier": 0.5}, "output_multiplier"),
    ({"input_embedding_scale": 2.0}, "input_embedding_scale"),
])
def test_dflash2_configs_we_do_not_implement_are_refused_by_name(tmp_path, change, words):
    raw = config_to_dict(tiny_config(**DFLASH2), torch.float32)
    scoped = {k: v for k, v in change.items() if k != "architectures"}
    raw["dflash_config"].update(scoped)
    raw.update({k: v for k, v in change.items() if k == "architectures"})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match=words):
        load_drafter(tmp_path)


def test_dflash2_fields_are_read_from_the_top_level_too(tmp_path):
    # z-lab's loader reads each field from dflash_config first, then the top level.
    raw = config_to_dict(tiny_config(**DFLASH2), torch.float32)
    raw["selector_top_k"] = raw["dflash_config"].pop("selector_top_k")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_drafter_config(tmp_path).selector_top_k == DFLASH2["selector_top_k"]


# -- factorised codebooks (A = E W) and the warm start --------------------------------------

FACTOR_KEYS = {"candidate_selector.predecessor_factor", "candidate_selector.successor_factor"}


def test_factorised_codebooks_are_e_times_w_and_walk_as_the_free_ones_they_make(tmp_path):
    model = tiny_dflash2(8, selector_codebooks="factorised")
    selector = model.candidate_selector
    assert not {"predecessor_codebook", "successor_codebook"} & set(dict(
        selector.named_parameters()))
    assert selector.successor_factor.abs().sum() > 0  # moved off its zero init
    tables = selector.materialised(model.target_embed_tokens)
    e = model.target_embed_tokens
    torch.testing.assert_close(tables["predecessor_codebook"], e @ selector.predecessor_factor)
    free = DFlashDrafter(tiny_config(**DFLASH2))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_factor")}
    state |= {f"candidate_selector.{k}": v for k, v in tables.items()}
    free.load_state_dict(state)
    free.attach_target_head(model.target_embed_tokens, model.target_lm_head)
    batch = random_batch(model, 9)
    with torch.no_grad():
        hidden = model(*batch)
        walk = model.propose(hidden[:, :, 1:], batch[2][:, :, 0])
        assert torch.equal(walk, free.propose(hidden[:, :, 1:], batch[2][:, :, 0]))
        assert not torch.equal(walk, model.logits(hidden[:, :, 1:]).argmax(-1))


def test_a_factorised_drafter_saves_factors_and_e_w_and_exports_the_reference_names(tmp_path):
    model = tiny_dflash2(8, selector_codebooks="factorised")
    out = save_drafter(model, tmp_path / "d")
    raw = json.loads((out / "config.json").read_text())
    assert raw["dflash_config"]["selector_codebooks"] == "factorised"
    names = set(load_file(str(out / "model.safetensors")))
    free_names = set(tiny_dflash2(8).state_dict())
    assert names == free_names | FACTOR_KEYS
    trained = load_drafter(out, kinds=BOTH)  # as training resumes it: the factors
    assert trained.config == model.config
    assert all(torch.equal(trained.state_dict()[k], v) for k, v in model.state_dict().items())
    engine = load_drafter(out, kinds=BOTH, materialise=True)  # as eval and engines see it
    assert engine.config.selector_codebooks == "free"
    e_w = model.candidate_selector.materialised(model.target_embed_tokens)
    assert torch.equal(engine.candidate_selector.successor_codebook, e_w["successor_codebook"])
    exported = export_checkpoint(out, tmp_path / "export", dtype=None)
    raw = json.loads((exported / "config.json").read_text())
    assert "selector_codebooks" not in raw["dflash_config"]
    assert set(load_file(str(exported / "model.safetensors"))) == free_names
    detached = DFlashDrafter(model.config)  # no target head: E W cannot be written
    with pytest.raises(DrafterError, match="factorised selector codebooks needs the target"):
        save_drafter(detached, tmp_path / "nohead")
    assert not (tmp_path / "nohead").exists()


def test_a_warm_start_copies_the_backbone_and_starts_as_the_dflash_drafter():
    dflash = tiny_drafter(10)
    for codebooks in ("free", "factorised"):
        warm = dflash2_from(dflash, conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                            selector_top_k=5, selector_codebooks=codebooks)
        assert warm.config.kind == "dflash2" and warm.config.conv_kernel_size == 3
        for name, tensor in dflash.state_dict().items():
            assert torch.equal(warm.state_dict()[name], tensor), name
        batch = random_batch(dflash, 11)
        with torch.no_grad():
            want, got = dflash(*batch), warm(*batch)
            assert torch.equal(got, want)
            assert torch.equal(warm.propose(got[:, :, 1:], batch[2][:, :, 0]),
                               dflash.logits(want[:, :, 1:]).argmax(-1))
    with pytest.raises(DrafterError, match="takes a DFlash drafter"):
        dflash2_from(tiny_dflash2(1))


def test_a_factorised_codebook_materialises_in_row_chunks_as_one_product(monkeypatch):
    from dflash_train.drafter import dflash2

    # small integers: every product and partial sum is exact in float64, so the chunked rows
    # must equal the one product bit for bit whatever order the BLAS kernel sums in (with
    # random floats a kernel picked per row count rounded 6 of 515 values differently here)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randint(-8, 9, (103, 12), generator=gen).to(torch.bfloat16)
    factor = torch.randint(-8, 9, (12, 5), generator=gen).double()
    whole = embed.double() @ factor
    for rows in (1, 10, 103, 1000):
        monkeypatch.setattr(dflash2, "CODEBOOK_ROWS", rows)
        got = dflash2.embedded_codebook(embed, factor)
        assert got.dtype == torch.float64 and got.shape == (103, 5)
        torch.testing.assert_close(got, whole, rtol=0, atol=0)


def _dflash2_step(model, batch, attention, labels=None):
    """The DFlash 2 training loss (unary CE + selector term, train.loss.drafter_loss) of one
    batch, its gradients taken: (loss, {parameter name: gradient}, labels). Labels default to
    picks inside each slot's top-K, so that the selector term counts."""
    from dflash_train.train.loss import Head, LossConfig, SlotTargets, drafter_loss

    features, lengths, ids, anchors = batch
    model.zero_grad(set_to_none=True)
    hidden = model(features, lengths, ids, anchors, attention=attention).flatten(0, 1)
    if labels is None:
        with torch.no_grad():
            top = model.logits(hidden).topk(model.config.selector_top_k, dim=-1).indices
            pick = torch.arange(hidden.shape[0] * hidden.shape[1], device=top.device) % 3
            labels = top.gather(-1, pick.view(hidden.shape[:2])[..., None]).squeeze(-1)
    valid = torch.ones_like(labels, dtype=torch.bool)
    valid[:, 0] = False
    head = Head(hidden, model.head_weight, model.target_embed_tokens)
    targets = SlotTargets(labels, valid, anchor_ids=ids[:, :, 0].flatten())
    loss = drafter_loss(head, targets, LossConfig(), model.candidate_selector).loss
    if not torch.is_grad_enabled():
        return loss, {}, labels
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}, labels


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_dflash2_loss_is_the_same_under_flex_and_dense():
    # CPU runs flex eagerly, forward only; the CUDA test below takes gradients compiled.
    model = tiny_dflash2(5).train()
    batch = random_batch(model, 5, lengths=[24, 17])
    with torch.no_grad():
        dense, _, labels = _dflash2_step(model, batch, "dense")
        flex, _, _ = _dflash2_step(model, batch, "flex", labels)
    assert dense > 0
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for compiled flex")
def test_dflash2_convs_and_selector_match_dense_under_compiled_flex_on_cuda():
    model = tiny_dflash2(5).cuda().train()
    batch = [t.cuda() for t in random_batch(model, 5, lengths=[24, 17])]
    dense_loss, dense, labels = _dflash2_step(model, batch, "dense")
    flex_loss, flex, _ = _dflash2_step(model, batch, "flex", labels)
    torch.testing.assert_close(flex_loss, dense_loss, atol=1e-4, rtol=1e-4)
    assert any("_conv." in n for n in dense) and any("selector" in n for n in dense)
    assert set(flex) == set(dense)
    for name, grad in dense.items():  # convs, selector, fc and every layer
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(flex[name], grad, atol=1e-4, rtol=1e-3, msg=name)
