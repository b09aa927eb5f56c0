"""The drafter's shape: one dataclass, the default target-layer formula, named presets.

Owns every number that fixes a drafter's architecture (docs/reference.md §1, §2). It never
touches tensors or files; `hf_config.py` maps it to and from config.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_train.blocks import BLOCK_SIZE
from dflash_train.drafter.errors import DrafterError
from dflash_train.target_config import config_field, model_type, rope_theta, text_part

LayerType = Literal["full_attention", "sliding_attention"]
DrafterKind = Literal["dflash", "dflash2"]
DRAFTER_KINDS: tuple[DrafterKind, ...] = ("dflash", "dflash2")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The fields a DFlash 2 drafter adds (config.json: in dflash_config)."""
SelectorCodebooks = Literal["free", "factorised"]
SELECTOR_CODEBOOKS: tuple[SelectorCodebooks, ...] = ("free", "factorised")

DEFAULT_BLOCK_SIZE = BLOCK_SIZE
"""Tokens per drafted block (dflash_train.blocks owns the number: docs/reference.md §3)."""


MIN_DRAFT_VOCAB = 2
"""The smallest draft vocabulary: over one id the softmax is 1 whatever the weights, so the
loss is 0 with no gradient and the drafter learns nothing."""
DRAFT_VOCAB_RULE = (f"at least {MIN_DRAFT_VOCAB} (over one id the loss is 0 with no gradient: "
                    "the drafter would learn nothing)")


def max_conv_kernel_size(block_size: int) -> int:
    """Most taps a DFlash 2 in-block convolution may have: tap t reads slot i - t of the same
    block, so taps 0 .. block_size - 1 reach every slot and any further one only the zeros
    before the block (dflash2.causal_shift; past block_size + 1 its shapes break)."""
    return block_size


KNOWN_MASK_TOKEN_IDS = {"qwen3_5": 248070, "qwen3_5_text": 248070, "qwen3": 151669}
"""Mask token of the published drafters per target model_type (docs/reference.md §1); the token
already exists in the target vocabulary and keeps the target's embedding row."""


def default_mask_token_id(model_type: str, vocab_size: int, tokenizer_mask_id: int | None,
                          *, tokenizer_size: int | None = None,
                          spare_special_ids: Sequence[int] = ()) -> int | None:
    """The mask token a drafter of this target uses unless told otherwise, or None.

    In order: the tokenizer's own mask token; the published id for this model type; the first
    embedding row past the tokenizer's tokens (the id z-lab's added `<|MASK|>` gets: Qwen3's
    151669), where the vocabulary is padded beyond the tokenizer; else the last of
    `spare_special_ids`, special tokens no chat renders (a target such as Llama 3 or SmolLM2
    has no spare row, and a new row would have no target embedding)."""
    if tokenizer_mask_id is not None:
        return int(tokenizer_mask_id)
    known = KNOWN_MASK_TOKEN_IDS.get(model_type)
    if known is not None and known < vocab_size:
        return known
    if tokenizer_size is not None and tokenizer_size < vocab_size:
        return int(tokenizer_size)
    spare = [int(i) for i in spare_special_ids if 0 <= i < vocab_size]
    return spare[-1] if spare else None


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """The n target layers whose outputs feed the drafter (docs/reference.md §2).

    Layer id k is the output of decoder layer k (0-based), i.e. HF `hidden_states[k + 1]`.
    Spread evenly from layer 1 to layer L - 3: `round(1 + i * (L - 4) / (n - 1))`.
    """
    if n < 1:
        raise DrafterError(f"need at least one target layer, got n={n}")
    if n == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    # Python's round() (half to even) on purpose: z-lab's build_target_layer_ids uses it, and
    # a tie rounded the other way would pick a different layer than the published drafters.
    ids = [round(1 + i * span / (n - 1)) for i in range(n)]
    if not all(0 <= i < num_target_layers for i in ids):
        raise DrafterError(
            f"the default formula gives layer ids {ids} outside a {num_target_layers}-layer "
            f"target; pass target_layer_ids explicitly"
        )
    return ids


@dataclass
class DrafterConfig:
    """Architecture of a DFlash drafter, field for field what config.json carries."""

    hidden_size: int
    """Width of the drafter = width of the target (it reads target features, borrows its head)."""
    vocab_size: int
    """Target vocabulary size (rows of the borrowed embed_tokens / lm_head)."""
    intermediate_size: int
    """SwiGLU MLP width; published drafters copy the target's."""
    target_layer_ids: list[int]
    """0-based target layers whose outputs are concatenated into fc (docs/reference.md §2)."""
    num_target_layers: int | None
    """Decoder layers in the target, recorded so a store of another target is refused;
    None only for a third-party checkpoint that does not record it."""
    mask_token_id: int
    """Token id filling block slots 1..B-1; must already exist in the target vocabulary."""
    num_hidden_layers: int = 5
    """Drafter decoder layers."""
    num_attention_heads: int = 32
    """Query heads per layer."""
    num_key_value_heads: int = 8
    """Key/value heads per layer (grouped-query attention)."""
    head_dim: int = 128
    """Width of one attention head."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1e6
    """RoPE base; published drafters copy the target's."""
    max_position_embeddings: int = 40960
    """Longest position the serving engine should expect (copied from the target)."""
    layer_types: list[LayerType] = field(default_factory=list)
    """Per layer: full (bidirectional in the block) or sliding (causal in the block,
    windowed context). Empty means all full."""
    sliding_window: int | None = None
    """Window of sliding layers: a query at position p sees keys at p - window < k."""
    is_causal: bool | None = None
    """Override of in-block causality for every layer; None: sliding layers causal, full
    layers bidirectional (the z-lab / vLLM default). Part of a checkpoint's contract."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per block: [anchor, MASK x (block_size - 1)]."""
    kind: DrafterKind = "dflash"
    """dflash: the DFlash drafter. dflash2: DFlash 2 (dflash2.py), the same backbone plus a
    grouped dynamic causal convolution around each attention and MLP and a candidate
    selector over the top logits; the four fields below shape those and only apply to it."""
    conv_kernel_size: int = 2
    """DFlash 2: taps of each in-block causal convolution (tap 0 is the slot itself)."""
    conv_group_size: int = 16
    """DFlash 2: channels that share one input-dependent kernel delta; divides hidden_size."""
    selector_rank: int = 256
    """DFlash 2: width of the selector's predecessor/successor codebooks."""
    selector_top_k: int = 16
    """DFlash 2: candidates per slot the selector rescores (top logits of the slot)."""
    selector_codebooks: SelectorCodebooks = "free"
    """DFlash 2: free trains the [V, r] codebooks themselves (z-lab's form); factorised trains
    W_A, W_B [H, r] with A = E W_A, B = E W_B through the target's frozen embedding E
    (2 H r parameters instead of 2 V r). Engines only ever see free codebooks: export
    writes E W. config.json names it only where it is factorised (our checkpoints)."""

    draft_vocab_size: int | None = None
    """Rows of the drafter's own lm_head: the target's lm_head rows at `draft_ids` (its most
    frequent labels), served by vLLM through the checkpoint's `d2t` map (draft id i drafts
    target id i + d2t[i]); None: the target's whole vocabulary. DFlash drafters only."""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def describe(self) -> str:
        """One line for logs: layers, attention, MLP and the target layers read."""
        sliding = self.layer_types.count("sliding_attention")
        layers = (f"{sliding} sliding (window {self.sliding_window}) + "
                  f"{self.num_hidden_layers - sliding} full" if sliding else "all full")
        count = f"{self.num_hidden_layers} layer{'s' if self.num_hidden_layers != 1 else ''}"
        line = (f"{count} ({layers}), {self.num_attention_heads} query / "
                f"{self.num_key_value_heads} kv heads of {self.head_dim}, MLP "
                f"{self.intermediate_size}, block {self.block_size}, target layers "
                f"{self.target_layer_ids}")
        if self.draft_vocab_size is not None:
            line += f", draft vocabulary {self.draft_vocab_size} of {self.vocab_size}"
        if self.kind == "dflash2":
            line += (f"; DFlash 2: convs of {self.conv_kernel_size} taps in groups of "
                     f"{self.conv_group_size}, selector rank {self.selector_rank} over the "
                     f"top {self.selector_top_k}, {self.selector_codebooks} codebooks")
        return line

    def validate(self) -> None:
        """Raise DrafterError naming the first field that cannot describe a drafter."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise DrafterError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        bad = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise DrafterError(f"layer_types: unknown layer type(s) {bad}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DrafterError("layer_types has sliding layers but sliding_window is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise DrafterError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.block_size < 2:
            raise DrafterError(f"block_size {self.block_size} must be >= 2")
        if not self.target_layer_ids:
            raise DrafterError("target_layer_ids is empty")
        limit = self.num_target_layers if self.num_target_layers is not None else float("inf")
        out = [i for i in self.target_layer_ids if not 0 <= i < limit]
        if out:
            raise DrafterError(
                f"target_layer_ids {out} outside the target's {self.num_target_layers} layers"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DrafterError(
                f"mask_token_id {self.mask_token_id} outside the vocabulary (size "
                f"{self.vocab_size})"
            )
        if self.kind not in DRAFTER_KINDS:
            raise DrafterError(f"kind {self.kind!r}: must be one of {', '.join(DRAFTER_KINDS)}")
        self._validate_draft_vocab()
        if self.kind == "dflash2":
            self._validate_dflash2()

    def _validate_draft_vocab(self) -> None:
        n = self.draft_vocab_size
        if n is None:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n > self.vocab_size:
            raise DrafterError(f"draft_vocab_size {n!r} must be an integer in "
                               f"[{MIN_DRAFT_VOCAB}, {self.vocab_size}] (the target's "
                               "vocabulary)")
        if n < MIN_DRAFT_VOCAB:
            raise DrafterError(f"draft_vocab_size {n} must be {DRAFT_VOCAB_RULE}")
        if self.kind != "dflash":
            raise DrafterError("draft_vocab_size applies to DFlash drafters only: a DFlash 2 "
                               "selector scores candidates over the whole vocabulary")

    @property
    def draft_vocab(self) -> int:
        """Ids the drafter can propose: draft_vocab_size, else the whole vocabulary."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    def _validate_dflash2(self) -> None:
        for name in DFLASH2_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DrafterError(f"{name} {value!r} must be a positive integer")
        if self.conv_kernel_size > max_conv_kernel_size(self.block_size):
            raise DrafterError(f"conv_kernel_size {self.conv_kernel_size} exceeds "
                               f"{max_conv_kernel_size(self.block_size)}, the block size: a "
                               "tap past it reads nothing of the block")
        if self.hidden_size % self.conv_group_size:
            raise DrafterError(f"conv_group_size {self.conv_group_size} does not divide "
                               f"hidden_size {self.hidden_size}")
        if self.selector_codebooks not in SELECTOR_CODEBOOKS:
            raise DrafterError(f"selector_codebooks {self.selector_codebooks!r}: must be one of "
                               f"{', '.join(SELECTOR_CODEBOOKS)}")
        if self.selector_top_k > self.vocab_size:
            raise DrafterError(f"selector_top_k {self.selector_top_k} exceeds the vocabulary "
                               f"(size {self.vocab_size})")

    @property
    def num_context_features(self) -> int:
        """n: how many target layers are concatenated into fc."""
        return len(self.target_layer_ids)

    def layer_is_causal(self, layer: int) -> bool:
        """In-block causality of one layer, resolved as z-lab and vLLM resolve it."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """Attention window of one layer, None for full layers."""
        if self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        mask_token_id: int,
        *,
        num_features: int = 5,
        target_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Defaults for a target: its width, vocab, MLP width, RoPE base and norm epsilon,
        and the DFlash layer-id formula. `target_config` is a transformers config or a dict;
        a multimodal config's `text_config` is used when present. `overrides` set any field.
        """
        text = text_part(target_config)
        num_target_layers = int(_require(text, "num_hidden_layers"))
        fields: dict[str, Any] = dict(
            hidden_size=int(_require(text, "hidden_size")),
            vocab_size=int(_require(text, "vocab_size")),
            intermediate_size=int(_require(text, "intermediate_size")),
            num_target_layers=num_target_layers,
            target_layer_ids=target_layer_ids
            or default_target_layer_ids(num_target_layers, num_features),
            mask_token_id=mask_token_id,
            rms_norm_eps=float(config_field(text, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta(text, default=1e6)),
            max_position_embeddings=int(config_field(text, "max_position_embeddings", 40960)),
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def qwen3_6_27b(cls) -> DrafterConfig:
        """The published z-lab/Qwen3.6-27B-DFlash shape (docs/reference.md §1)."""
        shape = QWEN3_6_27B_ATTENTION
        return cls(
            hidden_size=5120,
            vocab_size=248320,
            intermediate_size=17408,
            num_target_layers=64,
            target_layer_ids=default_target_layer_ids(64, 5),
            mask_token_id=248070,
            num_hidden_layers=5,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=1e-6,
            rope_theta=1e7,
            max_position_embeddings=262144,
            layer_types=["sliding_attention"] * shape.sliding_layers + ["full_attention"],
            sliding_window=shape.sliding_window,
        )


@dataclass(frozen=True)
class AttentionShape:
    """The attention part of a drafter's shape, as a trainer chooses it."""

    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer."""
    head_dim: int
    """Width of one attention head."""
    sliding_layers: int
    """How many of the first layers use sliding-window attention; the rest are full."""
    sliding_window: int
    """Context window of the sliding layers."""


QWEN3_6_27B_ATTENTION = AttentionShape(32, 8, 128, sliding_layers=4, sliding_window=2048)
"""z-lab's released Qwen3.6-27B drafter (docs/reference.md §1); its target has 24 x 256 heads."""


def published_attention(target_config: Any) -> AttentionShape | None:
    """The released drafter's attention shape for a target DFlash was published for, or None.

    Qwen3.5-27B and Qwen3.6-27B share one architecture (qwen3_5, 64 layers, width 5120).
    """
    text = text_part(target_config)
    family = model_type(text).startswith("qwen3_5")
    if (family and config_field(text, "hidden_size", 0) == 5120
            and config_field(text, "num_hidden_layers", 0) == 64):
        return QWEN3_6_27B_ATTENTION
    return None


def _require(obj: Any, name: str) -> Any:
    value = config_field(obj, name)
    if value is None:
        raise DrafterError(f"target config has no {name!r}; cannot size the drafter")
    return value
