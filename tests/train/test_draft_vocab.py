"""model.draft_vocab_size: the map is the train stores' most frequent labels, the loss is the
hard CE of the softmax over those rows only, and the run's checkpoint carries the map."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from dflash_train.drafter import load_drafter
from dflash_train.store_schema import open_store
from dflash_train.train.config import load_train_config
from dflash_train.train.data import StoreLoader
from dflash_train.train.drafter_shape import most_frequent_labels
from dflash_train.train.errors import TrainError
from dflash_train.train.loader_config import LoaderConfig
from dflash_train.train.loop import train
from dflash_train.train.loss import LossConfig, slot_weights
from dflash_train.train.step import block_loss, make_blocks
from tests.train.conftest import MASK, VOCAB

DRAFT = 12


def counted_labels(url: str) -> Counter:
    """Every hard label of a store, read sample by sample: the verifier's top-1 at the
    position before each answer token."""
    counts = Counter()
    for part in open_store(url).parts():
        for sample in part.iter_samples():
            top1 = sample.topk_ids[:, 0]
            for p in range(1, len(top1)):
                if sample.loss_mask[p]:
                    counts[int(top1[p - 1])] += 1
    return counts


def test_the_map_is_the_most_frequent_labels_ties_to_the_lower_id(synthetic_store):
    counts = counted_labels(synthetic_store)
    ranked = sorted(counts, key=lambda i: (-counts[i], i))[:DRAFT]
    ids, covered = most_frequent_labels([open_store(synthetic_store)], DRAFT)
    assert ids.tolist() == sorted(ranked)
    assert covered == pytest.approx(sum(counts[i] for i in ranked) / sum(counts.values()))


def test_a_run_trains_over_the_map_and_its_checkpoint_carries_it(synthetic_store, tmp_path):
    cfg = load_train_config(None, {"stores": [synthetic_store], "run.out_dir": str(tmp_path / "r"),
                                   "model.num_hidden_layers": 1, "loader.batch_tokens": 256,
                                   "run.anchors_per_seq": 8, "optim.max_steps": 2,
                                   "run.progress": False, "loader.prefetch_batches": 0,
                                   "model.draft_vocab_size": DRAFT, "run.precision": "fp32"})
    result = train(cfg)
    model = load_drafter(result.checkpoint)
    want, _ = most_frequent_labels([open_store(synthetic_store)], DRAFT)
    assert torch.equal(model.draft_ids, want)
    rows = open_store(synthetic_store).target_rows()
    model.attach_target_head(rows["embed_tokens"], rows["lm_head"])
    assert torch.equal(model.head_weight, rows["lm_head"][want])


def test_the_loss_is_the_ce_of_the_softmax_over_the_map(synthetic_store, tmp_path):
    cfg = load_train_config(None, {"stores": [synthetic_store], "run.out_dir": str(tmp_path / "r"),
                                   "model.num_hidden_layers": 1, "optim.max_steps": 1,
                                   "run.progress": False, "loader.prefetch_batches": 0,
                                   "model.draft_vocab_size": DRAFT, "run.precision": "fp32"})
    model = load_drafter(train(cfg).checkpoint)
    rows = open_store(synthetic_store).target_rows()
    model.attach_target_head(rows["embed_tokens"], rows["lm_head"])
    batch = next(iter(StoreLoader([synthetic_store], LoaderConfig(
        batch_tokens=256, prefetch_batches=0)).epoch(0)))
    blocks = make_blocks(batch, mask_token_id=MASK, block_size=16, anchors_per_seq=8,
                         seed=0, epoch=0)
    hidden = torch.randn(*blocks.block_ids.shape, rows["lm_head"].shape[1])
    got = block_loss(hidden, blocks, model, LossConfig())
    # the whole vocabulary's logits with -inf off the map (vLLM's layout), target-id labels;
    # a label off the map has no finite loss and counts for nothing
    full = F.linear(hidden.flatten(0, 1), rows["lm_head"])
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[model.draft_ids] = False
    labels, valid = blocks.labels.flatten(0, 1), blocks.valid.flatten(0, 1)
    valid = valid & ~off[labels.clamp(min=0)]
    assert (~valid & blocks.valid.flatten(0, 1)).any(), "the store has labels off the map"
    ce = F.cross_entropy(full.masked_fill(off, float("-inf"))[valid], labels[valid],
                         reduction="none")
    w = slot_weights(valid)[valid]  # the decay weights of the slots that count
    assert torch.allclose(got, (w * ce).sum() / w.sum(), rtol=1e-5)


@pytest.mark.parametrize("setting", [{"loss.kind": "kl-topk"}, {"model.kind": "dflash2"}])
def test_a_map_is_refused_where_the_loss_reads_the_whole_vocabulary(setting):
    with pytest.raises(TrainError, match="model.draft_vocab_size"):
        load_train_config(None, {"model.draft_vocab_size": DRAFT, **setting})


def test_a_map_larger_than_the_vocabulary_is_refused(synthetic_store, tmp_path):
    cfg = load_train_config(None, {"stores": [synthetic_store], "run.out_dir": str(tmp_path / "r"),
                                   "model.draft_vocab_size": VOCAB + 1, "run.progress": False})
    with pytest.raises(TrainError, match=f"more than the target's vocabulary of {VOCAB}"):
        train(cfg)
