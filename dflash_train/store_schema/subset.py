"""A new store holding some (or all) of another store's samples, with its frozen rows and files.

Used to re-code a store (`dflash store convert`: another hidden dtype, or fp8 context, without
running the target again), and to evaluate on a slice of one (quickstart: the held-out answers
that do not loop). Parts keep their indices and source-row ranges, so a kept sample keeps its
part and row; a part with nothing kept is written empty and complete.
"""

from collections.abc import Callable
from dataclasses import replace

import torch
from tqdm import tqdm

from dflash_train.dtypes import torch_dtype
from dflash_train.store_schema.errors import StoreError
from dflash_train.store_schema.frozen import write_frozen
from dflash_train.store_schema.sample import Sample
from dflash_train.store_schema.store import create_store, open_store

KEEP_CONTEXT_DTYPE = "keep"
"""`copy_store(context_dtype=...)`: store context as the source does."""


def copy_store(src_url: str, dst_url: str, keep: Callable[[Sample], bool] | None = None, *,
               hidden_dtype: str | None = None, context_dtype: str | None = KEEP_CONTEXT_DTYPE,
               progress: bool = False) -> tuple[int, int]:
    """Copy the committed samples of `src_url` that `keep` accepts (all by default) into a new
    store at `dst_url`; returns (samples kept, samples seen). hidden_dtype: the copy's hidden
    dtype (None: the source's); context_dtype: how the copy stores context (None: in its
    hidden dtype; "float8_e4m3": fp8; KEEP_CONTEXT_DTYPE: as the source). The copy's context
    is the source's as readers see it, cast to the hidden dtype, then encoded: fp8 from a
    float32 store is thus quantized from bf16 values, as extract in bf16 would."""
    src = open_store(src_url)
    meta = replace(src.meta, hidden_dtype=hidden_dtype or src.meta.hidden_dtype,
                   context_dtype=src.meta.context_dtype if context_dtype == KEEP_CONTEXT_DTYPE
                   else context_dtype, schema_version=None)
    dtype = torch_dtype(meta.hidden_dtype)
    dst = create_store(dst_url, meta, shard_tokens=src.shard_tokens, copying_from=src_url)
    write_frozen(dst, src.target_rows(), {group: src.read_files(group)
                                          for group in ("target", "tokenizer")})
    kept = seen = 0
    bar = tqdm(total=src.num_samples, unit="sample", disable=not progress, desc="copy")
    for part in src.parts():
        writer = dst.part_writer(part.index, part.row_start, part.row_stop)
        for i, sample in enumerate(part.iter_samples()):
            seen += 1
            bar.update()
            if keep is None or keep(sample):
                where = f"{src_url} part {part.index} sample {i} (source row {sample.source_row})"
                context = _cast_context(sample.context, dtype, where, meta.context_layer_ids)
                writer.append(replace(sample, context=context))
                kept += 1
        writer.finish()
    bar.close()
    dst.copy_done()  # last: until here every reader refuses the copy
    return kept, seen


def _cast_context(context: torch.Tensor, dtype: torch.dtype, where: str, layer_ids: list[int]
                  ) -> torch.Tensor:
    """`context` in `dtype`; StoreError naming the value, token and layer when a finite value
    lies past `dtype`'s range (float16 ends at 65504: hidden-state outliers reach it), so
    the copy refuses it as an overflow and not as NaN or Inf in the source."""
    cast = context.to(dtype)
    if torch.finfo(dtype).max >= torch.finfo(context.dtype).max or torch.isfinite(cast).all():
        return cast
    past = torch.isfinite(context) & ~torch.isfinite(cast)
    if not past.any():
        return cast  # NaN or Inf already in the source: the part writer names that
    flat = torch.where(past, context.abs(), 0).flatten().argmax().item()
    token, layer, channel = torch.unravel_index(torch.tensor(flat), context.shape)
    value = context[token, layer, channel].item()
    raise StoreError(
        f"{where}: context value {value:g} (token {token.item()}, layer "
        f"{layer_ids[layer.item()]}, channel {channel.item()}) overflows {_dtype_name(dtype)} "
        f"(largest {torch.finfo(dtype).max:g}); convert to bfloat16 (float32's range) or "
        "keep the source's dtype")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
