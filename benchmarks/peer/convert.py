"""A speculators DFlash checkpoint as a drafter directory our loader (and `dflash eval`) reads.

    python -m benchmarks.peer.convert SPEC_CKPT_DIR OUT_DIR [--num-target-layers N]

speculators 0.9.0 saves `architectures: ["DFlashDraftModel"]` but its own layout: the decoder
fields nested under `transformer_layer_config`, `aux_hidden_state_layer_ids` in the HF
hidden_states numbering, `mask_token_id` and `block_size` at the top, no `dflash_config`.
Our loader (dflash_train.drafter.checkpoint) reads the z-lab layout and refuses it. The
weights need nothing: both name them fc / hidden_norm / layers.N.* / norm and neither stores
embed_tokens or lm_head for a full-vocabulary drafter. So this rewrites config.json into the
z-lab layout (layer ids - 1, the inverse of writer.speculators_layer_ids) and writes the
drafter through our own save_drafter, after our loader's key and shape checks. Refused, as
computing something else under our forward: a reduced draft vocabulary, a drafter that
predicts its anchor slot (sample_from_anchor), sliding-window layers (see zlab_config).
"""

import argparse
import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from dflash_train.drafter.checkpoint import save_drafter
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.hf_config import ARCHITECTURE, drafter_config_from_dict
from dflash_train.drafter.model import DFlashDrafter

_DECODER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                   "max_position_embeddings", "layer_types", "sliding_window", "vocab_size",
                   "attention_bias", "hidden_act")


def zlab_config(spec: dict[str, Any], num_target_layers: int | None = None) -> dict[str, Any]:
    """speculators' DFlash config.json -> the z-lab DFlash config.json fields we read."""
    if spec.get("speculators_model_type") != "dflash":
        raise DrafterError(f"speculators_model_type {spec.get('speculators_model_type')!r}; "
                           "only dflash checkpoints convert")
    if spec.get("sample_from_anchor"):
        raise DrafterError("sample_from_anchor=true (the anchor slot predicts too): a z-lab "
                           "drafter never predicts its anchor")
    if spec.get("draft_vocab_size") != spec["transformer_layer_config"]["vocab_size"]:
        raise DrafterError("a reduced draft vocabulary (d2t/t2d) has no z-lab equivalent")
    layer = spec["transformer_layer_config"]
    if "sliding_attention" in (layer.get("layer_types") or []):
        # its window is counted back from the block's anchor for every slot (keys a-W..a-1),
        # ours from each query position (keys p-W+1..p): the drafter would be evaluated on a
        # context it was not trained on
        raise DrafterError("sliding-window layers: speculators' window edge differs from "
                           "ours; train the peer with --full-attention-indices on every layer")
    rope = layer.get("rope_parameters") or {}
    raw = {name: layer[name] for name in _DECODER_FIELDS if name in layer}
    raw.update(
        architectures=[ARCHITECTURE], model_type="qwen3",
        rope_theta=rope.get("rope_theta", layer.get("rope_theta")),
        rope_scaling={"rope_type": rope.get("rope_type", "default")},
        block_size=spec["block_size"],
        dflash_config={"mask_token_id": spec["mask_token_id"],
                       "target_layer_ids": [k - 1 for k in spec["aux_hidden_state_layer_ids"]],
                       "block_size": spec["block_size"]},
    )
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        raw["partial_rotary_factor"] = rope["partial_rotary_factor"]  # refused by our loader
    if num_target_layers is not None:
        raw["num_target_layers"] = num_target_layers
    return raw


def convert(src: str | Path, out: str | Path, num_target_layers: int | None = None,
            overwrite: bool = False) -> Path:
    """Write `src` (a speculators checkpoint directory) as a drafter directory at `out`."""
    src = Path(src)
    spec = json.loads((src / "config.json").read_text())
    config = drafter_config_from_dict(zlab_config(spec, num_target_layers),
                                      str(src / "config.json"))
    state = load_file(str(src / "model.safetensors"))
    model = DFlashDrafter(config)
    expected = model.state_dict()
    if set(state) != set(expected):
        raise DrafterError(f"{src}: weights {sorted(set(state) ^ set(expected))[:8]} do not "
                           "match the drafter its config describes")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # torch's message names every weight of the wrong shape
        first = str(e).split("\n\t")[1] if "\n\t" in str(e) else str(e)
        raise DrafterError(f"{src}/model.safetensors: {first.strip()}") from e
    return save_drafter(model, out, dtype=state["fc.weight"].dtype, overwrite=overwrite)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="a speculators checkpoint directory (save-path/N)")
    ap.add_argument("out", help="new drafter directory")
    ap.add_argument("--num-target-layers", type=int, default=None,
                    help="the target's layer count, recorded for SGLang")
    ap.add_argument("--overwrite", action="store_true", help="replace a previous export")
    args = ap.parse_args()
    try:
        print(convert(args.src, args.out, args.num_target_layers, args.overwrite))
    except DrafterError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
