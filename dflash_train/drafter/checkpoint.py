"""Drafter directories in the format vLLM / SGLang / z-lab load (docs/reference.md §9).

A drafter directory is `config.json` (architectures DFlashDraftModel, model_type qwen3,
Qwen3 fields, layer_types, block_size, dflash_config) plus `model.safetensors` keyed
`fc.weight`, `hidden_norm.weight`, `layers.N.*`, `norm.weight`: no embed_tokens, no
lm_head. A DFlash 2 drafter's is z-lab's DFlash2DraftModel format: architectures
DFlash2DraftModel, dflash_config adds conv_kernel_size, conv_group_size, selector_rank and
selector_top_k, and the weights add `layers.N.{attention_conv,mlp_conv}.{base_kernel,
kernel_projection.weight}` and `candidate_selector.{hidden_projection.weight,
predecessor_codebook,successor_codebook}` (the codebooks bare, as published; the
`.weight`-suffixed names z-lab's own save_pretrained writes load too). A drafter trained
with factorised codebooks (A = E W) also holds its factors `candidate_selector.{predecessor,
successor}_factor` and `dflash_config.selector_codebooks = "factorised"`, for resuming;
export drops both, so what engines load is the reference format exactly. Our own save format
IS this format, so a training checkpoint holds such a directory under `drafter/` (next to
optimiser state) and export is a validated copy.

Every directory we write also holds `checksums.json` (sha256 of the other files, written
last): load_drafter verifies it when present, so flipped bytes are refused instead of being
evaluated, exported or resumed. Serving engines read config.json and *.safetensors only and
ignore other files; directories without the record (z-lab / HF downloads) load unverified.
A training checkpoint around `drafter/` loads only when it is whole (check_checkpoint_whole:
its COMPLETE marker and its own checksums.json), so a half-copied one is refused by eval,
export and init_from alike. No weight holding NaN or Inf is ever written or loaded
(check_finite, the one check every writer of weights and optimiser state calls).

Every directory we write ships `modeling_dflash_train.py` too, which config.json's auto_map
names, so that transformers' `AutoModel.from_pretrained(dir, trust_remote_code=True)` works
(z-lab's Hub repos ship their own module; naming one without shipping it made that call
fail). It only re-exports AutoModelLoader, which returns load_drafter's DFlashDrafter: one
implementation of the drafter, so it needs dflash-train installed and says so when it is
not. Leaving auto_map out instead would have that call build transformers' plain Qwen3Model
(fc and hidden_norm dropped, embed_tokens random), as AutoModel without remote code does
anyway: model_type qwen3 is what vLLM, SGLang and z-lab's loader read, so it stays, and
transformers' load report names the mismatch. vLLM and SGLang resolve the drafter by
`architectures` (DFlashDraftModel) and never read auto_map or the module; z-lab's
`DFlashDraftModel.from_pretrained` ignores both.

Owns reading/writing those files, atomically (temp dir + rename) and with the modes the
user's umask gives new files (a serving engine running as another user must read them), and
the rule of what an overwrite may replace. Never trains, never touches optimiser state, never
reads the feature store, and never deletes a directory that holds anything but a drafter's
own files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_train.drafter.config import (
    DEFAULT_BLOCK_SIZE,
    DFLASH2_FIELDS,
    DRAFTER_KINDS,
    DrafterConfig,
    DrafterKind,
)
from dflash_train.drafter.dflash2 import FACTORS, embedded_codebook
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.hashing import file_sha256

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CHECKSUMS_NAME = "checksums.json"
"""sha256 of every other file a drafter directory was written with."""
LOADER_MODULE = "modeling_dflash_train"
"""The module every drafter directory we write ships for transformers' AutoModel (auto_map)."""
LOADER_NAME = f"{LOADER_MODULE}.py"
OWN_FILES = (CONFIG_NAME, WEIGHTS_NAME, LOADER_NAME, CHECKSUMS_NAME)
"""Everything save_drafter / export write: the only files an overwrite may replace."""
DRAFTER_SUBDIR = "drafter"
"""Where a training checkpoint keeps its drafter directory."""
COMPLETE_NAME = "COMPLETE"
"""A training checkpoint's marker, written last (dflash_train.train.checkpoint)."""
TRAINER_STATE_NAME = "trainer.pt"
PROVENANCE_NAME = "provenance.json"
"""A training checkpoint's record of the store it was trained on."""
TRAIN_CONFIG_NAME = "config.toml"
CHECKPOINT_FILES = (COMPLETE_NAME, TRAINER_STATE_NAME, PROVENANCE_NAME)
"""Files only a training checkpoint holds beside drafter/: any one of them marks the
directory as one (z-lab / HF drafter directories hold none; a run directory holds a
config.toml too, so that is no mark)."""

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES: dict[DrafterKind, str] = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel"}
"""config.json's architectures entry per drafter kind (z-lab's class names)."""
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
"""Tensors published bare, which z-lab's save_pretrained writes with a `.weight` suffix."""
PROC_STATUS = Path("/proc/self/status")
"""Where Linux reports the process's umask without it being changed to read it."""

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


class DamagedFile(DrafterError):
    """A file a directory's record (checksums.json, the COMPLETE marker) vouches for is
    missing or differs; `path` names it, `reason` says how."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def config_to_dict(config: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json contents, the fields of the published z-lab DFlash checkpoints."""
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[config.kind]],
        "auto_map": {"AutoModel": f"{LOADER_MODULE}.{AutoModelLoader.__name__}"},
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
    # Unknown for third-party drafters without it: a null here makes SGLang fall back to the
    # drafter's own layer count and reject the target layer ids, and no value can be derived
    # exactly (max(target_layer_ids) + 1 is only a lower bound), so the key is left out.
    if config.num_target_layers is not None:
        raw["num_target_layers"] = config.num_target_layers
    return raw


def _plain_number(value: float) -> float | int:
    # Published configs write "rope_theta": 1000000; keep integral values integral.
    return int(value) if float(value).is_integer() else value


def config_from_dict(raw: Mapping[str, Any], source: str = CONFIG_NAME) -> DrafterConfig:
    """Parse our config.json or a third-party DFlash / DFlash 2 one (z-lab, vLLM
    conventions)."""
    kind = _kind(raw.get("architectures") or [], source)
    if raw.get("model_type", "qwen3") != "qwen3":
        raise DrafterError(f"{source}: model_type {raw['model_type']!r}; only qwen3 drafters")
    draft = dict(raw.get("dflash_config") or {})
    _refuse_unsupported(raw, draft, source, kind)

    def pick(name: str, default: Any = None) -> Any:
        # dflash_config first, then the top level: the order z-lab's loader reads them in.
        return draft.get(name, raw.get(name, default))

    dflash2: dict[str, Any] = {}
    if kind == "dflash2":
        for name in DFLASH2_FIELDS:
            if pick(name) is None:
                raise DrafterError(f"{source}: a DFlash2DraftModel needs dflash_config.{name}")
            dflash2[name] = int(pick(name))
        dflash2["selector_codebooks"] = draft.get("selector_codebooks", "free")

    for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "vocab_size"):
        if raw.get(name) is None:
            raise DrafterError(f"{source}: missing field {name!r}")
    for name in ("target_layer_ids", "mask_token_id"):
        if pick(name) is None:
            raise DrafterError(f"{source}: missing dflash_config.{name}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise DrafterError(f"{source}: rope type {rope.get('rope_type')!r}; only default RoPE")
    rope_theta = raw.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        raise DrafterError(f"{source}: no rope_theta (top level or rope_parameters)")
    is_causal = raw.get("is_causal", draft.get("causal"))
    heads = int(raw["num_attention_heads"])
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
        **dflash2,
    )


def _kind(architectures: list[str], source: str) -> DrafterKind:
    kinds = [kind for kind, name in ARCHITECTURES.items() if name in architectures]
    if len(kinds) != 1:
        names = " or ".join(repr(name) for name in ARCHITECTURES.values())
        raise DrafterError(f"{source}: architectures {architectures} is not [{names}]")
    return kinds[0]


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
    same_as = {"target_hidden_size": "hidden_size", "draft_vocab_size": "vocab_size",
               "v_head_dim": "head_dim"}
    for name, base in same_as.items():
        if raw.get(name) not in (None, raw.get(base)):
            raise DrafterError(f"{source}: {name}={raw[name]} differs from {base}; unsupported")


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
    weights = with_materialised_codebooks(model, weights)
    check_finite(weights, f"{out_dir}: the drafter's weights")
    state = {
        name: (t if dtype is None else t.to(dtype)).detach().to("cpu").contiguous()
        for name, t in weights.items()
    }
    stored = state["fc.weight"].dtype
    raw = config_to_dict(model.config, stored)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / LOADER_NAME).write_text(LOADER_SOURCE)
        write_checksums(tmp, [CONFIG_NAME, WEIGHTS_NAME, LOADER_NAME])

    return _write_dir_atomically(Path(out_dir), write, overwrite)


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


def nonfinite_tensors(tree: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors holding NaN or Inf anywhere in `tree` (a
    tensor, or dicts / lists / tuples of them: a state dict, an optimizer state)."""
    if isinstance(tree, torch.Tensor):
        bad = (tree.is_floating_point() or tree.is_complex()) and not bool(
            torch.isfinite(tree).all())
        return [prefix or "tensor"] if bad else []
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return []
    return [name for key, value in items
            for name in nonfinite_tensors(value, f"{prefix}.{key}" if prefix else str(key))]


def check_finite(tree: Any, what: str) -> None:
    """Refuse `what` (weights or optimizer state about to be written, or just read) when
    any of its tensors holds NaN or Inf: a diverged run's state is never kept as a
    checkpoint, an export or a drafter to evaluate."""
    bad = nonfinite_tensors(tree)
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise DrafterError(f"{what}: {shown} hold(s) NaN or Inf (a diverged run?); refusing "
                           "to use them")


def training_checkpoint_root(path: str | os.PathLike) -> Path | None:
    """The training checkpoint `path` is or lies in (its `drafter/`), else None: a
    directory with no config.json of its own that holds `drafter/` or any of
    CHECKPOINT_FILES."""
    path = Path(path)
    if path.name == DRAFTER_SUBDIR and any((path.parent / n).exists() for n in CHECKPOINT_FILES):
        return path.parent
    if (path / CONFIG_NAME).is_file():
        return None
    if (path / DRAFTER_SUBDIR).is_dir() or any((path / n).exists() for n in CHECKPOINT_FILES):
        return path
    return None


def check_checkpoint_whole(root: str | os.PathLike) -> None:
    """Refuse a training checkpoint that is not whole, naming what is missing or differs:
    no COMPLETE marker (a save or a copy cut short), or a file its checksums.json lists that
    is missing or differs (the drafter/ directory must then carry its own record too).
    A checkpoint written before checksums.json existed is checked for its marker only."""
    root = Path(root)
    if not (root / COMPLETE_NAME).is_file():
        raise DamagedFile(
            root, f"not a complete training checkpoint (no {COMPLETE_NAME} marker: its save "
            "or its copy was cut short); copy it again whole, or pick another checkpoint")
    if not (root / CHECKSUMS_NAME).is_file():
        return
    verify_checksums(root)
    drafter_record = root / DRAFTER_SUBDIR / CHECKSUMS_NAME
    if not drafter_record.is_file():
        raise DamagedFile(drafter_record, f"missing, though the checkpoint {root} records "
                          "checksums (its copy was cut short?); copy it again whole")


def write_checksums(directory: Path, names: list[str]) -> None:
    """Record the sha256 of `names` in `directory`/checksums.json, last and atomically."""
    record = {"algorithm": "sha256",
              "files": {name: file_sha256(directory / name) for name in names}}
    tmp = directory / f".{CHECKSUMS_NAME}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / CHECKSUMS_NAME)


def verify_checksums(directory: str | os.PathLike) -> bool:
    """Check the files against checksums.json; False when there is no record (third-party
    directories), DrafterError naming the file when one differs or is missing."""
    directory = Path(directory)
    record_path = directory / CHECKSUMS_NAME
    if not record_path.is_file():
        return False
    try:
        record = json.loads(record_path.read_text())
        files = record["files"]
        if record.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("expected {'algorithm': 'sha256', 'files': {name: hex}}")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise DrafterError(f"{record_path}: unreadable checksum record ({err})") from err
    for name, want in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise DamagedFile(path, f"listed in {CHECKSUMS_NAME} but missing")
        got = file_sha256(path)
        if got != want:
            raise DamagedFile(
                path, f"sha256 {got[:16]}... does not match {CHECKSUMS_NAME} "
                f"({str(want)[:16]}...): the file is corrupt or was changed after saving "
                f"(delete {CHECKSUMS_NAME} only if you changed it on purpose)")
    return True


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
    config = read_config(directory)
    if config.kind not in kinds:
        raise DrafterError(
            f"{directory}: a {ARCHITECTURES[config.kind]} ({config.kind}) drafter; this step "
            f"takes {' and '.join(ARCHITECTURES[k] for k in kinds)} only (it does not follow "
            "DFlash 2's selector walk)")
    state = _published_names(_read_weights(directory))
    check_finite(state, f"{directory}: weights")
    if config.kind == "dflash2" and config.selector_codebooks == "factorised":
        config, state = _factorised_as(config, state, directory, materialise)
    with torch.device("meta"):
        model = DFlashDrafter(config)
    _check_keys(model, state, directory)
    model.load_state_dict(state, assign=True)
    return model.to(device=device, dtype=dtype)


def read_config(directory: str | os.PathLike) -> DrafterConfig:
    """The DrafterConfig of a drafter directory, without loading weights."""
    path = Path(directory) / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise DrafterError(f"{path}: not found; not a drafter directory") from err
    except json.JSONDecodeError as err:
        raise DrafterError(f"{path}: invalid JSON ({err})") from err
    return config_from_dict(raw, str(path))


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


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool,
                     flag: str = "overwrite=True") -> None:
    """Refuse `out_dir` unless it is new, or `overwrite` and it is empty or holds only a
    previous drafter's own files (OWN_FILES, config.json naming one of ARCHITECTURES).

    flag: how the caller's user asks for an overwrite (`--overwrite` on the command line).
    """
    out = Path(out_dir)
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise DrafterError(f"{out}: already exists (pass {flag} to replace a previous export)")
    if out.is_symlink() or not out.is_dir():
        raise DrafterError(f"{out}: is not a directory; refusing to replace it")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    foreign = [n for n in entries if n not in OWN_FILES or not (out / n).is_file()]
    config = out / CONFIG_NAME
    if not foreign and config.is_file():
        try:
            architectures = json.loads(config.read_text()).get("architectures") or []
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            architectures = []
        if set(ARCHITECTURES.values()) & set(architectures):
            return
    shown = ", ".join(entries[:6]) + (f", ... ({len(entries)} entries)"
                                      if len(entries) > 6 else "")
    raise DrafterError(f"{out}: holds {shown}, not only a previous DFlash export; refusing to "
                       "replace it (remove it yourself or pick another directory)")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
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


def _factorised_as(config: DrafterConfig, state: dict[str, torch.Tensor], where: Path,
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


def _check_keys(model: DFlashDrafter, state: Mapping[str, torch.Tensor], where: Path) -> None:
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


def current_umask() -> int:
    """The process's umask, read without changing it where the kernel reports it."""
    try:  # Linux >= 4.7 lists it in /proc/self/status
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    # Elsewhere the only way to read it is to set it: set the strictest mask and restore at
    # once, so a file another thread creates in between is at worst too private.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def new_file_modes() -> tuple[int, int]:
    """(file, directory) permission bits the user's umask gives a newly created file and
    directory (0644 / 0755 under umask 022). The temp dir and safetensors' file are
    private (0700 / 0600) whatever the umask; a server running as another user or in a
    container must be able to read an export, so its files get these instead."""
    mask = current_umask()
    return 0o666 & ~mask, 0o777 & ~mask


def _write_dir_atomically(
    out_dir: Path, write: Callable[[Path], None], overwrite: bool
) -> Path:
    """Write into a sibling temp dir, then rename it into place: a crash never leaves a
    half-written drafter at `out_dir`. Only a directory check_output_dir accepts is
    replaced. The directory and its files get the modes the umask gives new ones
    (new_file_modes), set before the rename, so the published directory is never private."""
    check_output_dir(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        file_mode, dir_mode = new_file_modes()
        for file in tmp.iterdir():
            with open(file, "rb") as handle:
                os.fchmod(handle.fileno(), file_mode)
                os.fsync(handle.fileno())
        os.chmod(tmp, dir_mode)
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{tmp.name}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
