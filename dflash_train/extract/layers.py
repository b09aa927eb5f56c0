"""Which target layers extract captures: the DFlash default formula and the user's --layers.

Owns the choice and checking of layer ids only; never touches a model.
"""

from dflash_train.drafter.config import default_target_layer_ids
from dflash_train.drafter.errors import DrafterError
from dflash_train.extract.errors import ExtractError

DEFAULT_NUM_FEATURES = 5
"""Context layers a DFlash drafter reads by default (docs/reference.md §2)."""


def resolve_layer_ids(spec: str | None, num_layers: int) -> list[int]:
    """Layer ids from a comma list such as "1,16,31", or the default formula when None."""
    if spec is None:
        # tiny targets (L < n + 4) make the formula repeat ids; keep each once
        try:
            ids = sorted(set(default_target_layer_ids(num_layers, DEFAULT_NUM_FEATURES)))
        except DrafterError as e:
            raise ExtractError(f"{e}; pass --layers") from e
    else:
        try:
            ids = [int(x) for x in spec.split(",")]
        except ValueError as e:
            raise ExtractError(f"--layers {spec!r}: expected comma-separated integers") from e
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ExtractError(
            f"--layers: ids {bad} out of range; the target has {num_layers} layers "
            f"(valid ids 0..{num_layers - 2}, id k = output of decoder layer k)"
        )
    if num_layers - 1 in ids:
        # docs/reference.md §2: HF's last hidden_states entry is post-final-norm (z-lab extracts
        # that), while serving engines capture layer outputs before the norm or not at all:
        # a drafter trained on one would be served the other.
        raise ExtractError(
            f"--layers: id {num_layers - 1} is the target's last layer, whose captured state "
            f"differs between trainers and serving engines (before or after the final "
            f"norm); use ids 0..{num_layers - 2}"
        )
    if len(set(ids)) != len(ids):
        raise ExtractError(f"--layers {ids}: repeated ids")
    if ids != sorted(ids):
        # serving engines collect a drafter's context layers in ascending order, whatever
        # order its config lists: fc weights trained on another order would read them swapped
        raise ExtractError(f"--layers {ids}: list the ids in ascending order "
                           f"({','.join(map(str, sorted(ids)))})")
    return ids
