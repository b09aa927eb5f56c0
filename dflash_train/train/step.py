"""One training batch turned into anchored blocks, labels and the loss, and how the drafts
of its blocks did.

Labels and which slots count are built from the stored verifier ids and loss mask BEFORE noise
exists; noise is then added to a copy of the context that only the drafter's fc sees.
"""

from dataclasses import dataclass

import torch

from dflash_train.blocks import (
    IGNORE_LABEL,
    anchor_generator,
    block_input_ids,
    block_labels,
    draft_topk,
    sample_anchors,
    verifier_rows,
)
from dflash_train.evaluate.metrics import AcceptanceStats
from dflash_train.train.batch import Batch
from dflash_train.train.epoch_plan import SampleRef
from dflash_train.train.loss import GlobalSum, Head, LossConfig, SlotTargets, drafter_loss
from dflash_train.train.noise import NoiseConfig, add_context_noise
from dflash_train.train.record import BatchAccuracy


@dataclass
class Blocks:
    """K anchored blocks per sequence; padding blocks have no valid slot."""

    anchors: torch.Tensor  # long [N, K]
    block_ids: torch.Tensor  # long [N, K, B]
    labels: torch.Tensor  # long [N, K, B], IGNORE_LABEL where invalid
    valid: torch.Tensor  # bool [N, K, B]
    target_ids: torch.Tensor | None = None  # long [N, K, B, k]: verifier top-k per slot
    target_logits: torch.Tensor | None = None  # float [N, K, B, k]
    target_lse: torch.Tensor | None = None  # float [N, K, B]


def sample_uid(ref: SampleRef) -> int:
    """A stable integer per stored sample: anchors depend on it, not on batch or rank."""
    return (ref.store << 48) | (ref.part << 24) | ref.index


def make_blocks(
    batch: Batch,
    *,
    mask_token_id: int,
    block_size: int,
    anchors_per_seq: int,
    seed: int,
    epoch: int,
    soft_targets: bool = False,
    pad_blocks_to: int = 1,
) -> Blocks:
    """Sample this epoch's anchors for every sequence and build their blocks and labels.

    Blocks per sequence are rounded up to a multiple of `pad_blocks_to` with label-less
    padding blocks (few distinct shapes for compiled kernels; the loss is unchanged)."""
    per_seq = []
    for row, ref in enumerate(batch.refs):
        n = int(batch.lengths[row])
        mask = batch.loss_mask[row, :n]
        gen = anchor_generator(seed, epoch, sample_uid(ref))
        per_seq.append(sample_anchors(mask, anchors_per_seq, gen))
    # a rank with no sample in this step (data.empty_batch) still has one row: no anchors
    rows = len(batch.lengths)
    per_seq += [torch.zeros(0, dtype=torch.long)] * (rows - len(per_seq))
    k = -(-max([1] + [a.numel() for a in per_seq]) // pad_blocks_to) * pad_blocks_to
    out = Blocks(
        anchors=torch.ones(rows, k, dtype=torch.long),
        block_ids=torch.full((rows, k, block_size), mask_token_id, dtype=torch.long),
        labels=torch.full((rows, k, block_size), IGNORE_LABEL, dtype=torch.long),
        valid=torch.zeros(rows, k, block_size, dtype=torch.bool),
    )
    if soft_targets:
        top_k = batch.topk_ids.shape[-1]
        out.target_ids = torch.zeros(rows, k, block_size, top_k, dtype=torch.long)
        out.target_logits = torch.zeros(rows, k, block_size, top_k)
        out.target_lse = torch.zeros(rows, k, block_size)
    for row, anchors in enumerate(per_seq):
        m = anchors.numel()
        if m == 0:
            continue
        n = int(batch.lengths[row])
        out.anchors[row, :m] = anchors
        out.block_ids[row, :m] = block_input_ids(batch.input_ids[row, :n], anchors,
                                                 mask_token_id, block_size)
        labels, valid = block_labels(batch.topk_ids[row, :n], batch.loss_mask[row, :n], anchors,
                                     block_size)
        out.labels[row, :m], out.valid[row, :m] = labels, valid
        if soft_targets:
            out.target_ids[row, :m] = verifier_rows(batch.topk_ids[row, :n], anchors, block_size)
            out.target_logits[row, :m] = verifier_rows(batch.topk_logits[row, :n], anchors,
                                                       block_size)
            out.target_lse[row, :m] = verifier_rows(batch.lse[row, :n], anchors, block_size)
    return out


def noised_context(
    batch: Batch,
    layer_rms: torch.Tensor | None,
    cfg: NoiseConfig,
    *,
    seed: int,
    epoch: int,
    step: int,
    device: torch.device,
) -> torch.Tensor:
    """The fc input of a batch: each sample's context plus noise drawn from a generator keyed
    by (seed, epoch, sample), so the noise a sample gets does not depend on its batch or rank.
    Returns a new tensor; the batch is untouched."""
    context = batch.context.to(device)
    if cfg.kind == "none":
        return context
    out = context.clone()
    for row, ref in enumerate(batch.refs):
        n = int(batch.lengths[row])
        # Offset the key so the noise stream never coincides with the anchor stream.
        key = anchor_generator(seed + 0x5EED, epoch, sample_uid(ref)).initial_seed()
        gen = torch.Generator(device).manual_seed(key)
        out[row, :n] = add_context_noise(context[row, :n], layer_rms, cfg, gen, step=step)
    return out


def block_loss(hidden: torch.Tensor, blocks: Blocks, drafter, cfg: LossConfig,
               global_sum: GlobalSum | None = None) -> torch.Tensor:
    """The configured loss (loss.drafter_loss) of drafter hidden states [N, K, B, H] against
    the blocks' targets, over the drafter's head (and its selector, a DFlash 2 one's),
    normalised by the weight sum over every rank (`global_sum`, see loss.unary_loss)."""
    device = hidden.device
    labels = blocks.labels.flatten(0, 1).to(device)
    valid = blocks.valid.flatten(0, 1).to(device)
    if getattr(drafter, "draft_ids", None) is not None:
        # Over a draft vocabulary: labels as its ids; one outside it has no logit to raise.
        labels = drafter.to_draft_labels(labels)
        valid = valid & (labels != IGNORE_LABEL)
    soft = [t.flatten(0, 1).to(device) if t is not None else None
            for t in (blocks.target_ids, blocks.target_logits, blocks.target_lse)]
    targets = SlotTargets(labels, valid, blocks.block_ids[:, :, 0].flatten().to(device), *soft)
    head = Head(hidden.flatten(0, 1), drafter.head_weight, drafter.target_embed_tokens)
    return drafter_loss(head, targets, cfg, drafter.candidate_selector, global_sum).loss


@torch.no_grad()
def batch_accuracy(hidden: torch.Tensor, blocks: Blocks, model) -> BatchAccuracy:
    """Per-slot accuracy of the drafts and the training tau estimate on this batch's blocks:
    each slot's argmax, or a DFlash 2 drafter's selector walk, whose selector_recall is the
    fraction of labelled slots whose label is among the slot's top-K candidates."""
    hidden = hidden.flatten(0, 1).float()
    labels, valid = blocks.labels.flatten(0, 1), blocks.valid.flatten(0, 1)
    recall = None
    if model.candidate_selector is None:
        _, ids = model.draft_topk(hidden, k=1)
        ids = ids.cpu()
    else:
        anchors = blocks.block_ids[:, :, 0].flatten().to(hidden.device)
        walk = model.propose(hidden[:, 1:].to(model.fc.weight.dtype), anchors).cpu()
        ids = torch.cat([torch.full_like(walk[:, :1], -1), walk], dim=1)
        _, top = draft_topk(hidden, model.target_lm_head.float(),
                            k=model.candidate_selector.top_k)
        hit = (top.cpu() == labels[..., None]).any(-1) & valid
        hit[:, 0] = False
        counted = valid.clone()
        counted[:, 0] = False
        recall = float(hit.sum()) / max(1, int(counted.sum()))
    stats = AcceptanceStats(block_size=hidden.shape[1], recall_at=(1,))
    stats.update(ids, labels, valid)
    s = stats.summary()
    return BatchAccuracy(s["slot_accuracy"], s["mean_tau"], recall)
