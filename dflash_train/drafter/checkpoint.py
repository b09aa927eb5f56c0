"""Drafter directories in the format vLLM / SGLang / z-lab load (docs/reference.md §9),
read and written whole, exported, and loadable by transformers' AutoModel.

A drafter directory is config.json (drafter/hf_config.py), model.safetensors
(drafter/hf_weights.py), checksums.json and modeling_dflash_train.py (run_layout names
them; drafter/files.py writes them atomically and checks them whole). Our own save format IS
this format, so a training checkpoint holds such a directory under `drafter/` (next to
optimiser state) and export is a validated copy.

Every directory we write ships `modeling_dflash_train.py` too, which config.json's auto_map
names, so that transformers' `AutoModel.from_pretrained(dir, trust_remote_code=True)` works
(z-lab's Hub repos ship their own module; naming one without shipping it made that call
fail). It only re-exports AutoModelLoader, which returns load_drafter's DFlashDrafter: one
implementation of the drafter, so it needs dflash-train installed and says so when it is
not. The shipped module imports it from this module by name, so AutoModelLoader stays here
for every directory already exported. Leaving auto_map out instead would have that call
build transformers' plain Qwen3Model (fc and hidden_norm dropped, embed_tokens random), as
AutoModel without remote code does anyway: model_type qwen3 is what vLLM, SGLang and z-lab's
loader read, so it stays, and transformers' load report names the mismatch. vLLM and SGLang
resolve the drafter by `architectures` (DFlashDraftModel) and never read auto_map or the
module; z-lab's `DFlashDraftModel.from_pretrained` ignores both.

Never trains, never touches optimiser state, never reads the feature store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_train.drafter.config import DRAFTER_KINDS, DrafterKind
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.files import (
    cast_weight,
    check_checkpoint_whole,
    check_finite,
    check_output_dir,
    verify_checksums,
    write_checksums,
    write_dir_atomically,
)
from dflash_train.drafter.hf_config import ARCHITECTURES, config_to_dict, read_drafter_config
from dflash_train.drafter.hf_weights import (
    check_keys,
    factorised_as,
    published,
    read_weights,
    with_materialised_codebooks,
)
from dflash_train.drafter.model import DFlashDrafter, check_draft_ids
from dflash_train.run_layout import (
    CONFIG_NAME,
    DRAFTER_SUBDIR,
    LOADER_NAME,
    WEIGHTS_NAME,
)
from dflash_train.run_reader import training_checkpoint_root


def save_drafter(
    model: DFlashDrafter,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` as a serving-format drafter directory, atomically.

    dtype: cast the weights (e.g. torch.bfloat16 for serving); None keeps them as they are.
    state_dict: the full weights when the model's own are sharded (FSDP); default its own.
    """
    weights = model.state_dict() if state_dict is None else state_dict
    weights = published(with_materialised_codebooks(model, weights))
    check_finite(weights, f"{out_dir}: the drafter's weights")
    state = {
        name: (t if dtype is None or not t.is_floating_point() else cast_weight(t, dtype, name))
        .detach().to("cpu").contiguous()
        for name, t in weights.items()
    }
    stored = state["fc.weight"].dtype
    raw = config_to_dict(model.config, stored)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / LOADER_NAME).write_text(LOADER_SOURCE)
        write_checksums(tmp, [CONFIG_NAME, WEIGHTS_NAME, LOADER_NAME])

    return write_dir_atomically(Path(out_dir), write, overwrite)


def load_drafter(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    checked_whole: bool = False,
    kinds: Collection[DrafterKind] = ("dflash",),
    materialise: bool = False,
) -> DFlashDrafter:
    """Load a drafter directory (ours, z-lab's or any DFlashDraftModel / DFlash2DraftModel
    one).

    `path` may also be a training checkpoint holding the drafter under `drafter/`; it must be
    whole (check_checkpoint_whole) unless the caller has just checked (`checked_whole`).
    The weights keep their stored dtype unless `dtype` is given. The target's embed_tokens
    and lm_head are not in the directory: attach them with `attach_target_head`.
    kinds: the drafter kinds the caller handles; another is refused by name. DFlash only by
    default: a caller that drafts by argmax logits would measure a DFlash 2 drafter with its
    selector switched off, so each caller opts in once it follows `propose`.
    materialise: a drafter with factorised selector codebooks loads as the free one its
    saved E W make (what engines load: export, eval); else with its factors (training).
    """
    directory = resolve_drafter_dir(path, checked_whole=checked_whole)
    verify_checksums(directory)
    config = read_drafter_config(directory)
    if config.kind not in kinds:
        raise DrafterError(
            f"{directory}: a {ARCHITECTURES[config.kind]} ({config.kind}) drafter; this step "
            f"takes {' and '.join(ARCHITECTURES[k] for k in kinds)} only (it does not follow "
            "DFlash 2's selector walk)")
    state = read_weights(directory)
    check_finite(state, f"{directory}: weights")
    if config.kind == "dflash2" and config.selector_codebooks == "factorised":
        config, state = factorised_as(config, state, directory, materialise)
    with torch.device("meta"):
        model = DFlashDrafter(config)
    check_keys(model, state, directory)
    if config.draft_vocab_size is not None:
        try:
            check_draft_ids(state["draft_ids"], config)
        except DrafterError as e:
            raise DrafterError(f"{directory}: d2t: {e}") from e
    model.load_state_dict(state, assign=True)
    return model.to(device=device, dtype=dtype)


def resolve_drafter_dir(path: str | os.PathLike, *, checked_whole: bool = False) -> Path:
    """The drafter directory itself, or the `drafter/` inside a training checkpoint, which
    must be whole (check_checkpoint_whole) unless the caller has just checked."""
    path = Path(path)
    if not path.exists():
        raise DrafterError(f"{path}: does not exist")
    if not path.is_dir():
        raise DrafterError(f"{path}: is a file, not a drafter directory or checkpoint")
    root = training_checkpoint_root(path)
    if root is not None and not checked_whole:
        check_checkpoint_whole(root)
    if (path / CONFIG_NAME).is_file():
        return path
    if (path / DRAFTER_SUBDIR / CONFIG_NAME).is_file():
        return path / DRAFTER_SUBDIR
    raise DrafterError(
        f"{path}: no {CONFIG_NAME} here or in {DRAFTER_SUBDIR}/; not a drafter or checkpoint"
    )


class AutoModelLoader:
    """What transformers' `AutoModel.from_pretrained(directory, trust_remote_code=True)`
    calls for a directory we wrote (its auto_map names LOADER_MODULE, which re-exports
    this): load_drafter's DFlashDrafter, in eval mode, target head not attached. Takes what
    a user passes AutoModel for a drafter, dtype (or torch_dtype; "auto" keeps the stored
    one), device_map (one device) and subfolder, and refuses anything else by name rather
    than ignore it (a quantization_config ignored would load something else than asked)."""

    PASSED_BY_TRANSFORMERS = frozenset({
        "config", "trust_remote_code", "adapter_kwargs", "_from_auto", "revision",
        "code_revision", "cache_dir", "force_download", "local_files_only", "proxies", "token",
    })
    """Hub and remote-code bookkeeping AutoModel adds; meaningless for a local directory."""

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoModel") -> None:
        """transformers records here which auto class loaded remote code; nothing to keep."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *model_args: Any, **kwargs: Any
                        ) -> DFlashDrafter:
        dtype = kwargs.pop("dtype", None)
        dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
        device = kwargs.pop("device_map", None)
        subfolder = kwargs.pop("subfolder", None) or ""
        unknown = sorted(set(kwargs) - cls.PASSED_BY_TRANSFORMERS)
        if model_args or unknown:
            shown = [repr(a) for a in model_args] + unknown
            raise TypeError(f"{path}: loading a dflash-train drafter takes dtype, device_map "
                            f"and subfolder only, not {', '.join(shown)}")
        if isinstance(dtype, str):
            name, dtype = dtype, None if dtype == "auto" else getattr(torch, dtype, None)
            if name != "auto" and not isinstance(dtype, torch.dtype):
                raise TypeError(f"{path}: dtype {name!r} is not a torch dtype")
        if device == "auto" or isinstance(device, dict):
            raise TypeError(f"{path}: device_map={device!r}: pass one device (e.g. 'cuda:0'); "
                            "the drafter is small and is not split across devices")
        directory = Path(path) / subfolder
        if not directory.is_dir():
            raise DrafterError(f"{directory}: not a local directory; a dflash-train drafter "
                               "loads from disk (download it first, e.g. hf download)")
        device = torch.device("cpu" if device is None else device)
        return load_drafter(directory, dtype=dtype, device=device, kinds=DRAFTER_KINDS,
                            materialise=True).eval()


LOADER_SOURCE = f'''"""Lets transformers load this DFlash drafter, exported by dflash-train:

    AutoModel.from_pretrained(this_directory, trust_remote_code=True)

returns dflash-train's DFlashDrafter with these weights (checksums.json verified), as
dflash_train.drafter.load_drafter does; it needs dflash-train installed. The target's
embed_tokens and lm_head are not in this directory: attach them with attach_target_head.
Serving engines (vLLM, SGLang) read config.json and the weights only, never this file;
z-lab's dflash.model.DFlashDraftModel.from_pretrained(this_directory) loads them too
(DFlash2DraftModel for a DFlash 2 drafter: architectures in config.json names which).
"""

try:
    from dflash_train.drafter.checkpoint import {AutoModelLoader.__name__}
except ImportError as err:
    raise ImportError(
        f"{{__file__}}: this DFlash drafter was written by dflash-train and AutoModel loads it "
        f"through dflash-train, which does not import here ({{err}}); install dflash-train, "
        "or load the directory with z-lab's dflash.model class that config.json's "
        "architectures names (its from_pretrained)"
    ) from err

__all__ = ["{AutoModelLoader.__name__}"]
'''
"""The text of LOADER_NAME: a re-export of AutoModelLoader, so the drafter has one
implementation. A plain import error would read as transformers' 'requires the following
packages ... pip install dflash_train'; the import sits in a try block, which transformers'
import check skips, so the error names what to do instead."""


def export_checkpoint(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """`dflash export`: a training checkpoint (or drafter dir) -> a serving directory.

    Loads and validates the drafter (config fields, weight keys and shapes), casts it to
    `dtype` (bf16 like the published drafters; None keeps the stored dtype) and writes it
    atomically. Returns the written directory.
    """
    source = resolve_drafter_dir(src_dir, checked_whole=True)  # load_drafter checks it
    if Path(out_dir).resolve() in (source.resolve(), Path(src_dir).resolve()):
        raise DrafterError(f"{out_dir}: is the checkpoint being exported; pick another "
                           "output directory")
    check_output_dir(out_dir, overwrite)
    model = load_drafter(src_dir, kinds=DRAFTER_KINDS, materialise=True)
    return save_drafter(model, out_dir, dtype=dtype, overwrite=overwrite)
