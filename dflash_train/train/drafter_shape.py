"""The drafter's shape as a run's `model.*` settings give it, both ways: resolved for a
store's target (the fields `model.*` sets, else a published target's released drafter, else
the target's own heads; shape_drafter), read back from a built drafter (drafter_settings, so
a resume or init_from compares settings with the shape it really has), and the drafter a run
starts from: a new one (new_drafter), or the one `model.init_from` names, warm-started to
DFlash 2 where asked.

Reads the store's target config and the init drafter; never writes, never trains.
"""

import json
from dataclasses import fields, replace
from typing import Any

import numpy as np
import torch

from dflash_train.drafter import (
    AttentionShape,
    DFlashDrafter,
    DrafterConfig,
    DrafterError,
    load_drafter,
    published_attention,
)
from dflash_train.drafter.config import DFLASH2_FIELDS, DRAFTER_KINDS
from dflash_train.drafter.model import dflash2_from
from dflash_train.store_schema import Store, StoreError
from dflash_train.store_schema.info import label_counts
from dflash_train.target_config import head_dim, text_part
from dflash_train.train.config import ModelConfig, TrainConfig
from dflash_train.train.errors import TrainError
from dflash_train.train.options import option_name

DRAFTER_LAYERS = 5
"""Decoder layers of a drafter when the config leaves them unset (the released drafters')."""
TARGET_CONFIG_FILES = "target"  # store files group holding the target's config.json


def drafter_config(cfg: TrainConfig, store: Store) -> DrafterConfig:
    """The drafter's shape: width, vocab and layer ids from the store; the rest from cfg."""
    meta = store.meta
    try:
        target = json.loads(store.read_files(TARGET_CONFIG_FILES)["config.json"])
    except (StoreError, KeyError) as e:
        raise TrainError(f"{store.url} holds no target config.json; re-run extract") from e
    mask = cfg.model.mask_token_id
    if mask is None:
        mask = meta.extra.get("mask_token_id")
    if mask is None:
        raise TrainError(f"{store.url} records no mask token id; pass --model.mask_token_id")
    return shape_drafter(target, int(mask), meta.context_layer_ids, cfg.model)


def shape_drafter(target: dict, mask_token_id: int, layer_ids: list[int],
                  m: ModelConfig) -> DrafterConfig:
    """The drafter for a target config.json: `m`'s fields where set, else a published
    target's released drafter attention, else the target's own heads, all layers full.
    Left unset, the released sliding layers stop one short of the drafter's layer count, so
    its last layer stays full (the released 5-layer drafter: 4 sliding + 1 full)."""
    text = text_part(target)
    layers = m.num_hidden_layers or DRAFTER_LAYERS
    base = published_attention(target) or AttentionShape(
        text["num_attention_heads"], text["num_key_value_heads"], head_dim(text),
        sliding_layers=0, sliding_window=2048)
    base = replace(base, sliding_layers=min(base.sliding_layers, layers - 1))
    shape = replace(base, **{f.name: getattr(m, f.name) for f in fields(AttentionShape)
                             if getattr(m, f.name) is not None})
    if shape.sliding_layers > layers:
        raise TrainError(f"model.sliding_layers {shape.sliding_layers} is more than the "
                         f"drafter's {layers} layers (--layers {layers}); pass --set "
                         f"model.sliding_layers=N with N <= {layers}, or raise --layers")
    overrides = dict(
        num_hidden_layers=layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        layer_types=_layer_types(shape.sliding_layers, layers),
        sliding_window=shape.sliding_window if shape.sliding_layers else None,
    )
    if m.intermediate_size is not None:
        overrides["intermediate_size"] = m.intermediate_size
    if m.draft_vocab_size is not None:
        vocab = int(text["vocab_size"])
        if m.draft_vocab_size > vocab:
            raise TrainError(f"model.draft_vocab_size {m.draft_vocab_size} is more than the "
                             f"target's vocabulary of {vocab}")
        overrides["draft_vocab_size"] = m.draft_vocab_size
    return DrafterConfig.for_target(target, mask_token_id, target_layer_ids=layer_ids,
                                    **overrides, **dflash2_settings(m))


def new_drafter(cfg: TrainConfig, store: Store) -> DFlashDrafter:
    """A drafter of random weights (torch's current seed) for the store's target, shaped and
    initialised as `cfg.model` says."""
    return DFlashDrafter(drafter_config(cfg, store), final_norm_init=cfg.model.final_norm_init)


def initial_drafter(m: ModelConfig) -> DFlashDrafter:
    """The drafter `model.init_from` names, as `m` asks for it: as saved, or, for kind
    dflash2 from a DFlash drafter, warm-started (drafter.model.dflash2_from)."""
    try:
        model = load_drafter(m.init_from, kinds=DRAFTER_KINDS)
    except DrafterError as e:
        raise TrainError(f"model.init_from {m.init_from}: {e}") from e
    if model.config.kind == m.kind:
        wanted = dflash2_settings(m)
        differ = [f"model.{k} {v} (the drafter has {getattr(model.config, k)})"
                  for k, v in wanted.items() if getattr(model.config, k) != v]
        if differ:
            raise TrainError(f"model.init_from {m.init_from} fixes the drafter's shape; these "
                             f"settings differ from it: {'; '.join(differ)}")
        return model
    if m.kind == "dflash":
        raise TrainError(f"model.init_from {m.init_from} is a DFlash 2 drafter; pass --set "
                         "model.kind=dflash2 to train it")
    fields = dflash2_settings(m)
    fields.pop("kind")
    try:
        return dflash2_from(model, **fields)
    except DrafterError as e:
        raise TrainError(f"model.init_from {m.init_from}: warm start: {e}") from e


def _layer_types(sliding_layers: int, layers: int) -> list[str]:
    """model.sliding_layers as a drafter holds it: that many sliding layers first, the rest
    full (drafter_settings reads it back with _sliding_layers)."""
    return ["sliding_attention"] * sliding_layers + ["full_attention"] * (layers - sliding_layers)


def _sliding_layers(drafter: DrafterConfig) -> int:
    return drafter.layer_types.count("sliding_attention")


def dflash2_settings(m: ModelConfig) -> dict[str, Any]:
    """The DrafterConfig fields `m` sets for a DFlash 2 drafter ({} for DFlash)."""
    if m.kind != "dflash2":
        return {}
    fields = {name: getattr(m, name) for name in DFLASH2_FIELDS if getattr(m, name) is not None}
    return {"kind": "dflash2", "selector_codebooks": m.selector_codebooks, **fields}


def drafter_settings(drafter: DrafterConfig) -> dict[str, Any]:
    """The `model.*` values a checkpoint's drafter actually has (None where it has none)."""
    sliding = _sliding_layers(drafter)
    return {
        "model.num_hidden_layers": drafter.num_hidden_layers,
        "model.num_attention_heads": drafter.num_attention_heads,
        "model.num_key_value_heads": drafter.num_key_value_heads,
        "model.head_dim": drafter.head_dim,
        "model.intermediate_size": drafter.intermediate_size,
        "model.sliding_layers": sliding,
        "model.sliding_window": drafter.sliding_window if sliding else None,
        "model.mask_token_id": drafter.mask_token_id,
        "model.draft_vocab_size": drafter.draft_vocab_size,
    }


def shape_conflicts(model: ModelConfig, drafter: DrafterConfig) -> list[str]:
    """'option: set value (the drafter has its value)' for every `model.*` field a config
    sets that a given drafter (init_from) does not have: the drafter's shape wins, and the
    run must not record another."""
    conflicts = []
    for key, has in drafter_settings(drafter).items():
        wanted = getattr(model, key.removeprefix("model."))
        # None is "not set" in a drafter, except that a drafter without a draft vocabulary
        # has none, and no setting can give it one
        unset = has is None and key != "model.draft_vocab_size"
        if wanted is not None and not unset and wanted != has:
            conflicts.append(f"{option_name(key)} {wanted} (the drafter has {has})")
    return conflicts


def most_frequent_labels(stores: list[Store], n: int) -> tuple[torch.Tensor, float]:
    """The `n` ids most often a hard label over `stores` (ties: the lower id), ascending,
    and the fraction of those labels they cover: a draft vocabulary and what it loses."""
    counts = sum(label_counts(store) for store in stores)
    order = np.lexsort((np.arange(counts.size), -counts))  # count descending, then id
    chosen = np.sort(order[:n])
    covered = float(counts[chosen].sum()) / max(1, int(counts.sum()))
    return torch.from_numpy(chosen.astype(np.int64)), covered
