"""A new drafter's init: the final norm at 1/sqrt(hidden) bounds every first logit by its
head row's norm, and changes no draft against HF's init (drafter.model.FinalNormInit)."""

import pytest
import torch

from dflash_train.drafter import DFlashDrafter, DrafterError

from .conftest import DFLASH2, HIDDEN, VOCAB, random_batch, tiny_config


def new_drafter(final_norm_init: str | None = None, seed: int = 0, std: float | None = None,
                **overrides):
    """A drafter as training makes a new one, over a tied head whose rows share one
    direction (a real target's do); final_norm_init None: the default. `std`: its linears
    drawn again at this std (larger than training's 0.02: drafts that vary by slot)."""
    gen = torch.Generator().manual_seed(100 + seed)
    shared = torch.randn(HIDDEN, generator=gen)
    rows = 2.0 * shared / shared.norm() + torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    init = {} if final_norm_init is None else {"final_norm_init": final_norm_init}
    torch.manual_seed(seed)
    model = DFlashDrafter(tiny_config(**overrides), rows, rows, **init)
    if std is not None:
        model.reset_parameters(std, **({} if final_norm_init is None
                                       else {"final_norm": final_norm_init}))
    return model.eval()


def _hidden(model, seed=0):
    with torch.no_grad():
        return model(*random_batch(model, seed))


def test_a_new_drafters_outputs_are_unit_vectors_and_no_logit_exceeds_its_head_row():
    model = new_drafter()
    hidden = _hidden(model)
    norms = hidden.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-4), norms
    # Cauchy-Schwarz with |h| = 1: |<h, row>| <= |row|
    bound = model.head_weight.norm(dim=-1)
    assert (model.logits(hidden).abs() <= bound + 1e-5).all()


def test_hf_init_starts_the_logits_sqrt_hidden_larger():
    unit, ones = (new_drafter(init) for init in ("unit", "ones"))
    torch.testing.assert_close(ones.logits(_hidden(ones)),
                               unit.logits(_hidden(unit)) * HIDDEN**0.5, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [{}, DFLASH2], ids=["dflash", "dflash2"])
def test_the_final_norm_init_changes_no_draft(overrides):
    drafts = []
    for init in ("unit", "ones"):
        model = new_drafter(init, std=0.2, **overrides)
        hidden = _hidden(model)
        _, _, ids, _ = random_batch(model, 0)
        drafts.append(model.propose(hidden[:, :, 1:], ids[:, :, 0]))
    assert torch.equal(drafts[0], drafts[1])
    assert drafts[0].unique().numel() > 1  # drafts that could have differed


def test_an_unknown_final_norm_init_is_refused():
    with pytest.raises(DrafterError, match="final_norm 'zeros': must be one of unit, ones"):
        new_drafter("zeros")
