"""The position-weighted block loss (decay, D-PACE) and DFlash 2's selector term against naive
restatements of their formulas."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash_train.blocks import BLOCK_SIZE, IGNORE_LABEL, BlockError
from dflash_train.drafter.dflash2 import CandidateSelector
from dflash_train.train.loss import (
    DEFAULT_GAMMA,
    Head,
    LossConfig,
    SlotTargets,
    decay_weights,
    dpace_weights,
    drafter_loss,
    selector_loss,
    slot_weights,
    topk_target_probs,
    unary_loss,
)
from dflash_train.train.step import Blocks, block_loss

V = 23
H = 6


def _ce(labels, valid, hidden, weight, **settings) -> torch.Tensor:
    """The unary loss of hidden [N, B, H] through lm_head rows `weight` [V, H]."""
    return unary_loss(Head(hidden, weight), SlotTargets(labels, valid),
                      LossConfig(**settings)).loss


def _kl(ids, tlogits, lse, valid, hidden, weight, **settings) -> torch.Tensor:
    labels = torch.full(valid.shape, IGNORE_LABEL)
    targets = SlotTargets(labels, valid, topk_ids=ids, topk_logits=tlogits, lse=lse)
    return unary_loss(Head(hidden, weight), targets, LossConfig(kind="kl-topk", **settings)).loss


def _selector(hidden, weight, labels, valid, anchors, selector, w, embed=None, **settings):
    targets = SlotTargets(labels, valid, anchor_ids=anchors)
    return selector_loss(Head(hidden, weight, embed), targets, selector, w,
                         LossConfig(**settings))


def _through_logits(logits, labels, valid, position_weights="decay", gamma=DEFAULT_GAMMA,
                    alpha=0.5):
    """The loss by autograd through the whole logits [N, B, V]: each slot's CE in fp32 or
    wider, weighed by the formulas' own weights (checked against the longhand below)."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    ce = F.cross_entropy(wide.transpose(1, 2), labels.clamp(min=0), reduction="none")
    w = slot_weights(valid, gamma) if position_weights == "decay" else \
        dpace_weights(ce.detach(), valid, alpha)
    w = w.to(ce.dtype)
    return (w * torch.where(valid, ce, 0.0)).sum() / w.sum()


def _batch(seed: int, n: int = 4, block: int = BLOCK_SIZE, p_valid: float = 0.7):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, block, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    valid = torch.rand(n, block, generator=gen) < p_valid
    valid[:, 0] = False
    labels = torch.randint(0, V, (n, block), generator=gen)
    labels[~valid] = IGNORE_LABEL
    return hidden, weight, labels, valid


def _naive_ce(logits, labels, valid, gamma):
    num, den = 0.0, 0.0
    n, block, _ = logits.shape
    for i in range(n):
        for k in range(1, block):
            if not valid[i, k]:
                continue
            w = math.exp(-(k - 1) / gamma)
            logp = torch.log_softmax(logits[i, k].double(), dim=-1)
            num += w * -float(logp[labels[i, k]])
            den += w
    return num / den


def test_project_default_gamma_is_ten():
    assert DEFAULT_GAMMA == 10.0
    assert LossConfig().gamma == 10.0 and LossConfig().kind == "ce"


def test_decay_weights_follow_the_formula_and_skip_the_anchor():
    for gamma in [1.0, 7.0, 10.0]:
        w = decay_weights(BLOCK_SIZE, gamma)
        assert w[0] == 0.0
        for k in range(1, BLOCK_SIZE):
            assert w[k].item() == pytest.approx(math.exp(-(k - 1) / gamma), rel=1e-6)
    assert decay_weights()[1] == 1.0


def test_slot_weights_zero_exactly_where_labels_are_invalid():
    _, _, _, valid = _batch(0)
    w = slot_weights(valid)
    assert torch.equal(w > 0, valid)


@pytest.mark.parametrize("gamma", [7.0, 10.0, 2.5])
def test_ce_loss_matches_a_naive_loop(gamma):
    hidden, weight, labels, valid = _batch(1)
    got = _ce(labels, valid, hidden, weight, gamma=gamma)
    assert got.item() == pytest.approx(_naive_ce(hidden @ weight.T, labels, valid, gamma),
                                       rel=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 5, 10_000])
def test_chunked_head_equals_autograd_through_the_logits_in_value_and_gradient(chunk_rows):
    hidden, weight, labels, valid = _batch(2)
    h1 = hidden.clone().requires_grad_()
    h2 = hidden.clone().requires_grad_()
    from_logits = _through_logits(h1 @ weight.T, labels, valid)
    from_hidden = _ce(labels, valid, h2, weight, chunk_rows=chunk_rows)
    torch.testing.assert_close(from_hidden, from_logits)
    from_logits.backward()
    from_hidden.backward()
    torch.testing.assert_close(h2.grad, h1.grad)


def test_hidden_path_never_saves_full_logits_for_backward():
    hidden, weight, labels, valid = _batch(3, n=8)
    valid[:, 1:] = True
    weight = torch.randn(2000, H, dtype=torch.float64)
    labels = torch.randint(0, 2000, labels.shape)
    rows = int(valid.sum())
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    h = hidden.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _ce(labels, valid, h, weight, chunk_rows=16)
    loss.backward()
    assert max(saved) < 16 * 2000 <= rows * 2000
    assert h.grad is not None and h.grad.abs().sum() > 0

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _through_logits(h @ weight.T, labels, valid)
    assert max(saved) >= rows * 2000  # the check above would catch an unchunked path


def _lm_head_flops(weight_requires_grad: bool) -> int:
    """FLOPs of one forward + backward of the hidden path, with the lm_head frozen or not."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, _, labels, valid = _batch(3, n=8)
    valid[:, 1:] = True
    weight = torch.randn(500, H, dtype=torch.float64, requires_grad=weight_requires_grad)
    labels = torch.randint(0, 500, labels.shape)
    h = hidden.clone().requires_grad_()
    with FlopCounterMode(display=False) as counter:
        _ce(labels, valid, h, weight, chunk_rows=16).backward()
    return counter.get_total_flops(), int(valid.sum()) * 500 * H * 2


def test_frozen_lm_head_costs_two_matmuls_per_row_not_three():
    # logits, then their input gradient built in the same pass; recomputing the logits in
    # backward (the path a trainable lm_head still takes) would be a third
    frozen, one_matmul = _lm_head_flops(False)
    assert frozen == 2 * one_matmul
    trainable, _ = _lm_head_flops(True)
    assert trainable >= 3 * one_matmul


@pytest.mark.parametrize("position_weights", ["decay", "dpace"])
def test_chunked_head_under_bf16_autocast_matches_autograd_through_the_logits(position_weights):
    hidden, weight, labels, valid = _batch(6, n=6)
    hidden, weight = hidden.float() * 3, weight.float()
    grads, losses = [], []
    for via_logits in (True, False):
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _through_logits(F.linear(h, weight), labels, valid, position_weights) \
                if via_logits else _ce(labels, valid, h, weight, chunk_rows=7,
                                       position_weights=position_weights)
        loss.backward()
        losses.append(loss)
        grads.append(h.grad)
    torch.testing.assert_close(losses[1], losses[0])
    # both round the logits' gradient to bf16 before the matmul back to H
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-3)


def test_slots_without_labels_get_no_gradient():
    hidden, weight, labels, valid = _batch(4)
    h = hidden.clone().requires_grad_()
    _ce(labels, valid, h, weight, chunk_rows=3).backward()
    assert torch.all(h.grad[~valid] == 0)
    assert torch.all(h.grad[valid].abs().sum(-1) > 0)


def test_no_valid_slot_gives_an_attached_zero():
    hidden, weight, labels, valid = _batch(5)
    valid[:] = False
    h = hidden.clone().requires_grad_()
    loss = _ce(labels, valid, h, weight)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(h.grad == 0)


@pytest.mark.parametrize("position_weights", ["decay", "dpace"])
def test_the_global_sum_replaces_the_local_weight_sum(position_weights):
    hidden, weight, labels, valid = _batch(6)
    cfg = LossConfig(position_weights=position_weights)
    head, targets = Head(hidden, weight), SlotTargets(labels, valid)
    local = unary_loss(head, targets, cfg).loss
    seen = []

    def three_ranks(local_sum):  # as if two more ranks held the same weight sum
        seen.append(local_sum.item())
        return 3 * local_sum

    scaled = unary_loss(head, targets, cfg, global_sum=three_ranks).loss
    assert scaled.item() == pytest.approx(local.item() / 3, rel=1e-9)
    if position_weights == "decay":
        assert seen == [pytest.approx(float(slot_weights(valid).sum()), rel=1e-6)]


def test_the_global_sum_is_called_by_a_rank_without_a_valid_slot():
    hidden, weight, labels, valid = _batch(6)
    valid[:] = False
    calls = []
    for kind in ["decay", "dpace"]:
        loss = unary_loss(Head(hidden, weight), SlotTargets(labels, valid),
                          LossConfig(position_weights=kind),
                          global_sum=lambda t: calls.append(t.item()) or t + 5.0).loss
        assert loss.item() == 0.0
    assert calls == [0.0, 0.0]  # it joined the all-reduce with nothing of its own


def test_bf16_autocast_stays_close_to_fp64():
    hidden, weight, labels, valid = _batch(7)
    exact = _ce(labels, valid, hidden, weight).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        approx = _ce(labels, valid, hidden.float(), weight.float(), chunk_rows=8)
    assert approx.dtype == torch.float32
    assert approx.item() == pytest.approx(exact, rel=0.05)


def test_shape_mismatches_and_missing_targets_are_refused():
    hidden, weight, labels, valid = _batch(8)
    with pytest.raises(BlockError, match="labels"):
        SlotTargets(labels[:, :-1], valid)
    with pytest.raises(BlockError, match="hidden"):
        _ce(labels, valid, hidden[:, :-1], weight)
    with pytest.raises(BlockError, match="top-k"):
        unary_loss(Head(hidden, weight), SlotTargets(labels, valid), LossConfig(kind="kl-topk"))
    with pytest.raises(BlockError, match="anchor"):
        _selector(hidden, weight, labels, valid, None, None, slot_weights(valid))
    with pytest.raises(BlockError):
        LossConfig(kind="dpace")
    with pytest.raises(BlockError):
        LossConfig(gamma=0)


# --- D-PACE position weights (an option, never the default) ---------------------------


def _longhand_dpace(logits, labels, valid, alpha):
    """D-PACE written out slot by slot: (loss, weights) in plain floats."""
    num, den, weights = 0.0, 0.0, []
    for i in range(len(logits)):
        ce = {}
        for k in range(1, len(logits[i])):
            if valid[i][k]:
                row = [float(x) for x in logits[i][k]]
                top = max(row)
                lse = top + math.log(sum(math.exp(x - top) for x in row))
                ce[k] = lse - row[labels[i][k]]
        reach, prod = {}, 1.0  # P_j = prod_{i<=j} s_i, with s = 1 where no label
        for k in range(1, len(logits[i])):
            if k in ce:
                prod *= (1 - alpha) * math.exp(-ce[k]) + alpha
            reach[k] = prod
        block = [0.0] * len(logits[i])
        for j in ce:
            block[j] = sum(reach[m] for m in ce if m >= j)
            num += block[j] * ce[j]
            den += block[j]
        weights.append(block)
    return num / den, weights


def _dpace_example():
    """Three blocks of 6 slots: a gap at slot 3, every slot masked, every slot labelled."""
    gen = torch.Generator().manual_seed(21)
    hidden = torch.randn(3, 6, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (3, 6), generator=gen)
    valid = torch.tensor([[0, 1, 1, 0, 1, 1],
                          [0, 0, 0, 0, 0, 0],
                          [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    labels[~valid] = IGNORE_LABEL
    return hidden, weight, labels, valid


@pytest.mark.parametrize("alpha", [0.5, 0.0, 0.2, 1.0])
def test_dpace_loss_and_weights_match_the_longhand(alpha):
    hidden, weight, labels, valid = _dpace_example()
    logits = hidden @ weight.T
    want_loss, want_w = _longhand_dpace(logits.tolist(), labels.tolist(), valid.tolist(), alpha)
    got = unary_loss(Head(hidden, weight), SlotTargets(labels, valid),
                     LossConfig(position_weights="dpace", dpace_alpha=alpha))
    assert got.loss.item() == pytest.approx(want_loss, rel=1e-9)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0),
                                           reduction="none")
    w = dpace_weights(ce, valid, alpha)
    torch.testing.assert_close(w.double(), torch.tensor(want_w, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    # handed back: the weights the loss used (from its own CE, equal to rounding)
    torch.testing.assert_close(got.slot_weights, w, rtol=1e-12, atol=0)
    assert torch.all(w[1] == 0) and torch.all(w[:, 0] == 0) and w[0, 3] == 0
    # the gap multiplies by 1: slot 4 still sees slots 1 and 2's confidence
    assert w[0, 4] > 0 and w[0, 1] > w[0, 2] > w[0, 4] > w[0, 5] > 0


def test_dpace_with_alpha_one_counts_the_supervised_slots_ahead():
    _, _, _, valid = _dpace_example()
    w = dpace_weights(torch.rand(valid.shape) * 5, valid, 1.0)
    expected = torch.tensor([[0, 4, 3, 0, 2, 1], [0] * 6, [0, 5, 4, 3, 2, 1]],
                            dtype=torch.float32)
    assert torch.equal(w, expected)


@pytest.mark.parametrize("chunk_rows", [1, 4, 10_000])
def test_dpace_gradient_treats_the_weights_as_constants(chunk_rows):
    hidden, weight, labels, valid = _dpace_example()
    logits = hidden @ weight.T
    _, want_w = _longhand_dpace(logits.tolist(), labels.tolist(), valid.tolist(), 0.5)
    w = torch.tensor(want_w, dtype=torch.float64)
    h1 = hidden.clone().requires_grad_()
    h2 = hidden.clone().requires_grad_()
    ce = torch.nn.functional.cross_entropy((h1 @ weight.T).transpose(1, 2),
                                           labels.clamp(min=0), reduction="none")
    constant = (w * ce * valid).sum() / w.sum()  # q held fixed: no d w / d logits term
    dpace = _ce(labels, valid, h2, weight, position_weights="dpace", chunk_rows=chunk_rows)
    torch.testing.assert_close(dpace, constant)
    constant.backward()
    dpace.backward()
    torch.testing.assert_close(h2.grad, h1.grad)
    assert torch.all(h2.grad[~valid] == 0)


def test_dpace_on_all_masked_slots_is_a_finite_attached_zero():
    hidden, weight, labels, valid = _dpace_example()
    valid[:] = False
    h = hidden.clone().requires_grad_()
    loss = _ce(labels, valid, h, weight, position_weights="dpace")
    assert math.isfinite(loss.item()) and loss.item() == 0.0
    loss.backward()
    assert torch.all(h.grad == 0)
    assert torch.equal(dpace_weights(torch.zeros(valid.shape), valid), torch.zeros(valid.shape))


def test_dpace_stays_finite_when_every_confidence_underflows():
    hidden, weight, labels, valid = _dpace_example()
    hidden = hidden * 1e4  # CE in the thousands: q = exp(-CE) is exactly 0
    for alpha in [0.0, 0.5]:
        loss = _ce(labels, valid, hidden, weight, position_weights="dpace", dpace_alpha=alpha)
        assert math.isfinite(loss.item()), alpha


def test_dpace_settings_are_checked():
    assert LossConfig().position_weights == "decay" and LossConfig().dpace_alpha == 0.5
    assert LossConfig(position_weights="dpace", dpace_alpha=0.0).dpace_alpha == 0.0
    for alpha in [-0.1, 1.5, float("nan"), float("inf")]:
        with pytest.raises(BlockError, match="dpace_alpha"):
            LossConfig(position_weights="dpace", dpace_alpha=alpha)
    with pytest.raises(BlockError, match="needs kind 'ce'"):
        LossConfig(kind="kl-topk", position_weights="dpace")
    with pytest.raises(BlockError, match="position_weights"):
        LossConfig(position_weights="exp")


# --- kl-topk (an option, never the default) -------------------------------------------


def _soft_targets(seed: int, n: int, k: int, verifier_logits=None):
    gen = torch.Generator().manual_seed(seed)
    if verifier_logits is None:
        verifier_logits = 3 * torch.randn(n, BLOCK_SIZE, V, generator=gen, dtype=torch.float64)
    top = verifier_logits.topk(k, dim=-1)
    lse = torch.logsumexp(verifier_logits, dim=-1)
    return top.indices, top.values, lse


def _naive_kl(logits, ids, tlogits, lse, valid, gamma):
    num, den = 0.0, 0.0
    for i in range(logits.shape[0]):
        for k in range(1, logits.shape[1]):
            if not valid[i, k]:
                continue
            w = math.exp(-(k - 1) / gamma)
            logq = torch.log_softmax(logits[i, k].double(), dim=-1)
            slot = 0.0
            for j in range(ids.shape[-1]):
                p = math.exp(float(tlogits[i, k, j] - lse[i, k]))
                slot += p * (math.log(p) - float(logq[ids[i, k, j]]))
            num += w * slot
            den += w
    return num / den


def test_topk_probs_are_softmax_probabilities():
    ids, tlogits, lse = _soft_targets(9, 2, V)
    probs = topk_target_probs(tlogits, lse)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, BLOCK_SIZE), rtol=0, atol=1e-5)


def test_kl_topk_matches_a_naive_loop_and_ignores_mass_outside_topk():
    hidden, weight, _, valid = _batch(10)
    logits = hidden @ weight.T
    ids, tlogits, lse = _soft_targets(11, hidden.shape[0], 4)
    got = _kl(ids, tlogits, lse, valid, hidden, weight, gamma=7.0)
    assert got.item() == pytest.approx(_naive_kl(logits, ids, tlogits, lse, valid, 7.0), rel=1e-5)


def test_kl_topk_is_zero_when_the_drafter_reproduces_the_verifier():
    hidden, weight, _, valid = _batch(12)
    logits = hidden @ weight.T
    ids, tlogits, lse = _soft_targets(0, hidden.shape[0], V, verifier_logits=logits.clone())
    loss = _kl(ids, tlogits, lse, valid, hidden, weight)
    assert abs(loss.item()) < 1e-6


def test_kl_topk_in_chunks_equals_autograd_through_the_logits():
    hidden, weight, _, valid = _batch(13)
    ids, tlogits, lse = _soft_targets(14, hidden.shape[0], 5)
    h1 = hidden.clone().requires_grad_()
    h2 = hidden.clone().requires_grad_()
    logq = torch.log_softmax(h1 @ weight.T, -1).gather(-1, ids)
    p = topk_target_probs(tlogits, lse).double()
    w = slot_weights(valid).double()
    a = (w * (torch.xlogy(p, p) - p * logq).sum(-1)).sum() / w.sum()
    b = _kl(ids, tlogits, lse, valid, h2, weight, chunk_rows=3)
    torch.testing.assert_close(b, a)
    a.backward()
    b.backward()
    torch.testing.assert_close(h2.grad, h1.grad)


def test_kl_topk_with_one_hot_target_equals_hard_ce():
    hidden, weight, labels, valid = _batch(15)
    ids = labels.clamp(min=0).unsqueeze(-1)  # top-1 only, all mass on the label
    tlogits = torch.zeros(ids.shape, dtype=torch.float64)
    lse = torch.zeros(labels.shape, dtype=torch.float64)
    soft = _kl(ids, tlogits, lse, valid, hidden, weight)
    hard = _ce(labels, valid, hidden, weight)
    torch.testing.assert_close(soft, hard)


# -- DFlash 2: the selector term ----------------------------------------------------------

SELECTOR_RANK, SELECTOR_TOP = 3, 4


def _selector_example(seed: int = 0):
    """Blocks whose labels sit inside their slot's top-K at some slots and outside at
    others, a gap (slot 3 of row 1 unlabelled: slot 4 there has no predecessor), and a
    selector with every table random, so the pairwise term is not 0."""
    gen = torch.Generator().manual_seed(seed)
    n, block = 4, 6
    hidden = torch.randn(n, block, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    selector = CandidateSelector(H, V, SELECTOR_RANK, SELECTOR_TOP).double()
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    order = (hidden @ weight.T).argsort(-1, descending=True)
    labels = torch.empty(n, block, dtype=torch.long)
    for i in range(n):
        for k in range(block):
            inside = (i * block + k) % 3 != 0
            rank = (i + k) % SELECTOR_TOP if inside else SELECTOR_TOP + (i + k) % (V - 5)
            labels[i, k] = order[i, k, rank]
    valid = torch.ones(n, block, dtype=torch.bool)
    valid[:, 0] = False
    valid[1, 3] = valid[2, 5] = False
    labels[~valid] = IGNORE_LABEL
    anchors = torch.randint(0, V, (n,), generator=gen)
    return hidden, weight, labels, valid, anchors, selector


def _longhand_selector(hidden, weight, labels, valid, anchors, selector, w, rule):
    """The selector term one scalar at a time, from the tables as nested lists."""
    h_all, e = hidden.tolist(), weight.tolist()
    a = selector.predecessor_codebook.tolist()
    b = selector.successor_codebook.tolist()
    p = selector.hidden_projection.weight.tolist()  # [r, H]
    labels, valid, w = labels.tolist(), valid.tolist(), w.tolist()
    num = den = 0.0
    for i, row in enumerate(h_all):
        for k in range(1, len(row)):
            if not valid[i][k] or (k > 1 and not valid[i][k - 1]):
                continue
            h = row[k]
            z = [sum(e[v][j] * h[j] for j in range(H)) for v in range(V)]
            cands = sorted(range(V), key=lambda v: -z[v])[:SELECTOR_TOP]
            y, pred = labels[i][k], int(anchors[i]) if k == 1 else labels[i][k - 1]
            if y not in cands:
                if rule == "drop":
                    continue
                if rule == "strict":
                    den += w[i][k]
                    continue
                cands = cands[:-1] + [y]
            ph = [sum(p[r][j] * h[j] for j in range(H)) for r in range(SELECTOR_RANK)]
            s = [z[c] + sum(a[pred][r] * ph[r] * b[c][r] for r in range(SELECTOR_RANK))
                 for c in cands]
            top = max(s)
            lse = top + math.log(sum(math.exp(x - top) for x in s))
            num += w[i][k] * (lse - s[cands.index(y)])
            den += w[i][k]
    return num / den


@pytest.mark.parametrize("rule", ["strict", "drop", "inject"])
def test_selector_term_matches_the_longhand_under_each_out_of_top_k_rule(rule):
    hidden, weight, labels, valid, anchors, selector = _selector_example()
    logits = hidden @ weight.T
    inside = (logits.topk(SELECTOR_TOP, -1).indices == labels[..., None]).any(-1) & valid
    assert inside.any() and (valid & ~inside).any()  # both cases occur
    w = slot_weights(valid, 3.0).double()
    got = _selector(hidden, weight, labels, valid, anchors, selector, w,
                    selector_out_of_top_k=rule, chunk_rows=5)
    want = _longhand_selector(hidden, weight, labels, valid, anchors, selector, w, rule)
    assert got.item() == pytest.approx(want, rel=1e-9)


def test_selector_term_is_the_same_in_value_and_gradient_however_it_is_chunked():
    """Chunks recompute their gathered rows in backward; the sums must not see the seams."""
    results = []
    for chunk_rows in (1, 5, 10_000):
        hidden, weight, labels, valid, anchors, selector = _selector_example()
        hidden.requires_grad_(True)
        loss = _selector(hidden, weight, labels, valid, anchors, selector,
                         slot_weights(valid, 3.0).double(), chunk_rows=chunk_rows)
        loss.backward()
        results.append((loss.detach(), hidden.grad,
                        [p.grad.clone() for p in selector.parameters()]))
    (loss0, grad0, params0), *rest = results
    assert grad0.abs().sum() > 0 and all(g.abs().sum() > 0 for g in params0)
    for loss, grad, params in rest:
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, grad0, rtol=1e-10, atol=1e-12)
        for got, want in zip(params, params0, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_three_rules_differ_and_strict_is_drop_scaled_by_the_coverage():
    hidden, weight, labels, valid, anchors, selector = _selector_example()
    w = slot_weights(valid, 3.0).double()
    got = {rule: _selector(hidden, weight, labels, valid, anchors, selector, w,
                           selector_out_of_top_k=rule).item()
           for rule in ("strict", "drop", "inject")}
    assert len({round(v, 9) for v in got.values()}) == 3
    pred_known = valid.clone()
    pred_known[:, 2:] &= valid[:, 1:-1]
    inside = (hidden @ weight.T).topk(SELECTOR_TOP, -1).indices == labels[..., None]
    inside = inside.any(-1) & pred_known
    coverage = float((w * inside).sum() / (w * pred_known).sum())
    assert got["strict"] == pytest.approx(got["drop"] * coverage, rel=1e-9)


@pytest.mark.parametrize("rule, selector_grad", [("strict", False), ("drop", False),
                                                 ("inject", True)])
def test_a_slot_outside_the_top_k_trains_the_selector_only_when_injected(rule, selector_grad):
    hidden, weight, labels, valid, anchors, selector = _selector_example()
    hidden.requires_grad_(True)
    outside = (1, 0)  # (row, slot) positions: labels[i, k] with (i * 6 + k) % 3 == 0
    i, k = 0, 3
    assert (i * 6 + k) % 3 == 0 and valid[i, k] and valid[i, k - 1] and outside
    _selector(hidden, weight, labels, valid, anchors, selector,
              slot_weights(valid, 3.0).double(), selector_out_of_top_k=rule).backward()
    assert bool(hidden.grad[i, k].abs().sum() > 0) == selector_grad
    assert hidden.grad[0, 2].abs().sum() > 0  # a slot inside its top-K always trains


def test_a_fresh_selector_gets_a_gradient_for_its_zero_successor_codebook():
    hidden, weight, labels, valid, anchors, _ = _selector_example()
    fresh = CandidateSelector(H, V, SELECTOR_RANK, SELECTOR_TOP).double()
    assert torch.all(fresh.successor_codebook == 0)
    _selector(hidden, weight, labels, valid, anchors, fresh,
              slot_weights(valid, 3.0).double()).backward()
    assert fresh.successor_codebook.grad.abs().sum() > 0


def test_factorised_codebooks_give_the_loss_of_the_free_ones_they_materialise():
    hidden, weight, labels, valid, anchors, _ = _selector_example()
    gen = torch.Generator().manual_seed(5)
    embed = torch.randn(V, H, generator=gen, dtype=torch.float64)
    factorised = CandidateSelector(H, V, SELECTOR_RANK, SELECTOR_TOP, "factorised").double()
    with torch.no_grad():
        for p in factorised.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    free = CandidateSelector(H, V, SELECTOR_RANK, SELECTOR_TOP).double()
    with torch.no_grad():
        free.hidden_projection.weight.copy_(factorised.hidden_projection.weight)
        for name, table in factorised.materialised(embed).items():
            getattr(free, name).copy_(table)
    w = slot_weights(valid, 3.0).double()
    got = _selector(hidden, weight, labels, valid, anchors, factorised, w, embed=embed)
    want = _selector(hidden, weight, labels, valid, anchors, free, w)
    assert got.item() == pytest.approx(want.item(), rel=1e-9)
    with pytest.raises(ValueError, match="token embedding"):
        _selector(hidden, weight, labels, valid, anchors, factorised, w)


@pytest.mark.parametrize("position_weights", ["decay", "dpace"])
def test_block_loss_adds_the_selector_term_weighed_as_the_unary_one(position_weights):
    hidden, weight, labels, valid, anchors, selector = _selector_example()
    n, block = labels.shape
    blocks = Blocks(anchors=torch.ones(2, n // 2, dtype=torch.long),
                    block_ids=torch.cat([anchors[:, None], torch.zeros(n, block - 1,
                                                                       dtype=torch.long)], 1)
                    .view(2, n // 2, block),
                    labels=labels.view(2, n // 2, block), valid=valid.view(2, n // 2, block))
    cfg = LossConfig(position_weights=position_weights, gamma=3.0, selector_weight=0.7)
    drafter = SimpleNamespace(candidate_selector=selector, target_embed_tokens=None,
                              head_weight=weight)
    got = block_loss(hidden.view(2, n // 2, block, H), blocks, drafter, cfg)
    logits = hidden @ weight.T
    unary = _through_logits(logits, labels, valid, position_weights, gamma=3.0)
    if position_weights == "dpace":
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0),
                                               reduction="none")
        w = dpace_weights(ce, valid)
    else:
        w = slot_weights(valid, 3.0)
    term = _longhand_selector(hidden, weight, labels, valid, anchors, selector, w.double(),
                              "strict")
    assert got.item() == pytest.approx(unary.item() + 0.7 * term, rel=1e-6)
    dflash = SimpleNamespace(candidate_selector=None, target_embed_tokens=None,
                             head_weight=weight)
    plain = block_loss(hidden.view(2, n // 2, block, H), blocks, dflash, cfg)
    assert plain.item() == pytest.approx(unary.item(), rel=1e-9)  # DFlash: no selector


def test_selector_settings_are_checked():
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(BlockError, match="selector_weight"):
            LossConfig(selector_weight=bad)
    with pytest.raises(BlockError, match="selector_out_of_top_k"):
        LossConfig(selector_out_of_top_k="keep")


def test_the_loss_hands_back_the_decay_weights_it_weighed_both_terms_by():
    hidden, weight, labels, valid, anchors, selector = _selector_example()
    cfg = LossConfig(gamma=3.0, selector_weight=0.7)
    targets = SlotTargets(labels, valid, anchor_ids=anchors)
    got = drafter_loss(Head(hidden, weight), targets, cfg, selector)
    assert torch.equal(got.slot_weights, slot_weights(valid, 3.0))
    term = _longhand_selector(hidden, weight, labels, valid, anchors, selector,
                              slot_weights(valid, 3.0).double(), "strict")
    unary = _naive_ce(hidden @ weight.T, labels, valid, 3.0)
    assert got.loss.item() == pytest.approx(unary + 0.7 * term, rel=1e-6)
