"""model.safetensors of a drafter directory: the weight names engines load, read back and
checked against the drafter its config.json describes.

Keyed `fc.weight`, `hidden_norm.weight`, `layers.N.*`, `norm.weight`: no embed_tokens, no
lm_head (borrowed from the target). A DFlash 2 drafter adds `layers.N.{attention_conv,
mlp_conv}.{base_kernel,kernel_projection.weight}` and `candidate_selector.{hidden_projection
.weight,predecessor_codebook,successor_codebook}` (the codebooks bare, as published; the
`.weight`-suffixed names z-lab's own save_pretrained writes load too). A drafter trained with
factorised codebooks (A = E W) also holds its factors `candidate_selector.{predecessor,
successor}_factor`, for resuming; export drops them, so what engines load is the reference
format exactly. A drafter with a draft vocabulary also ships what vLLM's DFlash model loads
for one: `lm_head.weight` [draft_vocab_size, H] (the target's rows it drafts over) and `d2t`
[draft_vocab_size] int64 (draft id i drafts target id i + d2t[i]); in memory they are the
buffers `draft_lm_head` and `draft_ids` (target ids). Never writes a file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.dflash2 import FACTORS, embedded_codebook
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.run_layout import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
"""Tensors published bare, which z-lab's save_pretrained writes with a `.weight` suffix."""


def with_materialised_codebooks(model: DFlashDrafter, weights: dict[str, torch.Tensor]
                                ) -> dict[str, torch.Tensor]:
    """`weights` plus, for factorised selector codebooks, A = E W_A and B = E W_B under the
    published names, from the attached target embedding E: the directory then holds what an
    engine loads next to the factors a resume trains on (export keeps only the former)."""
    if model.config.kind != "dflash2" or model.config.selector_codebooks == "free":
        return weights
    embed = model.target_embed_tokens
    if embed is None:
        raise DrafterError("saving a drafter with factorised selector codebooks needs the "
                           "target's token embedding (attach_target_head) to write E W")
    out = dict(weights)
    for name, factor in FACTORS.items():
        w = weights[f"candidate_selector.{factor}"]
        out[f"candidate_selector.{name}"] = embedded_codebook(embed, w.detach())
    return out


DRAFT_MAP, DRAFT_HEAD = "d2t", "lm_head.weight"
"""A draft vocabulary's tensors under the names vLLM's DFlash model loads."""


def published(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights under the names a drafter directory holds (draft vocabulary as d2t)."""
    out = dict(weights)
    if "draft_ids" in out:
        ids = out.pop("draft_ids").long()
        out[DRAFT_MAP] = ids - torch.arange(ids.numel(), device=ids.device)
        out[DRAFT_HEAD] = out.pop("draft_lm_head")
    return out


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter directory (one file or an index of shards), the codebooks
    under their published names, a draft vocabulary as the drafter's buffers."""
    state = _published_names(_read_tensors(directory))
    if DRAFT_MAP in state:
        offsets = state.pop(DRAFT_MAP)
        if offsets.dtype.is_floating_point or offsets.dim() != 1:
            raise DrafterError(f"{directory}: {DRAFT_MAP} must be integer [draft_vocab_size], "
                               f"got {tuple(offsets.shape)} {offsets.dtype}")
        state["draft_ids"] = offsets.long() + torch.arange(offsets.numel())
        if DRAFT_HEAD in state:
            state["draft_lm_head"] = state.pop(DRAFT_HEAD)
    return state


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return _load_safetensors(single)
    index = directory / WEIGHTS_INDEX_NAME
    if not index.is_file():
        raise DrafterError(f"{directory}: neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state.update(_load_safetensors(directory / shard))
    return state


def factorised_as(config: DrafterConfig, state: dict[str, torch.Tensor], where: Path,
                  materialise: bool) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A factorised drafter's directory holds factors and their E W: keep the one asked for."""
    factors = [f"candidate_selector.{f}" for f in FACTORS.values()]
    missing = [n for n in (*CODEBOOKS, *factors) if n not in state]
    if missing:
        raise DrafterError(f"{where}: factorised selector codebooks but missing weights "
                           f"{missing}")
    drop = factors if materialise else CODEBOOKS
    state = {k: v for k, v in state.items() if k not in drop}
    if materialise:
        config = replace(config, selector_codebooks="free")
    return config, state


def _published_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The codebooks under their bare published names whichever way they were written."""
    for name in CODEBOOKS:
        if f"{name}.weight" in state and name not in state:
            state[name] = state.pop(f"{name}.weight")
    return state


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for truncated files
        raise DrafterError(f"{path}: cannot read safetensors ({err})") from err


def check_keys(model: DFlashDrafter, state: Mapping[str, torch.Tensor], where: Path) -> None:
    """Refuse weights that are not exactly the ones `model`'s config implies, by name."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        own_head = [k for k in unexpected if k.split(".")[0] in ("embed_tokens", "lm_head")]
        hint = " (this drafter ships its own embed_tokens/lm_head; dflash borrows the "\
            "target's)" if own_head else ""
        raise DrafterError(f"{where}: unexpected weights {unexpected[:8]}{hint}")
    if missing:
        raise DrafterError(f"{where}: missing weights {missing[:8]}")
    wrong = [(k, tuple(state[k].shape), s) for k, s in expected.items()
             if tuple(state[k].shape) != s]
    if wrong:
        name, got, want = wrong[0]
        raise DrafterError(f"{where}: weight {name} has shape {got}, config implies {want}")
