"""Muon for the drafter's matrices, AdamW for the rest, as one optimiser a schedule and a
checkpoint handle like AdamW alone."""

import copy

import pytest
import torch

from dflash_train.drafter import DFlashDrafter, DrafterConfig
from dflash_train.train import optimizer
from dflash_train.train.config import OptimConfig, load_train_config
from dflash_train.train.errors import TrainError
from dflash_train.train.optimizer import (
    MuonWithAdamW,
    build_optimizer,
    muon_split,
    orthogonalise,
)
from dflash_train.train.parallel import full_states, load_optimizer_state


def _drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, vocab_size=50, intermediate_size=64,
                        target_layer_ids=[0, 1], num_target_layers=3, mask_token_id=49,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, block_size=4)
    return DFlashDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))


def _fake_grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


NS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic coefficients (torch's Muon default)."""
MUON = OptimConfig(optimizer="muon", lr=2e-3, weight_decay=0.01)


def test_matrices_go_to_muon_and_norms_to_adamw_each_exactly_once():
    model = _drafter()
    matrices, others = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in matrices} == {
        n for n, p in model.named_parameters() if n.endswith("_proj.weight") or n == "fc.weight"}
    assert all(names[id(p)].endswith("norm.weight") for p in others)
    assert len(matrices) + len(others) == len(list(model.parameters()))
    assert not {id(p) for p in matrices} & {id(p) for p in others}


@pytest.mark.parametrize("codebooks", ["free", "factorised"])
def test_dflash2_codebooks_are_rows_for_adamw_and_its_projections_matrices_for_muon(codebooks):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, vocab_size=50, intermediate_size=64,
                        target_layer_ids=[0, 1], num_target_layers=3, mask_token_id=49,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, block_size=4, kind="dflash2", conv_group_size=8,
                        selector_rank=4, selector_top_k=3, selector_codebooks=codebooks)
    model = DFlashDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
    matrices, others = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    to_muon = {names[id(p)] for p in matrices}
    to_adamw = {names[id(p)] for p in others}
    assert "candidate_selector.hidden_projection.weight" in to_muon
    assert "layers.0.attention_conv.kernel_projection.weight" in to_muon
    assert "layers.0.mlp_conv.base_kernel" in to_adamw  # 3-D
    if codebooks == "free":
        assert {"candidate_selector.predecessor_codebook",
                "candidate_selector.successor_codebook"} <= to_adamw
    else:
        assert {"candidate_selector.predecessor_factor",
                "candidate_selector.successor_factor"} <= to_muon


def test_one_step_equals_torchs_muon_and_adamw_stepped_apart(monkeypatch):
    monkeypatch.setenv("DFLASH_NATIVE_BF16", "1")  # torch's bf16 Newton-Schulz, on any CPU
    model, apart = _drafter(), _drafter()
    opt = build_optimizer(model, MUON)
    assert isinstance(opt, MuonWithAdamW)
    assert [g["optimizer"] for g in opt.param_groups] == ["adamw", "muon"]
    matrices, others = muon_split(apart)
    muon = torch.optim.Muon(matrices, lr=2e-3, weight_decay=0.01,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(others, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(3):
        _fake_grads(model, step)
        _fake_grads(apart, step)
        opt.step()
        muon.step()
        adamw.step()
    for (name, a), b in zip(model.named_parameters(), apart.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_schedule_drives_both_groups_from_their_own_peak():
    model = _drafter()
    opt = build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-3, muon_lr=4e-3))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    for step in range(3):
        _fake_grads(model, step)
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [1e-3 / 8, 4e-3 / 8]
    # the inner Muon steps with the scheduled lr, not the one it was built with
    assert opt._inner["muon"].param_groups[0] is opt.param_groups[1]


def _steps(model, opt, steps) -> None:
    for step in steps:
        _fake_grads(model, step)
        opt.step()


def test_state_saved_and_loaded_continues_exactly_as_without_a_break():
    whole = _drafter()
    opt = build_optimizer(whole, MUON)
    _steps(whole, opt, range(5))

    first = _drafter()
    opt1 = build_optimizer(first, MUON)
    _steps(first, opt1, range(2))
    weights, state = full_states(first, opt1)  # what the checkpoint writes
    state = copy.deepcopy(state)
    resumed = _drafter(seed=1)
    resumed.load_state_dict(weights)
    opt2 = build_optimizer(resumed, MUON)
    load_optimizer_state(resumed, opt2, state)
    assert opt2._inner["muon"].state is opt2.state  # linked again after the load
    momentum = [opt2.state[p]["momentum_buffer"] for p in muon_split(resumed)[0]]
    assert all(m.abs().sum() > 0 for m in momentum)
    _steps(resumed, opt2, range(2, 5))
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_adamw_stays_torchs_plain_adamw():
    opt = build_optimizer(_drafter(), OptimConfig())
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1


def test_a_model_without_matrices_is_refused_for_muon():
    with pytest.raises(TrainError, match="no 2-D weight matrix"):
        build_optimizer(torch.nn.LayerNorm(8), MUON)


@pytest.mark.parametrize(("key", "value"), [
    ("optim.muon_lr", "0"), ("optim.muon_lr", "nan"), ("optim.muon_lr", "2"),
    ("optim.muon_momentum", "1"), ("optim.muon_momentum", "-0.1"),
    ("optim.muon_ns_steps", "0"), ("optim.muon_ns_steps", "100"),
    ("optim.muon_adjust_lr_fn", "moonshot"), ("optim.optimizer", "sgd"),
])
def test_bad_muon_settings_are_refused_naming_the_field(key, value):
    with pytest.raises(TrainError, match=key.replace(".", r"\.")):
        load_train_config(None, {key: value})


@pytest.mark.parametrize("native, seen", [("0", torch.float32), ("1", torch.bfloat16)])
def test_newton_schulz_runs_in_float32_where_bf16_is_emulated(monkeypatch, native, seen):
    monkeypatch.setenv("DFLASH_NATIVE_BF16", native)
    dtypes = []

    def spy(update, coefficients, steps, eps, dtype):
        out = orthogonalise(update, coefficients, steps, eps, dtype)
        dtypes.append(out.dtype)
        return out

    monkeypatch.setattr(optimizer, "orthogonalise", spy)
    model = _drafter()
    opt = build_optimizer(model, MUON)
    _steps(model, opt, range(2))
    assert dtypes and set(dtypes) == {seen}
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_float32_orthogonalisation_matches_bf16_within_bf16_rounding():
    gen = torch.Generator().manual_seed(0)
    for shape in [(64, 32), (32, 96)]:
        update = torch.randn(shape, generator=gen)
        exact = orthogonalise(update, NS, 5, 1e-7, torch.float32)
        rounded = orthogonalise(update, NS, 5, 1e-7, torch.bfloat16).float()
        assert exact.shape == rounded.shape == shape
        # five bf16 iterations (8-bit mantissa) leave ~1e-2 relative error per entry
        assert (exact - rounded).norm() / exact.norm() < 3e-2


def test_a_step_in_float32_moves_the_weights_as_the_bf16_step_does(monkeypatch):
    moved = {}
    for native in ("0", "1"):
        monkeypatch.setenv("DFLASH_NATIVE_BF16", native)
        model, start = _drafter(), _drafter()
        _steps(model, build_optimizer(model, MUON), range(3))
        moved[native] = [a - b for a, b in zip(model.parameters(), start.parameters(),
                                                 strict=True)]
    for exact, rounded in zip(moved["0"], moved["1"], strict=True):
        assert (exact - rounded).norm() <= 3e-2 * exact.norm()


def test_plain_momentum_buffer_is_not_scaled_by_the_float32_orthogonalisation():
    # without Nesterov the update IS the momentum buffer: a float32 "cast" must still copy
    buf = torch.randn(16, 8)
    kept = buf.clone()
    orthogonalise(buf, NS, 5, 1e-7, torch.float32)
    assert torch.equal(buf, kept)


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_newton_schulz_is_shared_out_by_cost_and_alike_on_every_rank(ranks):
    shapes = [torch.Size(s) for s in [(576, 576), (192, 576), (192, 576), (576, 576),
                                      (1536, 576), (1536, 576), (576, 1536), (576, 2880)]]
    owners = optimizer.newton_schulz_owners(shapes, ranks)
    assert len(owners) == len(shapes) and set(owners) <= set(range(ranks))
    if ranks == 2:  # by hand: fc, then gate / up / down, then q / o, then k / v, each to the
        # lighter rank (round robin would give 0, 1, 0, 1, ...)
        assert owners == [1, 0, 0, 1, 1, 1, 0, 0]

    def cost(shape):  # one iteration's multiply-adds, counted naively: X X^T, A A, (bA + cA^2) X
        m, n = min(shape), max(shape)
        return m * m * n + m * m * m + m * m * n

    load = [sum(cost(s) for s, o in zip(shapes, owners, strict=True) if o == r)
            for r in range(ranks)]
    # no rank carries more than its fair share plus the dearest single matrix
    assert max(load) <= sum(load) / ranks + max(map(cost, shapes))
    assert len(set(owners)) == min(ranks, len(shapes))


def _sharded_steps(rank: int, world: int, steps: int, echo):
    """Muon's steps on this rank of a gloo group: (weights, momenta, the shapes iterated
    here), whether every rank ended with the same weights and momenta, and how many
    iterations each rank ran."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ran = []
        real = optimizer.orthogonalise
        optimizer.orthogonalise = lambda update, *a: ran.append(tuple(update.shape)) or real(
            update, *a)
        model = _drafter()
        opt = build_optimizer(model, MUON, ranks=world, rank=rank)
        for step in range(steps):
            _fake_grads(model, step)
            opt.step()
        mine = ([p.detach().clone() for p in model.parameters()],
                [s["momentum_buffer"].clone() for s in opt.state.values()
                 if "momentum_buffer" in s], ran)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        alike = all(all(torch.equal(a, b) for a, b in zip(other[0] + other[1],
                                                         mine[0] + mine[1], strict=True))
                    for other in everyone)
        # plain lists: a tensor crosses the queue as a handle the exiting rank takes with it
        return ([t.tolist() for t in mine[0]], [t.tolist() for t in mine[1]], ran), alike, \
            [len(other[2]) for other in everyone]
    finally:
        optimizer.orthogonalise = real
        dist.destroy_process_group()


@pytest.mark.parametrize("native", ["1", "0"])  # bf16 iterations, or float32 ones
def test_ddp_ranks_share_the_iterations_and_step_as_one_process_does(native, monkeypatch):
    from dflash_train.ranks import in_ranks

    monkeypatch.setenv("DFLASH_NATIVE_BF16", native)  # the ranks inherit it

    (weights, momenta, _), alike, iterations = in_ranks(_sharded_steps, 3, world=2,
                                                         echo=lambda _: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank ran
    try:
        model = _drafter()
        opt = build_optimizer(model, MUON)
        for step in range(3):
            _fake_grads(model, step)
            opt.step()
    finally:
        torch.set_num_threads(threads)
    matrices, _ = muon_split(model)
    assert alike  # both ranks hold the same weights and momenta after every broadcast
    assert all(torch.equal(torch.tensor(a), b)
               for a, b in zip(weights, model.parameters(), strict=True))
    assert all(torch.equal(torch.tensor(a), s["momentum_buffer"])
               for a, s in zip(momenta, (s for s in opt.state.values() if "momentum_buffer" in s),
                               strict=True))
    # each rank iterated only its own matrices: together each matrix once a step
    assert sum(iterations) == 3 * len(matrices) and 0 < min(iterations)
