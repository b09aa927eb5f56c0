"""Conformance with the reference: our DFlash 2 drafter == z-lab's `DFlash2DraftModel`.

z-lab's `dflash==0.1.0` (the dev extra) is the reference implementation of DFlash 2
inference. One tiny drafter with random weights everywhere (convs and selector far from
their identity init) is saved by `save_drafter`; z-lab's `from_pretrained` loads that
directory (fp32, CPU) and must find every tensor and no other. Then, block by block:

- their forward runs one block per call (`dflash_generate`'s draft call without a cache:
  context = the target features before the anchor, positions 0 .. anchor + B - 1), ours
  runs all the blocks of the batch in one [N, K*B, H] pass, so the test also shows that our
  convs stop at block boundaries as theirs stop at the end of their one block;
- hidden states after the final norm and the logits through the target head agree to float
  tolerance;
- the greedy selector walk (their `propose` at temperature 0 over slots 1..B-1, from the
  anchor token) chooses the same token in every slot, and in some slot not the argmax
  logit, so the selector is exercised.

Both layer kinds are covered: the tiny shape has a sliding (causal, windowed) and a full
(bidirectional) layer. A drafter trained with factorised codebooks (A = E W, ours) exports
E W under the reference's names: z-lab's class loads that export and drafts as ours.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.drafter import export_checkpoint, load_drafter, save_drafter

from .conftest import DFLASH2, random_batch, tiny_dflash2

zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 (dev extra) is the "
                           "reference implementation")

SAME = dict(atol=2e-5, rtol=1e-5)
"""fp32, the same sums in another order (their SDPA over one block, our split/dense paths)."""


@pytest.fixture(scope="module")
def drafter():
    return tiny_dflash2(3, conv_kernel_size=3)  # 3 taps: a tap past the anchor slot too


@pytest.fixture(scope="module")
def saved(drafter, tmp_path_factory) -> str:
    return str(save_drafter(drafter, tmp_path_factory.mktemp("dflash2") / "d"))


def zlab_load(directory: str):
    model, info = zlab.DFlash2DraftModel.from_pretrained(directory, dtype=torch.float32,
                                                         output_loading_info=True)
    return model.eval(), {k: v for k, v in info.items() if v}


def zlab_block(reference, drafter, features, ids, anchor: int) -> torch.Tensor:
    """Their hidden states [B, H] of one block at `anchor` of one sequence [T, n, H]."""
    b = ids.shape[0]
    with torch.no_grad():
        return reference(
            target_hidden=features[None, :anchor].flatten(2),
            noise_embedding=drafter.target_embed_tokens[ids][None],
            position_ids=torch.arange(anchor + b)[None],
            past_key_values=None, use_cache=False,
        )[0]


def lm_head(drafter) -> torch.nn.Linear:
    head = torch.nn.Linear(drafter.config.hidden_size, drafter.config.vocab_size, bias=False)
    head.weight.data = drafter.target_lm_head.clone()
    return head


def test_zlab_loads_our_dflash2_directory_with_every_tensor(saved, drafter):
    reference, problems = zlab_load(saved)
    assert problems == {}  # nothing missing, unexpected, mismatched
    config = drafter.config
    assert (reference.block_size, reference.mask_token_id, reference.target_layer_ids) == (
        config.block_size, config.mask_token_id, config.target_layer_ids)
    conv = reference.layers[0].attention_conv
    assert (conv.kernel_size, conv.group_size, reference.candidate_selector.top_k) == (
        3, DFLASH2["conv_group_size"], DFLASH2["selector_top_k"])
    theirs = reference.state_dict()
    for name, tensor in drafter.state_dict().items():
        name = name + ".weight" if name.endswith("codebook") else name
        assert torch.equal(theirs[name], tensor), name


def test_block_forward_and_selector_walk_equal_zlabs(saved, drafter):
    reference, _ = zlab_load(saved)
    head = lm_head(drafter)
    features, lengths, ids, anchors = random_batch(drafter, 7, n=2, t=24, k=4)
    with torch.no_grad():
        ours = drafter(features, lengths, ids, anchors)  # [N, K, B, H], every block at once
        walks = drafter.propose(ours[:, :, 1:], ids[:, :, 0])
        argmax = drafter.logits(ours[:, :, 1:]).argmax(-1)
    for s in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            theirs = zlab_block(reference, drafter, features[s], ids[s, k], int(anchors[s, k]))
            torch.testing.assert_close(ours[s, k], theirs, **SAME, msg=f"block {s},{k}")
            with torch.no_grad():
                their_logits = reference.compute_logits(theirs, head)
                torch.testing.assert_close(drafter.logits(ours[s, k]), their_logits, **SAME)
                tokens, candidates, probs = reference.propose(theirs[None, 1:],
                                                              ids[s, k, :1], head, 0.0)
            assert probs is None
            assert walks[s, k].tolist() == tokens[0].tolist(), f"walk of block {s},{k}"
            # Their candidates are the top-K unsorted; ours best first: the same set.
            top = drafter.candidate_selector.candidates(drafter.logits(ours[s, k, 1:]))[1]
            assert top.sort(-1).values.tolist() == candidates[0].sort(-1).values.tolist()
    assert (walks != argmax).any(), "the selector never overrode the argmax: no teeth"


def test_the_comparison_catches_one_conv_weight_changed(saved, drafter, tmp_path):
    # Sensitivity: one mlp_conv after-kernel tap changed in the file z-lab loads moves
    # their forward away from ours well beyond the tolerance.
    state = load_file(f"{saved}/model.safetensors")
    state["layers.1.mlp_conv.base_kernel"][1, 1] += 0.5
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(f"{saved}/config.json", broken / "config.json")
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    reference, _ = zlab_load(str(broken))
    features, lengths, ids, anchors = random_batch(drafter, 7, n=1, t=24, k=1)
    with torch.no_grad():
        ours = drafter(features, lengths, ids, anchors)[0, 0]
    theirs = zlab_block(reference, drafter, features[0], ids[0, 0], int(anchors[0, 0]))
    assert (ours - theirs).abs().max() > 1e-2


@pytest.mark.parametrize("codebooks", ["bare", ".weight"])
def test_a_dir_zlab_saves_loads_in_ours_with_the_same_weights(codebooks, saved, drafter,
                                                             tmp_path):
    # z-lab's save_pretrained writes its own config field set, and the codebooks bare when
    # the model came from from_pretrained (transformers reverses the key mapping) but as
    # `.weight` tensors when it was built in-process: our loader reads every form back.
    reference, _ = zlab_load(saved)
    if codebooks == ".weight":
        built = zlab.DFlash2DraftModel(reference.config)
        built.load_state_dict(reference.state_dict())
        reference = built
    reference.save_pretrained(tmp_path / "theirs")
    names = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    suffix = "" if codebooks == "bare" else ".weight"
    assert f"candidate_selector.successor_codebook{suffix}" in names
    loaded = load_drafter(tmp_path / "theirs", kinds=("dflash", "dflash2"))
    assert loaded.config == drafter.config
    want = drafter.state_dict()
    assert sorted(loaded.state_dict()) == sorted(want)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_an_exported_factorised_drafter_loads_in_zlabs_and_drafts_as_ours(tmp_path):
    # Factorised codebooks (A = E W) are ours alone: the export writes E W under the
    # reference's names and shapes, so z-lab's class loads it unchanged and computes what
    # our factorised drafter computes.
    drafter = tiny_dflash2(4, selector_codebooks="factorised")
    saved = save_drafter(drafter, tmp_path / "trained")
    exported = export_checkpoint(saved, tmp_path / "export", dtype=None)
    reference, problems = zlab_load(str(exported))
    assert problems == {}
    head = lm_head(drafter)
    features, lengths, ids, anchors = random_batch(drafter, 5, n=2, t=24, k=2)
    with torch.no_grad():
        ours = drafter(features, lengths, ids, anchors)
        walks = drafter.propose(ours[:, :, 1:], ids[:, :, 0])
    for s in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            theirs = zlab_block(reference, drafter, features[s], ids[s, k], int(anchors[s, k]))
            torch.testing.assert_close(ours[s, k], theirs, **SAME)
            with torch.no_grad():
                tokens, _, _ = reference.propose(theirs[None, 1:], ids[s, k, :1], head, 0.0)
            assert walks[s, k].tolist() == tokens[0].tolist(), f"walk of block {s},{k}"
    with torch.no_grad():
        argmax = drafter.logits(ours[:, :, 1:]).argmax(-1)
    assert (walks != argmax).any(), "the selector never overrode the argmax: no teeth"
