"""A drafter whose decoder layers start as copies of target decoder layers, to train from.

    python -m benchmarks.target_layer_init --store TRAIN.zarr --model TARGET_DIR --layer 29 \
        --out init_L29 [--layers 1] [--draft-vocab-size 4096] [--final-norm]
    dflash train --store TRAIN.zarr ... --set model.init_from=init_L29

Issue 28 item 7's last arm: does a pretrained target layer train into a better drafter than
the seeded one? Drafter layer i takes target layer `--layer` + i's attention, MLP and both
norms (the drafter's q/k norms, which a Llama target lacks, stay at one); `--final-norm` also
takes the target's final norm. Everything else is the drafter train would seed (same seed,
same shape), with the draft vocabulary train would count, so the two differ in the copied
weights only. An experiment's tool, not a train option: it lost (docs/real_target.md).
"""

import argparse
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.driver import package_errors_as_one_line
from dflash_train.drafter import DFlashDrafter, save_drafter
from dflash_train.store_schema import open_store
from dflash_train.train.config import ModelConfig, TrainConfig
from dflash_train.train.drafter_shape import drafter_config, most_frequent_labels

TARGET_PREFIX = "model.layers.{}."


def target_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the target's safetensors files, by name."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model_dir}: no *.safetensors files (a Hugging Face model directory)")
    weights = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            weights.update({name: f.get_tensor(name) for name in f.keys()})
    return weights


def copy_target_layers(model: DFlashDrafter, weights: dict, first: int,
                       final_norm: bool) -> list[str]:
    """Load target layers first.. into the drafter's layers in place; the parameters left as
    seeded."""
    state, kept = model.state_dict(), []
    for name in state:
        index, _, rest = name.removeprefix("layers.").partition(".")
        source = (TARGET_PREFIX.format(first + int(index)) + rest if name.startswith("layers.")
                  else "model.norm.weight" if name == "norm.weight" and final_norm else None)
        if source is None or source not in weights:
            kept.append(name)
        elif weights[source].shape != state[name].shape:
            raise SystemExit(f"{source} is {tuple(weights[source].shape)}, the drafter's "
                             f"{name} {tuple(state[name].shape)}")
        else:
            state[name] = weights[source].to(state[name].dtype)
    model.load_state_dict(state)
    trained = dict(model.named_parameters())
    return [name for name in kept if name in trained]


@package_errors_as_one_line
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="The train store (shape, vocabulary).")
    parser.add_argument("--model", type=Path, required=True, help="The target's HF directory.")
    parser.add_argument("--layer", type=int, required=True, help="First target layer copied.")
    parser.add_argument("--out", type=Path, required=True, help="The drafter directory.")
    parser.add_argument("--layers", type=int, default=1, help="Drafter layers.")
    parser.add_argument("--draft-vocab-size", type=int, default=4096, help="0: all.")
    parser.add_argument("--final-norm", action="store_true", help="Copy the final norm too.")
    parser.add_argument("--seed", type=int, default=0, help="As train's run.seed.")
    args = parser.parse_args()
    store = open_store(args.store)
    cfg = TrainConfig(stores=[args.store], model=ModelConfig(
        num_hidden_layers=args.layers, draft_vocab_size=args.draft_vocab_size or None))
    config = drafter_config(cfg, store)
    if not 0 <= args.layer <= config.num_target_layers - args.layers:
        raise SystemExit(f"--layer {args.layer}: the target has {config.num_target_layers} "
                         f"layers, the drafter takes {args.layers} from it")
    weights = target_weights(args.model)
    torch.manual_seed(args.seed)
    model = DFlashDrafter(config)
    if config.draft_vocab_size:
        model.set_draft_vocab(most_frequent_labels([store], config.draft_vocab_size)[0])
    kept = copy_target_layers(model, weights, args.layer, args.final_norm)
    print(f"copied target layers {args.layer}..{args.layer + args.layers - 1}; seeded: "
          f"{', '.join(kept)}")
    print(save_drafter(model, args.out, overwrite=True))


if __name__ == "__main__":
    main()
