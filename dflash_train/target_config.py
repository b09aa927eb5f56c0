"""One reader of a target model's config, a transformers config object or its config.json as
a dict: the text model's part of it and the fields a drafter is sized from.

A multimodal target (Qwen3.5) nests its text model's fields under `text_config`; every
reader goes through text_part, so none can forget it. Reads only; knows nothing of drafters
or stores.
"""

from collections.abc import Mapping
from typing import Any


def config_field(config: Any, name: str, default: Any = None) -> Any:
    """`name` of a config dict or object, else `default`."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def text_part(config: Any) -> Any:
    """The text model's config: `text_config` where a multimodal config nests it."""
    return config_field(config, "text_config") or config


def model_type(text: Any) -> str:
    return str(config_field(text, "model_type", ""))


def head_dim(text: Any) -> int:
    """Width of one attention head: the config's own head_dim, else width / heads (configs
    that leave it out). A config holding neither fails on the missing key."""
    return config_field(text, "head_dim") or _present(text, "hidden_size") // _present(
        text, "num_attention_heads")


def rope_theta(text: Any, default: float) -> float:
    """The RoPE base: top level, else inside rope_parameters (newer transformers), else
    `default`."""
    theta = config_field(text, "rope_theta")
    if theta is None:
        theta = (config_field(text, "rope_parameters") or {}).get("rope_theta", default)
    return theta


def _present(config: Any, name: str) -> Any:
    return config[name] if isinstance(config, Mapping) else getattr(config, name)
