"""`dflash eval`'s options, one field each (the CLI maps its options one to one onto these):
`EvalConfig`, and its `settings` (`EvalSettings`: how blocks are chosen, scored and batched),
which offline replay, `--online`, the results and training's validation read as well.
"""

from dataclasses import dataclass, field
from typing import Literal

from dflash_train.evaluate.metrics import DEFAULT_POSITION_BIN

Mode = Literal["replay", "all"]
"""--mode: the anchors offline replay drafts at (EvalSettings.mode)."""


@dataclass
class EvalSettings:
    """How blocks are chosen, scored and batched."""

    mode: Mode = "replay"
    """replay: the anchors live decoding visits; all: every eligible anchor."""
    tree_budgets: tuple[int, ...] = (16, 32, 64)
    """DDTree node budgets at which tree acceptance is reported (docs/reference.md §7)."""
    recall_at: tuple[int, ...] = (1, 2, 4, 8)
    """k of the per-slot top-k recall."""
    batch_tokens: int = 16384
    """Sequences per batch: count x longest <= this (at least one sequence)."""
    blocks_per_forward: int = 16
    """Blocks per sequence in one drafter forward (--mode all); bounds attention memory."""
    position_bin: int = DEFAULT_POSITION_BIN
    """Tokens per bin of tau by anchor position: bin = anchor // position_bin, the anchor's
    position counted from the start of the sequence, prompt included."""

    def top_k(self, vocab_size: int) -> int:
        """Draft ids kept per slot: enough for the largest budget and recall (<= vocab)."""
        return min(max((*self.tree_budgets, *self.recall_at, 1)), vocab_size)


DEFAULT_MAX_NEW_TOKENS = 1024
"""--online generation length when neither the option nor the store's provenance sets it."""


@dataclass
class EvalConfig:
    """Everything `dflash eval` needs; the CLI maps its options one to one onto these."""

    store: str
    """The (held-out) store: local path or fsspec URL."""
    checkpoints: list[str]
    """Training checkpoints, exported drafters or third-party DFlash drafter directories."""
    settings: EvalSettings = field(default_factory=EvalSettings)
    """Mode, tree budgets, recall, batching."""
    limit: int | None = None
    """Evaluate this many samples, drawn uniformly by `seed`; None = every sample."""
    seed: int = 0
    """Seed of the --limit draw (nothing else is random)."""
    device: str = "auto"
    """Torch device; auto = cuda when available, else cpu."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Drafter compute dtype; auto = bf16 on CUDA, fp32 on CPU."""
    out: str | None = None
    """Directory for report.json, blocks.parquet and acceptance.png."""
    plot: str | None = None
    """PNG path of the per-slot acceptance plot (needs matplotlib)."""
    show: int = 0
    """Decoded example blocks to print."""
    online: bool = False
    """Also run live greedy speculative decoding with the target (--model)."""
    model: str | None = None
    """The target checkpoint for --online."""
    no_cache: bool = False
    """--online without the target's cache: the whole sequence is recomputed every round
    (O(L^2)); the reference the cached loop is checked against."""
    max_new_tokens: int | None = None
    """--online generation length; None = the store's regeneration setting (or 1024)."""
    progress: bool = True
    """Show a progress bar."""
    skip_corrupt: bool = False
    """Skip damaged samples of the store (listed in the report) instead of refusing it."""
    served: bool = False
    """Also serve the target (--model) with each checkpoint through a serving engine
    (`engine`) on the same prompts, greedy or with a sampled store's settings, and report the
    engine's own acceptance counters."""
    temperature: float | None = None
    """The temperature the run is meant for; refused unless it is the store's (0: greedy).
    It only states intent: every mode decodes with the store's settings."""
    vllm_python: str | None = None
    """The Python that runs vLLM for --served; None: this one when it imports vllm, else the
    venv scripts/vllm_venv.sh builds."""
    engine: Literal["vllm", "llama.cpp"] = "vllm"
    """--served's serving engine."""
    speed: bool = True
    """--served also decodes every prompt without the drafter, taking turns with it, and
    reports decode speed with and without it (tokens/s, ms per token, their ratio, the tau
    that breaks even)."""
    llama_server: str | None = None
    """The llama-server binary for --served --engine llama.cpp; None: $DFLASH_LLAMA_SERVER,
    else the one scripts/llama_cpp_build.sh builds."""
