"""The settings of one extract run (what the CLI options fill)."""

from dataclasses import dataclass, field
from typing import Literal

from dflash_train.extract.server_http import DEFAULT_TIMEOUT_S
from dflash_train.target_model.sampling import GREEDY, SamplingConfig

CAPTURE_HOST_BYTES = 4 << 30
"""The most host memory capture="auto" lets one part's states take while it is generated."""


@dataclass
class ExtractConfig:
    """Everything `dflash extract` needs; the CLI maps its options one to one onto these."""

    model: str
    """Target checkpoint: a local directory (or a hub id already in the local cache), or a
    .gguf file (or a directory holding one and no config.json)."""
    data: list[str]
    """Input files, .jsonl / .json (JSON lines or one JSON array) or .parquet, of chats
    ("messages"), ShareGPT rows ("conversations") or "prompt"/"response" pairs; empty: the
    embedded coding prompts (train split), which implies `regenerate`."""
    out: str
    """Store to create or resume: a local path or an fsspec URL."""
    allow_truncated: bool = False
    """Keep the complete rows of a JSON array cut off mid-row instead of refusing it."""
    layers: str | None = None
    """Comma-separated layer ids (id k = HF hidden_states[k + 1]); None = DFlash default."""
    top_k: int = 16
    """Verifier top-k logits stored per token."""
    max_length: int = 4096
    """Longest sample in tokens; longer ones are truncated or skipped (see `overlong`). A row
    with no assistant token within it (its prompt alone is this long) is skipped, counted and
    named in the summary; a run in which every row is skipped is refused."""
    overlong: Literal["truncate", "skip"] = "truncate"
    """What to do with a sample longer than max_length."""
    batch_tokens: int = 16384
    """Padded tokens per forward batch (count x longest)."""
    rows_per_part: int = 1024
    """Source rows per part; the unit of resume and of sharding across ranks."""
    shard_tokens: int = 1024
    """Tokens per stored shard: the unit of crash-safe commits."""
    device: str = "auto"
    """Torch device, as dflash_train.devices resolves it: auto = cuda when torch sees one,
    else cpu (on cpu the GPU-only kernels are never used)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Compute and storage dtype of hidden states; auto = bf16 on CUDA, fp32 on CPU."""
    context_dtype: Literal["same", "float8_e4m3"] = "same"
    """How context is stored. same: in `dtype`. float8_e4m3: E4M3 values with one float32
    scale per token and context layer, half a bf16 store's raw context bytes; train and
    eval read it dequantized to `dtype` (store_schema/fp8.py)."""
    load_as: Literal["causal-lm", "multimodal"] = "causal-lm"
    """Load the checkpoint as its CausalLM or as the multimodal wrapper (same states)."""
    revision: str | None = None
    """Hub revision of the model, recorded in provenance."""
    enable_thinking: bool = False
    """Passed to the chat template; must match how the target will be served."""
    regenerate: bool = False
    """Replace each last assistant turn by the target's own continuation (greedy, or drawn
    as `sampling` says)."""
    max_new_tokens: int = 1024
    """Tokens to generate per prompt with `regenerate`."""
    capture: Literal["auto", "generation", "forward"] = "auto"
    """With `regenerate` on the loaded target, where the stored states come from. generation:
    what the target computed while generating (one pass over the tokens; a part's states wait
    in host memory until the part is written in row order); forward: a second forward over
    prompt + answer after generation (memory bounded by batch_tokens). The two differ only by
    float rounding (the same answers). auto: generation where a part's states fit in
    CAPTURE_HOST_BYTES (rows_per_part rows of max_length - 1 + max_new_tokens tokens), else
    forward. Servers' answers always take the forward. Recorded in the store when generation,
    so a resume the other way is refused."""
    sampling: SamplingConfig = GREEDY
    """How `regenerate` draws each token: greedy, or at a temperature with a seed, each
    prompt's draws keyed by its source row (target_model/sampling.py). Recorded in the
    store's provenance when not greedy."""
    mask_token_id: int | None = None
    """Token the drafter fills block slots with; None: the tokenizer's mask token, else the
    published id for the model type (Qwen3.5/3.6: 248070, Qwen3: 151669)."""
    dry_run: bool = False
    """Print sizes and the parts plan, then stop before loading the model."""
    progress: bool = True
    """Show a progress bar."""
    extra: dict = field(default_factory=dict)
    """Free-form provenance recorded in the store."""
    servers: list[str] = field(default_factory=list)
    """OpenAI-compatible servers (vLLM) serving the target that generate for `regenerate`
    instead of the loaded target; empty: the built-in generation."""
    server_requests: int = 32
    """Completion requests in flight at once across `servers` (bounds their memory too)."""
    server_timeout: float = DEFAULT_TIMEOUT_S
    """Seconds a request to `servers` may go without an answer before the run stops naming
    the row and server (a non-streaming completion answers only once it is whole, so this
    must cover the longest generation on a busy server). Finite, > 0."""
