"""Load the target model through transformers and expose the parts extract and evaluate need.

Owns: config/tokenizer/model loading from a transformers checkpoint or a GGUF file (see
gguf.py), finding the decoder stack whether the checkpoint loads as a CausalLM
(`model.model.layers`) or the multimodal wrapper (`model.model.language_model.layers`), the
guard that keeps CPU runs out of GPU-only kernels (fla, causal_conv1d), the target's
provenance, and the tokenizer's spare special tokens (mask token candidates). Never writes
the store.
"""

import copy
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from dflash_train.store_schema import TargetInfo, TokenizerInfo
from dflash_train.target_config import text_part
from dflash_train.target_model import gguf, weights
from dflash_train.target_model.errors import TargetError
from dflash_train.target_model.kernels import silence_fallback_notes

LoadAs = Literal["causal-lm", "multimodal"]
GPU_ONLY_PACKAGES = ("fla", "causal_conv1d")
"""Packages transformers routes linear attention into when importable; they need CUDA."""


@dataclass
class Target:
    """A loaded target and handles on the modules extract and eval --online use."""

    model: nn.Module
    """The whole model as loaded (used for generation)."""
    decoder: nn.Module
    """The text decoder: embed_tokens, layers, norm; its output is post-final-norm."""
    lm_head: nn.Module
    info: TargetInfo
    kernels: str
    """Which kernels ran, for provenance, e.g. "attention=sdpa linear_attention=torch"."""

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype


def load_target_config(name_or_path: str):
    """The checkpoint's config; TargetError naming the path if it cannot be read."""
    from transformers import AutoConfig

    if not Path(name_or_path).exists() and not _looks_like_hub_id(name_or_path):
        raise TargetError(f"--model {name_or_path}: no such directory or .gguf file")
    path = gguf.find_gguf(name_or_path)
    try:
        if path is not None:
            return gguf.read_gguf_config(path)
        return AutoConfig.from_pretrained(name_or_path)
    except Exception as e:  # hub / json / unknown model_type all raise different types
        raise _unreadable(name_or_path, "cannot read its config", e) from e


def _unreadable(name_or_path: str, what: str, e: Exception) -> TargetError:
    """The error for a config, tokenizer or weights transformers could not read; a .gguf
    that the gguf package cannot read either is named as a damaged file, not by what
    transformers made of it ('a config file that is not valid JSON', an unpack error)."""
    path = gguf.find_gguf(name_or_path)
    why = gguf.damage(path) if path is not None else None
    if why:
        return TargetError(f"--model {path}: a damaged GGUF file (it starts with the GGUF "
                            f"magic, but the gguf reader cannot read it: {why}); download "
                            "or convert it again")
    return TargetError(f"--model {name_or_path}: {what} ({e})")


def from_pretrained_args(name_or_path: str) -> tuple[str, dict]:
    """Where from_pretrained reads `--model` from, and the extra arguments it needs."""
    path = gguf.find_gguf(name_or_path)
    return gguf.reader_arguments(path) if path is not None else (name_or_path, {})


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def target_info(name_or_path: str, config, revision: str | None = None) -> TargetInfo:
    """The target's provenance. The config hash covers the architecture only, not where the
    files were read from; a local path is recorded absolute, so resuming from another working
    directory or with a relative spelling is the same target. A GGUF target is recorded as
    its file, with the file's content hash as its revision and weights fingerprint; a local
    directory's weights are fingerprinted by weights.py; a hub id has no fingerprint (its
    --revision names it)."""
    text = text_part(config)
    blob = json.dumps(_architecture(config.to_dict()), sort_keys=True, default=str).encode()
    path = gguf.find_gguf(name_or_path)
    weights_sha256 = None
    if path is not None:
        if revision is not None:
            raise TargetError(f"--revision {revision} names a hub revision; a .gguf target "
                               "is identified by its content hash instead (drop --revision)")
        name_or_path, revision = str(path), gguf.revision(path)
        weights_sha256 = revision.removeprefix(gguf.REVISION_PREFIX)
    elif Path(name_or_path).exists():
        name_or_path = str(Path(name_or_path).resolve())
        weights_sha256 = weights.fingerprint(name_or_path)
    return TargetInfo(
        name_or_path=name_or_path, revision=revision, model_type=config.model_type,
        num_hidden_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        vocab_size=text.vocab_size, config_sha256=hashlib.sha256(blob).hexdigest(),
        weights_sha256=weights_sha256,
    )


def _architecture(config: dict) -> dict:
    """A config dict without the keys that say where and by which version it was read."""
    return {k: _architecture(v) if isinstance(v, dict) else v for k, v in config.items()
            if k not in ("_name_or_path", "transformers_version")}


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    where, kwargs = from_pretrained_args(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except Exception as e:  # missing files / bad json raise different types
        raise _unreadable(name_or_path, "cannot load its tokenizer", e) from e
    if not getattr(tokenizer, "is_fast", False):
        raise TargetError(f"--model {name_or_path}: extract needs a fast tokenizer (offsets)")
    if not tokenizer.chat_template:
        raise TargetError(f"--model {name_or_path}: the tokenizer has no chat template")
    return tokenizer


def spare_special_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's special tokens that no chat renders, ascending: not bos / eos /
    pad / unk and not written by the chat template (mask token candidates; see
    drafter.config.default_mask_token_id)."""
    template = tokenizer.chat_template or ""
    used = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    return sorted(i for i, token in tokenizer.added_tokens_decoder.items()
                  if token.special and i not in used and token.content not in template)


def tokenizer_files(tokenizer, tmp_dir: str) -> dict[str, bytes]:
    """The tokenizer as saved files (what is copied into the store)."""
    tokenizer.save_pretrained(tmp_dir)
    return {p.name: p.read_bytes() for p in sorted(Path(tmp_dir).iterdir()) if p.is_file()}


def tokenizer_info(files: dict[str, bytes], tokenizer, enable_thinking: bool) -> TokenizerInfo:
    digest = hashlib.sha256()
    for name in sorted(files):
        if name == "tokenizer_config.json":
            continue  # holds paths and versions that change between saves, not the vocab
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    template = tokenizer.chat_template
    return TokenizerInfo(
        sha256=digest.hexdigest(),
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if template else None,
        enable_thinking=enable_thinking,
    )


def guard_kernels(device: str) -> None:
    """On CPU, make fla / causal_conv1d unimportable before transformers routes into them."""
    if device != "cpu":
        return
    modeling = "transformers.models.qwen3_5.modeling_qwen3_5"
    loaded = [p for p in GPU_ONLY_PACKAGES if isinstance(sys.modules.get(p), type(sys))]
    if loaded and modeling in sys.modules:
        raise TargetError(
            f"{', '.join(loaded)} was imported before extract ran on CPU; transformers would "
            "route linear attention into GPU-only kernels. Run in a fresh process."
        )
    for package in GPU_ONLY_PACKAGES:
        sys.modules.setdefault(package, None)  # a None entry makes `import package` fail


def kernels_used(model: nn.Module, device: str) -> str:
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    linear = "fla" if isinstance(sys.modules.get("fla"), type(sys)) else "torch"
    if device == "cpu" and linear != "torch":
        raise TargetError("fla kernels are loaded on a CPU run; refusing to continue")
    return f"attention={attention} linear_attention={linear}"


def load_target(name_or_path: str, *, device: str, dtype: torch.dtype, load_as: LoadAs,
                revision: str | None = None, progress: bool = True) -> Target:
    """Load the target for inference and find its decoder and lm_head."""
    guard_kernels(device)
    silence_fallback_notes()  # their advice is wrong on CPU; pipeline says it once on CUDA
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = load_target_config(name_or_path)
    info = target_info(name_or_path, config, revision)
    where, kwargs = from_pretrained_args(name_or_path)
    if kwargs:  # GGUF: no hub revision; its config parsed once (from_pretrained edits a copy)
        kwargs["config"], revision = copy.deepcopy(config), None
    if load_as == "multimodal" and getattr(config, "text_config", None) is None:
        raise TargetError(f"--model {name_or_path}: {config.model_type} has no multimodal "
                           "wrapper; use --load-as causal-lm")
    cls = AutoModelForCausalLM if load_as == "causal-lm" else AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(where, dtype=dtype, revision=revision, **kwargs)
    except Exception as e:  # missing weights, unknown architecture, out of memory, ...
        raise _unreadable(name_or_path, f"cannot load as {load_as}", e) from e
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    model.to(device).eval().requires_grad_(False)
    inner = model.model
    decoder = getattr(inner, "language_model", None) or inner
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise TargetError(f"--model {name_or_path}: no decoder layers at model.model.layers "
                           "or model.model.language_model.layers")
    return Target(
        model=model, decoder=decoder, lm_head=model.get_output_embeddings(),
        info=info, kernels=kernels_used(model, device),
    )
