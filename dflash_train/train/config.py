"""The training configuration: one dataclass tree, loadable from TOML, overridable per field.

Sections mirror what a reader meets in the loop: where the data comes from (`loader`), what the
drafter looks like (`model`), what it minimises (`loss`), the regulariser (`noise`), how it
steps (`optim`), how the run is kept (`run`) and what it is measured on at each checkpoint
(`validation`). Unknown keys are errors, never ignored.
"""

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_train.blocks import ANCHORS_PER_SEQ, BLOCK_SIZE, MAX_SEED
from dflash_train.drafter.config import (
    DFLASH2_FIELDS,
    DRAFT_VOCAB_RULE,
    MIN_DRAFT_VOCAB,
    DrafterConfig,
    max_conv_kernel_size,
)
from dflash_train.drafter.model import FinalNormInit
from dflash_train.evaluate.tree import budget_cap_refusal, tree_budget_refusal
from dflash_train.train.errors import TrainError
from dflash_train.train.loader_config import LoaderConfig
from dflash_train.train.loss import LossConfig
from dflash_train.train.noise import NoiseConfig
from dflash_train.train.options import option_name, require


@dataclass
class ModelConfig:
    """Shape of the drafter; width, vocabulary and layer ids always come from the store."""

    num_hidden_layers: int | None = None
    """Drafter decoder layers; None: 5 as the released drafters (a resumed or init_from
    drafter: its own)."""
    num_attention_heads: int | None = None
    """Query heads; None: the released drafter's for a published target (Qwen3.5/3.6-27B:
    32), else the target's."""
    num_key_value_heads: int | None = None
    """Key/value heads; None: the released drafter's (27B: 8), else the target's."""
    head_dim: int | None = None
    """Head width; None: the released drafter's (27B: 128), else the target's."""
    intermediate_size: int | None = None
    """MLP width; None: the target's."""
    sliding_layers: int | None = None
    """How many of the first layers use sliding-window attention; None: the released
    drafter's (27B: 4), else 0."""
    sliding_window: int | None = None
    """Context window of the sliding layers; None: the released drafter's, else 2048."""
    mask_token_id: int | None = None
    """Mask token filling block slots; None: the one extract recorded in the store."""
    init_from: str | None = None
    """Start from this drafter directory or checkpoint instead of random weights. With kind
    dflash2 it may be a DFlash one (a warm start): its backbone weights are copied and the
    DFlash 2 additions start at their identity init, so the drafter starts as that one."""
    kind: Literal["dflash", "dflash2"] = "dflash"
    """dflash: the DFlash drafter. dflash2: DFlash 2 (in-block convolutions around each
    attention and MLP, a candidate selector over each slot's top logits); the loss adds the
    selector term (loss.selector_weight, loss.selector_out_of_top_k)."""
    conv_kernel_size: int | None = None
    """dflash2: taps of each in-block causal convolution; None: 2 (z-lab's release)."""
    conv_group_size: int | None = None
    """dflash2: channels sharing one kernel delta, dividing the width; None: 16."""
    selector_rank: int | None = None
    """dflash2: width r of the selector codebooks; None: 256."""
    selector_top_k: int | None = None
    """dflash2: candidates per slot the selector rescores; None: 16."""
    selector_codebooks: Literal["free", "factorised"] = "free"
    """dflash2: free [V, r] codebooks (z-lab's form), or factorised A = E W_A, B = E W_B
    through the target's frozen embedding E (2 H r parameters instead of 2 V r); export
    writes E W, so engines load either the same way."""

    draft_vocab_size: int | None = None
    """Draft over the N most frequent labels of the train stores only (one counting pass
    before the first step; a resume keeps the checkpoint's): the lm_head work per slot
    shrinks by vocab / N, and a label outside them is a miss the drafter cannot make. The
    export carries vLLM's d2t map; SGLang and z-lab's package ignore it. None: the whole
    vocabulary. DFlash drafters with loss.kind ce only."""
    final_norm_init: FinalNormInit = "unit"
    """How a new drafter's final norm starts: unit (1/sqrt(hidden): the first loss is near
    ln V) or ones (HF's init, what trained before: each slot's output starts along the mask
    token's embedding, and on SmolLM2 the first loss is 57-81 nats). The drafts of the fresh
    drafter are the same under both (drafter.model.FinalNormInit). Not read by a resume or
    init_from: they start from given weights."""

    def __post_init__(self) -> None:
        require(self.draft_vocab_size is None or self.draft_vocab_size >= MIN_DRAFT_VOCAB,
                "model.draft_vocab_size", DRAFT_VOCAB_RULE, self.draft_vocab_size)
        require(self.num_hidden_layers is None or self.num_hidden_layers >= 1,
                "model.num_hidden_layers", ">= 1", self.num_hidden_layers)
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "sliding_window"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"model.{name}", ">= 1", value)
        for name in ("sliding_layers", "mask_token_id"):
            value = getattr(self, name)
            require(value is None or value >= 0, f"model.{name}", ">= 0", value)
        for name in DFLASH2_FIELDS:
            value = getattr(self, name)
            require(value is None or value >= 1, f"model.{name}", ">= 1", value)
        # tap t reads slot i - t of the same block: past the block there is only padding
        limit = max_conv_kernel_size(BLOCK_SIZE)
        require(self.conv_kernel_size is None or self.conv_kernel_size <= limit,
                "model.conv_kernel_size", f"at most {limit} (the block size: a tap past it "
                "reads nothing of the block)", self.conv_kernel_size)


LR_MAX = 1.0
"""Learning rates from here up are refused: AdamW's first steps move every weight by about
lr whatever the gradient, 50x the 0.02 std the drafter's linear weights start at, and runs
so high collapse (the gradient dies) or diverge. Published drafters train at 6e-4."""


MUON_NS_STEPS_MAX = 99
"""torch's Muon refuses 100 Newton-Schulz steps or more."""


@dataclass
class OptimConfig:
    """AdamW (or Muon + AdamW) with linear warmup and cosine decay (docs/reference.md §5)."""

    optimizer: Literal["adamw", "muon"] = "adamw"
    """`adamw`: AdamW on every trained parameter (default). `muon`: Muon (torch's, its
    Newton-Schulz in float32 where bf16 is emulated) on the drafter's 2-D weight matrices
    (fc, attention and MLP projections), AdamW on the rest (norms), as speculators does; one
    schedule drives both."""
    lr: float = 6e-4
    """Peak learning rate, below LR_MAX (AdamW's; Muon's too unless `muon_lr` is set)."""
    muon_lr: float | None = None
    """Peak learning rate of the Muon matrices; None: `lr`, which `muon_adjust_lr_fn`
    match_rms_adamw is made to reuse. The schedule scales it as it scales `lr`."""
    muon_momentum: float = 0.95
    """Muon's momentum, in [0, 1) (torch's and speculators' default)."""
    muon_nesterov: bool = True
    """Muon uses Nesterov momentum (torch's default)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalise each Muon update, 1 to 99."""
    muon_adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """How Muon scales its lr per matrix of shape A x B: `match_rms_adamw` (Moonshot:
    0.2 sqrt(max(A, B)), so AdamW's lr and weight decay carry over; speculators' default) or
    `original` (Keller Jordan: sqrt(max(1, A / B)); wants a larger lr, ~0.02)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr`."""
    warmup_ratio: float = 0.04
    """Fraction of all steps spent warming up linearly from 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, of AdamW and (optimizer muon) of Muon."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    epochs: int = 6
    """Passes over the store."""
    max_steps: int | None = None
    """Stop after this many optimiser steps. The learning-rate schedule (warmup and cosine
    decay) spans the steps the run takes: min(this, the steps of all `epochs`)."""

    def __post_init__(self) -> None:
        require(math.isfinite(self.lr) and 0 < self.lr < LR_MAX, "optim.lr",
                f"a number in (0, {LR_MAX:g}) (AdamW moves every weight by about lr per step; "
                "the drafter's start at std 0.02)", self.lr)
        require(self.muon_lr is None or (math.isfinite(self.muon_lr) and
                                         0 < self.muon_lr < LR_MAX), "optim.muon_lr",
                f"a number in (0, {LR_MAX:g})", self.muon_lr)
        require(math.isfinite(self.muon_momentum) and 0 <= self.muon_momentum < 1,
                "optim.muon_momentum", "in [0, 1)", self.muon_momentum)
        require(1 <= self.muon_ns_steps <= MUON_NS_STEPS_MAX, "optim.muon_ns_steps",
                f"in [1, {MUON_NS_STEPS_MAX}]", self.muon_ns_steps)
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "in [0, 1]",
                self.min_lr_ratio)
        require(0 <= self.warmup_ratio <= 1, "optim.warmup_ratio", "in [0, 1]",
                self.warmup_ratio)
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                "optim.weight_decay", "a finite number >= 0", self.weight_decay)
        betas = tuple(self.betas)
        require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "optim.betas",
                "two numbers in [0, 1)", betas)
        require(self.grad_clip >= 0, "optim.grad_clip", ">= 0 (0 disables clipping)",
                self.grad_clip)
        require(self.epochs >= 1, "optim.epochs", ">= 1", self.epochs)
        require(self.max_steps is None or self.max_steps >= 1, "optim.max_steps", ">= 1",
                self.max_steps)


DEFAULT_CHUNK_BLOCKS = 256
"""run.chunk_blocks off CUDA when unset: ~0.4 GB of activations at width 64, ~2 GB at width
576 over 512-token rows, and no slower than all at once (docs/benchmarks.md)."""


def resolve_chunk_blocks(run: "RunConfig", cuda: bool) -> int | None:
    """The drafter's `chunk_blocks` for this run: None runs every block at once."""
    if run.chunk_blocks is None:
        return None if cuda or run.fsdp else DEFAULT_CHUNK_BLOCKS
    return run.chunk_blocks or None


@dataclass
class RunConfig:
    """Where the run lives and how it is kept."""

    out_dir: str = "runs/drafter"
    """Run directory: checkpoints/, log.jsonl, config.toml."""
    seed: int = 0
    """Seeds weights, data order, anchors and noise."""
    device: str = "auto"
    """auto: cuda when available, else cpu."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 autocast where bf16 matmuls run natively (CUDA; a CPU with AMX or AVX-512
    BF16), else fp32; the run's first lines say which. bf16 keeps fp32 master weights."""
    anchors_per_seq: int = ANCHORS_PER_SEQ
    """Blocks per sequence per epoch (re-sampled every epoch)."""
    pad_blocks_to: int | None = None
    """Round blocks per sequence up to a multiple of this; None: 32 on CUDA, 1 elsewhere."""
    checkpoint_every: int = 500
    """Optimiser steps between checkpoints (one is always written at the end)."""
    keep_checkpoints: int = 3
    """Most recent checkpoints kept; older ones are deleted (0: keep every one), except the
    best on the validation stores (--val-store), which is kept too."""
    patience: int | None = None
    """Stop the run once this many validations in a row have not beaten the best one
    (validation.best_by); None: never. Needs --val-store."""
    log_every: int = 10
    """Steps between log lines with per-slot accuracy."""
    fsdp: bool = False
    """Shard weights, gradients and optimiser state over ranks with FSDP2 instead of DDP."""
    gradient_checkpointing: bool = False
    """Recompute drafter layers in backward to save activation memory."""
    attention: Literal["auto", "split", "dense", "flex"] = "auto"
    """The drafter's attention. split: each block slot is scored against only the keys it
    may see (its context and its own block); dense: one SDPA over every block's keys under a
    mask, whose scores grow with anchors squared, but faster for short rows and few anchors
    (the quickstart's shape: 1.35x); flex: flex_attention, CUDA only; auto: flex on CUDA, split
    elsewhere. Same values up to float rounding (tests/drafter/test_model.py)."""
    chunk_blocks: int | None = None
    """Most blocks (summed over a batch's sequences) one pass through the drafter takes; a
    batch of more runs in chunks, each recomputed in backward, so activation memory follows
    this, not batch_tokens x anchors_per_seq (fp32: ~1 MB a block at width 64, ~10 MB at
    width 576 over 512-token rows). Same values, ~1.3x the compute once chunked. None:
    DEFAULT_CHUNK_BLOCKS off CUDA, unchunked on CUDA (flex kernels compile per shape) and
    under FSDP; 0: never chunk."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = False
    """Also write TensorBoard event files to out_dir/tb (needs the `tb` extra)."""

    def __post_init__(self) -> None:
        require(bool(self.out_dir), "run.out_dir", "a directory", self.out_dir)
        require(0 <= self.seed <= MAX_SEED, "run.seed", f"between 0 and {MAX_SEED}", self.seed)
        require(self.anchors_per_seq >= 1, "run.anchors_per_seq", ">= 1", self.anchors_per_seq)
        require(self.pad_blocks_to is None or self.pad_blocks_to >= 1, "run.pad_blocks_to",
                ">= 1", self.pad_blocks_to)
        require(self.chunk_blocks is None or self.chunk_blocks >= 0, "run.chunk_blocks",
                ">= 0 (0 never chunks)", self.chunk_blocks)
        # FSDP2 gathers a layer's weights on every call: ranks whose batches need different
        # numbers of chunks would wait on each other's gathers forever.
        require(not (self.fsdp and self.chunk_blocks), "run.chunk_blocks",
                "0 or unset with --fsdp (ranks may run different numbers of chunks)",
                self.chunk_blocks)
        require(self.checkpoint_every >= 1, "run.checkpoint_every", ">= 1",
                self.checkpoint_every)
        require(self.keep_checkpoints >= 0, "run.keep_checkpoints", ">= 0 (0 keeps all)",
                self.keep_checkpoints)
        require(self.log_every >= 1, "run.log_every", ">= 1", self.log_every)
        require(self.patience is None or self.patience >= 1, "run.patience",
                ">= 1 (unset: never stop early)", self.patience)


DEFAULT_VAL_LIMIT = 64
"""Samples per validation store (--val-limit) when unset: the long SmolLM2 preset's
validation set."""
DEFAULT_VAL_TREE_BUDGETS = (16,)
"""DDTree budgets validation measures unless told (--tree-budget). Each budget is one more
replay walk, about as dear as the chain's whatever the budget: with the defaults a
validation took 9.0 % of a 400-step checkpoint interval at the long SmolLM2 preset's shape
for an untrained drafter (the most rounds), a second budget 14.3 % (docs/benchmarks.md)."""


@dataclass
class ValidationConfig:
    """The drafter replayed offline on held-back stores at every checkpoint (train.validation),
    as `dflash eval --store V --limit N --seed S --tree-budget B` would replay it there."""

    stores: list[str] = field(default_factory=list)
    """Stores of the train stores' target never trained on (--val-store, repeatable); empty:
    no validation. A store sharing a sample (the same token ids) with a train store, or with
    another validation store, is refused."""
    limit: int | None = DEFAULT_VAL_LIMIT
    """Samples of each validation store replayed (--val-limit): drawn once with `seed`, the
    same at every checkpoint; None: all. Bounds what validation costs."""
    tree_budgets: tuple[int, ...] = DEFAULT_VAL_TREE_BUDGETS
    """DDTree node budgets whose tau is measured (--tree-budget), each its own replay walk;
    () for the chain only."""
    best_by: Literal["tau", "tree_tau"] = "tau"
    """The figure that picks the best checkpoint and that run.patience watches, pooled over
    the validation stores: `tau`, the chain's mean tokens per block (what `dflash eval`
    reports first); `tree_tau`, the DDTree's at the largest of `tree_budgets` (a drafter
    served with DDTree at that budget)."""
    seed: int = 0
    """Seed of the `limit` draw (eval's --seed)."""
    batch_tokens: int = 16384
    """Sequences per replay batch: count x longest <= this. The figures do not depend on it
    (nor on the number of ranks): counts are summed, never per-batch means averaged."""

    def __post_init__(self) -> None:
        require(self.limit is None or self.limit >= 1, "validation.limit",
                ">= 1 (unset: every sample)", self.limit)
        budgets = tuple(self.tree_budgets)
        require(all(b >= 1 for b in budgets) and len(set(budgets)) == len(budgets),
                "validation.tree_budgets", "distinct node budgets >= 1", budgets)
        self.tree_budgets = tuple(sorted(budgets))
        largest = max(budgets, default=1)
        require(budget_cap_refusal(largest) is None, "validation.tree_budgets",
                budget_cap_refusal(largest) or "", largest)
        require(self.best_by != "tree_tau" or bool(budgets), "validation.best_by",
                "tau when validation.tree_budgets is empty (no tree is measured)", self.best_by)
        require(self.seed >= 0, "validation.seed", ">= 0", self.seed)
        require(self.batch_tokens >= 1, "validation.batch_tokens", ">= 1", self.batch_tokens)

    @property
    def best_figure(self) -> str:
        """The best_by figure as logs and best.json name it: tau, or tree_tau@B."""
        return "tau" if self.best_by == "tau" else f"tree_tau@{self.tree_budgets[-1]}"


@dataclass
class TrainConfig:
    """Everything a training run needs; saved with every checkpoint."""

    stores: list[str] = field(default_factory=list)
    """Feature stores to train on (all from the same target and layers)."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def __post_init__(self) -> None:
        # Checked here, across sections, so the run is refused before its directory exists.
        if self.model.kind == "dflash2" and self.loss.kind == "kl-topk":
            raise TrainError("loss.kind kl-topk does not train a DFlash 2 selector (its term "
                             "is a hard CE over each slot's top-K); use loss.kind ce with "
                             "model.kind dflash2")
        if self.run.fsdp and self.validation.stores:
            # FSDP2 gathers a layer's weights only inside its forward; replay reads them
            # outside it (the context cache), and ranks replay different samples.
            raise TrainError("--val-store does not validate under --fsdp (run.fsdp) yet; use "
                             "DDP (drop --fsdp), or validate the checkpoints with dflash eval")
        for rule in ACTS_ONLY_WHEN:
            rule.refuse_if_inert(self)
        _refuse_unfillable_trees(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tree_top_k(model: ModelConfig) -> int | None:
    """Candidates per depth of a validation tree, where the config alone says it: DFlash 2's
    selector top-k, a DFlash draft vocabulary's size; None: it is the store's vocabulary, or
    the init_from drafter's own."""
    if model.init_from is not None:
        return None
    if model.kind == "dflash2":
        return model.selector_top_k or _drafter_default("selector_top_k")
    return model.draft_vocab_size


def _refuse_unfillable_trees(cfg: "TrainConfig") -> None:
    """A validation tree budget no tree of this drafter can reach (evaluate.tree
    max_tree_nodes, over the block's BLOCK_SIZE - 1 drafted slots) is refused now."""
    top_k = _tree_top_k(cfg.model)
    if top_k is None or not cfg.validation.tree_budgets:
        return
    largest = cfg.validation.tree_budgets[-1]  # sorted by ValidationConfig
    rule = tree_budget_refusal(largest, BLOCK_SIZE - 1, top_k)
    require(rule is None, "validation.tree_budgets", rule or "", largest)


def _drafter_default(name: str) -> Any:
    """What an unset ModelConfig field becomes: DrafterConfig's own default."""
    return next(f.default for f in dataclasses.fields(DrafterConfig) if f.name == name)


@dataclass(frozen=True)
class ActsOnlyWhen:
    """Settings that have an effect only under another one. Set away from their default
    without it, a run would silently ignore them, so the config refuses them, naming both."""

    fields: tuple[str, ...]
    """section.field of each such setting."""
    when: str
    """The condition, as a user would write it."""
    holds: Callable[["TrainConfig"], bool]

    def refuse_if_inert(self, cfg: "TrainConfig") -> None:
        if self.holds(cfg):
            return
        for key in self.fields:
            section, name = key.split(".")
            value, default = getattr(getattr(cfg, section), name), _default(section, name)
            shown = "left unset" if default is None else str(default)
            require(value == default, key, f"{shown} unless {self.when} (it has no effect "
                    "otherwise)", value)


ACTS_ONLY_WHEN = (
    ActsOnlyWhen(tuple(f"model.{n}" for n in DFLASH2_FIELDS) + (
        "model.selector_codebooks", "loss.selector_weight", "loss.selector_out_of_top_k"),
        "model.kind is dflash2", lambda c: c.model.kind == "dflash2"),
    ActsOnlyWhen(("model.draft_vocab_size",), "model.kind is dflash and loss.kind is ce (a "
                 "DFlash 2 selector and the top-k KL read the whole vocabulary)",
                 lambda c: c.model.kind == "dflash" and c.loss.kind == "ce"),
    ActsOnlyWhen(("optim.muon_lr", "optim.muon_momentum", "optim.muon_nesterov",
                  "optim.muon_ns_steps", "optim.muon_adjust_lr_fn"),
                 "optim.optimizer is muon", lambda c: c.optim.optimizer == "muon"),
    ActsOnlyWhen(("loss.dpace_alpha",), "loss.position_weights is dpace",
                 lambda c: c.loss.position_weights == "dpace"),
    ActsOnlyWhen(("loss.gamma",), "loss.position_weights is decay",
                 lambda c: c.loss.position_weights == "decay"),
    ActsOnlyWhen(("noise.std", "noise.absolute", "noise.std_end", "noise.schedule_steps",
                  "noise.stats_max_tokens"), "noise.kind is uniform or gaussian",
                 lambda c: c.noise.kind != "none"),
    ActsOnlyWhen(("noise.schedule_steps",), "noise.std_end is set",
                 lambda c: c.noise.std_end is not None),
    ActsOnlyWhen(("noise.stats_max_tokens",), "noise.absolute is false (relative noise "
                  "needs each layer's RMS)", lambda c: not c.noise.absolute),
    ActsOnlyWhen(("run.patience", "validation.limit", "validation.tree_budgets",
                  "validation.best_by", "validation.seed", "validation.batch_tokens"),
                 "--val-store is given", lambda c: bool(c.validation.stores)),
)
"""Every setting that acts only under another: the one place such refusals are made."""


def _default(section: str, name: str) -> Any:
    """The dataclass default of `section.name`, what a config that never set it holds."""
    f = next(f for f in dataclasses.fields(_hints(TrainConfig)[section]) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_INT64 = 2**63
"""Integer settings are 64-bit signed: what TOML holds and torch's seeds take."""


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check (and, for CLI strings, convert) one value against its type hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            if type(None) in args:
                return None
        return _coerce_union(value, [a for a in args if a is not type(None)], where)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise TrainError(f"{where}: {value!r} is not one of {typing.get_args(hint)}")
        return value
    if origin in (list, tuple):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise TrainError(f"{where}: expected a list, got {value!r}")
        (item_hint, *_) = typing.get_args(hint) or (Any,)
        try:
            out = [_coerce(v, item_hint, where) for v in items]
        except TrainError as e:  # name the whole list: which item is wrong, and why
            raise TrainError(f"{where}: {value!r}: {_reason(e, where)}") from None
        return tuple(out) if origin is tuple else out
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
        raise TrainError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float, str):
        if isinstance(value, bool) and hint is not str:
            raise TrainError(f"{where}: expected {hint.__name__}, got {value!r}")
        try:
            converted = hint(value)
        except (TypeError, ValueError, OverflowError) as e:  # int(inf) overflows
            raise TrainError(f"{where}: expected {hint.__name__}, got {value!r}") from e
        if hint is int and isinstance(value, float) and value != converted:
            raise TrainError(f"{where}: expected an integer, got {value!r}")
        if hint is int and not -_INT64 <= converted < _INT64:
            raise TrainError(f"{where}: {converted} is beyond a 64-bit integer (TOML's and "
                             "torch's)")
        return converted
    return value


def _coerce_union(value: Any, args: list[Any], where: str) -> Any:
    """The first of `args` that takes `value`. When none does, the reason is each one's own
    (`beyond a 64-bit integer`, not `is not a int | None`): with one type, its message."""
    refusals = []
    for arg in args:
        try:
            return _coerce(value, arg, where)
        except TrainError as e:
            refusals.append(e)
    if len(refusals) == 1:
        raise refusals[0]
    said = "; ".join(_reason(e, where) for e in refusals)
    raise TrainError(f"{where}: {value!r} fits none of {' | '.join(map(_type_name, args))} "
                     f"({said})")


def _reason(refusal: TrainError, where: str) -> str:
    return str(refusal).removeprefix(f"{where}: ")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


def _build(cls, data: dict[str, Any], where: str):
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        kind = f"section [{where}]" if where else "top level (sections and `stores`)"
        raise TrainError(f"unknown key(s) {unknown} in the config's {kind}; "
                         f"known: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        key = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise TrainError(f"{key}: expected a table of settings, got {value!r}")
            kwargs[name] = _build(hint, value, key)
        else:
            kwargs[name] = _coerce(value, hint, option_name(key))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # the sections' own __post_init__ checks
        raise TrainError(f"{where or 'config'}: {e}") from e


def train_config_from_dict(data: dict[str, Any]) -> TrainConfig:
    return _build(TrainConfig, data, "")


def load_train_config(path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """A TOML file (optional) with `section.field` overrides applied on top."""
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise TrainError(f"config file {path} does not exist") from e
        except UnicodeDecodeError as e:
            raise TrainError(f"--config {path}: not UTF-8 text (byte {e.object[e.start]:#04x} "
                             f"at offset {e.start}); TOML files are UTF-8: save it as UTF-8") from e
        except OSError as e:
            raise TrainError(f"--config {path}: cannot be read: {e.strerror or e}") from e
        except tomllib.TOMLDecodeError as e:
            raise TrainError(f"{path}: invalid TOML: {e}") from e
    for dotted, value in overrides.items():
        node = data
        *sections, leaf = dotted.split(".")
        for s in sections:
            node = node.setdefault(s, {})
            if not isinstance(node, dict):
                raise TrainError(f"override {dotted}: {s} is not a section")
        node[leaf] = value
    return train_config_from_dict(data)


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML, read back by load_train_config to an equal config. TOML has no
    null: a None that is the field's default is left out, any other is written "none"."""
    lines: list[str] = []

    def emit(section: Any, prefix: str) -> None:
        if prefix:
            lines.append(f"\n[{prefix}]")
        tables = []
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                tables.append((f.name, value))
            elif value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
            elif not _default_is_none(f):
                lines.append(f'{f.name} = "none"')
        for name, table in tables:
            emit(table, f"{prefix}.{name}" if prefix else name)

    emit(cfg, "")
    return "\n".join(lines).strip() + "\n"


def _default_is_none(f: dataclasses.Field) -> bool:
    return f.default is None or (f.default is dataclasses.MISSING
                                 and f.default_factory is dataclasses.MISSING)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
