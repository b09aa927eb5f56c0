"""config.json of a drafter directory: the schema vLLM, SGLang and z-lab's loaders read
(docs/reference.md §9), to and from DrafterConfig.

A DFlash drafter's config.json is architectures DFlashDraftModel, model_type qwen3, the
Qwen3 fields, layer_types, block_size and dflash_config; a DFlash 2 drafter's is z-lab's
DFlash2DraftModel format, whose dflash_config adds conv_kernel_size, conv_group_size,
selector_rank and selector_top_k (and, for a drafter trained with factorised codebooks,
selector_codebooks = "factorised", for resuming; export drops it). A field that would
change the forward in a way this drafter does not implement is refused by name. Never
touches weights or any other file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_train.drafter.config import (
    DEFAULT_BLOCK_SIZE,
    DFLASH2_FIELDS,
    DrafterConfig,
    DrafterKind,
)
from dflash_train.drafter.errors import DrafterError
from dflash_train.run_layout import CONFIG_NAME, LOADER_CLASS, LOADER_MODULE

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES: dict[DrafterKind, str] = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel"}
"""config.json's architectures entry per drafter kind (z-lab's class names)."""

# dflash_config / top-level fields that change the forward in ways this drafter does not
# implement (logit scaling and soft-capping, attention sinks, ...): refused by name rather
# than loaded into a drafter that would silently compute something else. DFlash 2's own
# fields are refused on a DFlashDraftModel config, whose loaders ignore them.
_UNSUPPORTED_IF_SET = {
    "attention_sink_bias": False,
    "final_logit_softcapping": None,
    "use_swa": False,
    "swa_window_size": None,
}
_UNSUPPORTED_UNLESS = {
    "output_multiplier": 1.0,
    "input_embedding_scale": 1.0,
    "use_aux_hidden_state": True,
    "is_neox_style": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "partial_rotary_factor": 1.0,
}
_INTEGERS = ("hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "mask_token_id",
             "max_position_embeddings", "block_size", "draft_vocab_size", "num_target_layers",
             "sliding_window", *DFLASH2_FIELDS)
_NUMBERS = ("rms_norm_eps", "rope_theta")
"""config.json fields read as numbers: a JSON boolean, a string or a fraction in one is
refused by name, never read as 1, 0 or its integer part."""


def config_to_dict(config: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json contents, the fields of the published z-lab DFlash checkpoints."""
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[config.kind]],
        "auto_map": {"AutoModel": f"{LOADER_MODULE}.{LOADER_CLASS}"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": _plain_number(config.rope_theta),
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        # transformers' Qwen3Config drops sliding_window unless this is set.
        "use_sliding_window": "sliding_attention" in config.layer_types,
        "max_window_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if config.kind == "dflash2":
        raw["dflash_config"].update({name: getattr(config, name) for name in DFLASH2_FIELDS})
        if config.selector_codebooks != "free":
            raw["dflash_config"]["selector_codebooks"] = config.selector_codebooks
    if config.is_causal is not None:
        raw["is_causal"] = config.is_causal
    if config.draft_vocab_size is not None:
        # vLLM's DFlash model sizes its lm_head by this and loads d2t beside it.
        raw["draft_vocab_size"] = config.draft_vocab_size
    # Unknown for third-party drafters without it: a null here makes SGLang fall back to the
    # drafter's own layer count and reject the target layer ids, and no value can be derived
    # exactly (max(target_layer_ids) + 1 is only a lower bound), so the key is left out.
    if config.num_target_layers is not None:
        raw["num_target_layers"] = config.num_target_layers
    return raw


def _plain_number(value: float) -> float | int:
    # Published configs write "rope_theta": 1000000; keep integral values integral.
    return int(value) if float(value).is_integer() else value


def drafter_config_from_dict(raw: Mapping[str, Any], source: str = CONFIG_NAME) -> DrafterConfig:
    """Parse our config.json or a third-party DFlash / DFlash 2 one (z-lab, vLLM
    conventions)."""
    kind = _kind(raw.get("architectures") or [], source)
    if raw.get("model_type", "qwen3") != "qwen3":
        raise DrafterError(f"{source}: model_type {raw['model_type']!r}; only qwen3 drafters")
    draft = dict(raw.get("dflash_config") or {})
    _refuse_unsupported(raw, draft, source, kind)
    _refuse_wrong_types(raw, draft, source)

    def pick(name: str, default: Any = None) -> Any:
        # dflash_config first, then the top level: the order z-lab's loader reads them in.
        return draft.get(name, raw.get(name, default))

    dflash2 = _dflash2_fields(pick, draft, source) if kind == "dflash2" else {}
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "vocab_size"):
        if raw.get(name) is None:
            raise DrafterError(f"{source}: missing field {name!r}")
    for name in ("target_layer_ids", "mask_token_id"):
        if pick(name) is None:
            raise DrafterError(f"{source}: missing dflash_config.{name}")
    rope_theta = _rope_theta(raw, source)
    is_causal = raw.get("is_causal", draft.get("causal"))
    heads = int(raw["num_attention_heads"])
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) == int(raw["vocab_size"]):
        draft_vocab = None  # the whole vocabulary, as z-lab's configs spell it
    return DrafterConfig(
        hidden_size=int(raw["hidden_size"]),
        vocab_size=int(raw["vocab_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        target_layer_ids=list(pick("target_layer_ids")),
        num_target_layers=raw.get("num_target_layers"),
        mask_token_id=int(pick("mask_token_id")),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
        layer_types=list(raw.get("layer_types") or []),
        sliding_window=raw.get("sliding_window"),
        is_causal=None if is_causal is None else bool(is_causal),
        block_size=int(pick("block_size", DEFAULT_BLOCK_SIZE)),
        kind=kind,
        draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
        **dflash2,
    )


def _dflash2_fields(pick: Callable[[str], Any], draft: dict, source: str) -> dict[str, Any]:
    """A DFlash2DraftModel's convolution and selector settings (all required)."""
    fields: dict[str, Any] = {}
    for name in DFLASH2_FIELDS:
        if pick(name) is None:
            raise DrafterError(f"{source}: a DFlash2DraftModel needs dflash_config.{name}")
        fields[name] = int(pick(name))
    fields["selector_codebooks"] = draft.get("selector_codebooks", "free")
    return fields


def _rope_theta(raw: Mapping[str, Any], source: str) -> Any:
    """The RoPE base, top level or in rope_parameters; only default RoPE is supported."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise DrafterError(f"{source}: rope type {rope.get('rope_type')!r}; only default RoPE")
    rope_theta = raw.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        raise DrafterError(f"{source}: no rope_theta (top level or rope_parameters)")
    return rope_theta


def _kind(architectures: list[str], source: str) -> DrafterKind:
    kinds = [kind for kind, name in ARCHITECTURES.items() if name in architectures]
    if len(kinds) != 1:
        names = " or ".join(repr(name) for name in ARCHITECTURES.values())
        raise DrafterError(f"{source}: architectures {architectures} is not [{names}]")
    return kinds[0]


def _refuse_wrong_types(raw: Mapping[str, Any], draft: Mapping[str, Any], source: str
                        ) -> None:
    for scope, fields in (("", raw), ("dflash_config.", draft)):
        for name in (*_INTEGERS, *_NUMBERS, "target_layer_ids"):
            value = fields.get(name)
            if value is None:
                continue
            if name == "target_layer_ids":
                ok = isinstance(value, list) and all(_is_integer(v) for v in value)
                kind = "a list of integers"
            elif name in _NUMBERS:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                kind = "a number"
            else:
                ok, kind = _is_integer(value), "an integer"
            if not ok:
                raise DrafterError(f"{source}: {scope}{name} is {value!r}, not {kind}")


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_unsupported(raw: Mapping[str, Any], draft: Mapping[str, Any], source: str,
                        kind: DrafterKind) -> None:
    for scope, fields in (("", raw), ("dflash_config.", draft)):
        if kind == "dflash":
            for name in DFLASH2_FIELDS:
                if fields.get(name) is not None:
                    raise DrafterError(
                        f"{source}: {scope}{name} is a DFlash 2 field but architectures is "
                        f"[{ARCHITECTURE!r}], which ignores it; not supported")
        for name, harmless in _UNSUPPORTED_IF_SET.items():
            if fields.get(name, harmless) not in (harmless, None, False):
                raise DrafterError(
                    f"{source}: {scope}{name}={fields[name]!r} is not supported by this drafter"
                )
        for name, required in _UNSUPPORTED_UNLESS.items():
            if name in fields and fields[name] != required:
                raise DrafterError(
                    f"{source}: {scope}{name}={fields[name]!r} is not supported (need "
                    f"{required!r})"
                )
    same_as = {"target_hidden_size": "hidden_size", "v_head_dim": "head_dim"}
    for name, base in same_as.items():
        if raw.get(name) not in (None, raw.get(base)):
            raise DrafterError(f"{source}: {name}={raw[name]} differs from {base}; unsupported")


def read_drafter_config(directory: str | os.PathLike) -> DrafterConfig:
    """The DrafterConfig of a drafter directory, without loading weights."""
    path = Path(directory) / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise DrafterError(f"{path}: not found; not a drafter directory") from err
    except json.JSONDecodeError as err:
        raise DrafterError(f"{path}: invalid JSON ({err})") from err
    return drafter_config_from_dict(raw, str(path))
