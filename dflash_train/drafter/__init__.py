"""The DFlash drafter: model, block masks, and the serving checkpoint format.

- `config.py`: `DrafterConfig` (the architecture, field for field config.json; `kind`
  dflash or dflash2) and `default_target_layer_ids`, the one home of the layer-id formula
  (docs/reference.md §2).
- `masks.py`: block positions a..a+B-1 and who-sees-whom, as a dense SDPA mask, as the
  split masks (context keys, own-block keys) and as a flex-attention BlockMask, all
  evaluated from one shared predicate.
- `split_attention.py`: attention over exactly the keys a block may see, recomputing its
  probabilities in backward (the CPU training path).
- `model.py`: `DFlashDrafter`. `decode_blocks` is the one pass of blocks through the
  layers, over the projected context (training: `forward(context, context_lengths,
  block_ids, anchors)`) or over a context KV cache built by `extend_context` (replay at any
  anchors; live `draft_block` at the cache's end). The target's embed_tokens / lm_head are
  borrowed frozen via `attach_target_head`, never saved.
- `dflash2.py`: DFlash 2's additions (config `kind="dflash2"`): the in-block
  `GroupedDynamicCausalConv` each decoder layer wraps around its attention and MLP, and the
  `CandidateSelector` whose greedy walk `DFlashDrafter.propose` follows.
- `checkpoint.py`: `save_drafter` / `load_drafter` / `export_checkpoint` in the HF
  directory format vLLM, SGLang and z-lab load (docs/reference.md §9), and the AutoModel
  shim every directory ships; `hf_config.py` maps DrafterConfig to and from config.json,
  `hf_weights.py` reads and checks model.safetensors, `files.py` writes a directory
  atomically with a sha256 record (checksums.json) that loading verifies, and allows an
  overwrite of only an empty directory or a previous export. `dflash_train.run_layout`
  names the files.

Typical use (the caller applies the lm_head, in chunks if memory is tight):

    model = DFlashDrafter(DrafterConfig.for_target(target_cfg, mask_token_id=248070),
                          embed_tokens=embed, lm_head=head)
    ids = build_block_ids(anchor_tokens, model.config.mask_token_id, model.config.block_size)
    hidden = model(features, lengths, ids, anchors)      # [N, K, B, H]
    logits = model.logits(hidden[:, :, 1:])              # slot k predicts position a+k

This package never reads the feature store, samples anchors, or computes losses.
"""

from dflash_train.blocks import build_block_ids
from dflash_train.drafter.checkpoint import export_checkpoint, load_drafter, save_drafter
from dflash_train.drafter.config import (
    AttentionShape,
    DrafterConfig,
    default_target_layer_ids,
    published_attention,
)
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.hf_config import read_drafter_config
from dflash_train.drafter.masks import BlockLayout, dense_mask, flex_block_mask
from dflash_train.drafter.model import ContextCache, DFlashDrafter
from dflash_train.run_layout import DRAFTER_SUBDIR

__all__ = [
    "DRAFTER_SUBDIR",
    "AttentionShape",
    "BlockLayout",
    "ContextCache",
    "DFlashDrafter",
    "DrafterConfig",
    "DrafterError",
    "build_block_ids",
    "default_target_layer_ids",
    "dense_mask",
    "export_checkpoint",
    "flex_block_mask",
    "load_drafter",
    "published_attention",
    "read_drafter_config",
    "save_drafter",
]
