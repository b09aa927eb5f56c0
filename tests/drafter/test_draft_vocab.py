"""A drafter over a draft vocabulary: its logits are the target head's rows at its ids, its
drafts are target ids, and its directory holds the d2t map and lm_head rows in the layout
vLLM's DFlash model loads (draft id i drafts target id i + d2t[i])."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash_train.blocks import IGNORE_LABEL
from dflash_train.drafter import DFlashDrafter, DrafterError, load_drafter, save_drafter
from tests.drafter.conftest import HIDDEN, VOCAB, random_batch, tiny_config, tiny_drafter

IDS = torch.tensor([2, 5, 11, 17, 40, 41, 63, 77, 98, 99])


def mapped_drafter(seed: int = 0) -> DFlashDrafter:
    model = tiny_drafter(seed, draft_vocab_size=IDS.numel())
    model.set_draft_vocab(IDS)
    return model


def test_logits_are_the_target_rows_at_the_ids_and_drafts_are_target_ids():
    model = mapped_drafter()
    hidden = model(*random_batch(model, seed=1))
    full = F.linear(hidden, model.target_lm_head)
    assert torch.allclose(model.logits(hidden), full[..., IDS], atol=1e-6)
    # vLLM scatters draft logits into the whole vocabulary with -inf elsewhere
    scattered = torch.full_like(full, float("-inf"))
    scattered[..., IDS] = full[..., IDS]
    logp, ids = model.draft_topk(hidden, k=3)
    assert torch.equal(ids, scattered.topk(3, dim=-1).indices)
    assert torch.allclose(logp, torch.log_softmax(scattered, -1).topk(3, dim=-1).values,
                          atol=1e-5)
    anchors = torch.zeros(hidden.shape[:-2], dtype=torch.long)
    assert torch.equal(model.propose(hidden[..., 1:, :], anchors),
                       scattered[..., 1:, :].argmax(-1))


def test_labels_outside_the_draft_vocabulary_become_ignored():
    model = mapped_drafter()
    labels = torch.tensor([2, 3, IGNORE_LABEL, 99, 40])
    assert model.to_draft_labels(labels).tolist() == [0, IGNORE_LABEL, IGNORE_LABEL, 9, 4]


def test_the_directory_holds_vllms_d2t_and_lm_head_rows_and_loads_back(tmp_path):
    model = mapped_drafter()
    out = save_drafter(model, tmp_path / "d", dtype=torch.bfloat16)
    weights = load_file(str(out / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(IDS.numel()) + weights["d2t"], IDS)
    assert torch.equal(weights["lm_head.weight"], model.target_lm_head[IDS].bfloat16())
    config = json.loads((out / "config.json").read_text())
    assert (config["draft_vocab_size"], config["vocab_size"]) == (IDS.numel(), VOCAB)
    loaded = load_drafter(out)
    assert torch.equal(loaded.draft_ids, IDS)
    loaded.attach_target_head(model.target_embed_tokens, model.target_lm_head)
    assert torch.equal(loaded.head_weight, model.target_lm_head[IDS])


def test_another_targets_lm_head_is_refused(tmp_path):
    model = mapped_drafter()
    loaded = load_drafter(save_drafter(model, tmp_path / "d"))
    other = torch.randn(VOCAB, HIDDEN)
    with pytest.raises(DrafterError, match="trained for another target"):
        loaded.attach_target_head(model.target_embed_tokens, other)


@pytest.mark.parametrize("offsets, why", [
    (5 - torch.arange(IDS.numel()), "names a target id twice"),  # every draft id drafts 5
    (IDS - torch.arange(IDS.numel()) + 1, "outside the target's vocabulary"),
], ids=["duplicate", "out-of-range"])
def test_a_damaged_d2t_is_refused_naming_it(tmp_path, offsets, why):
    out = save_drafter(mapped_drafter(), tmp_path / "d")
    weights = load_file(str(out / "model.safetensors"))
    weights["d2t"] = offsets
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "checksums.json").unlink()
    with pytest.raises(DrafterError, match=f"d2t: .*{why}"):
        load_drafter(out)


def test_draft_vocab_size_is_checked_where_it_is_set():
    with pytest.raises(DrafterError, match=r"draft_vocab_size 101 must be .* \[2, 100\]"):
        tiny_config(draft_vocab_size=VOCAB + 1)
    with pytest.raises(DrafterError, match="draft_vocab_size 1 must be at least 2 \\(over one "
                                           "id the loss is 0 with no gradient"):
        tiny_config(draft_vocab_size=1)
    with pytest.raises(DrafterError, match="draft_vocab_size True must be an integer"):
        tiny_config(draft_vocab_size=True)
    with pytest.raises(DrafterError, match="DFlash drafters only"):
        tiny_config(draft_vocab_size=8, kind="dflash2", hidden_size=64)
    model = DFlashDrafter(tiny_config(draft_vocab_size=4))
    with pytest.raises(DrafterError, match="4 integer target ids"):
        model.set_draft_vocab(torch.tensor([1, 2, 3]))
