"""The `dflash extract` click command: options -> ExtractConfig -> run_extract -> summary.

Owns option parsing, RANK / WORLD_SIZE, and turning any stage's error (DflashError) into one line
on stderr and exit status 1 (never a traceback for a user mistake).
"""

import os

import click

from dflash_train.devices import DEVICE_HELP, RANKS_HELP
from dflash_train.dtypes import DTYPE_CHOICES
from dflash_train.errors import reported_as_one_line
from dflash_train.extract.config import ExtractConfig
from dflash_train.extract.errors import ExtractError
from dflash_train.target_model.sampling import KEY_LIMIT, SamplingConfig

_DEFAULTS = ExtractConfig(model="", data=[], out="")


def _rank_and_world() -> tuple[int, int]:
    """RANK / WORLD_SIZE as torchrun (or any launcher) sets them; 0 / 1 when absent."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ExtractError(f"RANK / WORLD_SIZE must be integers ({e})") from e


@click.command("extract", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True,
              help="Target checkpoint directory (HF format), or a .gguf file (or a directory "
                   "holding one), dequantized on load.")
@click.option("--data", "data", multiple=True,
              help="Input .jsonl, .json (JSON lines or one array) or .parquet of chats "
                   "('messages'), ShareGPT rows ('conversations') or 'prompt'/'response' "
                   "pairs (the first of these a row holds); repeat for several files. "
                   "Default: the embedded coding prompts (train split), which implies "
                   "--regenerate.")
@click.option("--allow-truncated", is_flag=True,
              help="Use the complete rows of a JSON array that is cut off mid-row (an "
                   "interrupted download) instead of refusing the file; says how many.")
@click.option("--out", required=True, help="Store to create or resume (path or fsspec URL).")
@click.option("--layers", default=None,
              help="Comma-separated target layer ids, ascending (id k = HF hidden_states[k+1]; "
                   "the last layer is refused). Default: the DFlash formula for 5 features.")
@click.option("--top-k", default=_DEFAULTS.top_k, show_default=True, type=click.IntRange(1),
              help="Verifier top-k logits stored per token.")
@click.option("--max-length", default=_DEFAULTS.max_length, show_default=True,
              type=click.IntRange(2),
              help="Longest sample in tokens. A row whose prompt alone is this long is "
                   "skipped and named in the summary.")
@click.option("--overlong", default=_DEFAULTS.overlong, show_default=True,
              type=click.Choice(["truncate", "skip"]),
              help="Truncate samples longer than --max-length, or skip them.")
@click.option("--batch-tokens", default=_DEFAULTS.batch_tokens, show_default=True,
              type=click.IntRange(1), help="Padded tokens per forward batch.")
@click.option("--rows-per-part", default=_DEFAULTS.rows_per_part, show_default=True,
              type=click.IntRange(1), help="Source rows per part (unit of resume and sharding).")
@click.option("--shard-tokens", default=_DEFAULTS.shard_tokens, show_default=True,
              type=click.IntRange(8), help="Tokens per stored shard (unit of crash-safe commit).")
@click.option("--device", default=_DEFAULTS.device, show_default=True,
              help=DEVICE_HELP + RANKS_HELP)
@click.option("--dtype", default=_DEFAULTS.dtype, show_default=True,
              type=click.Choice(DTYPE_CHOICES),
              help="Compute and storage dtype; auto = bf16 where --device resolves to "
                   "CUDA, fp32 on CPU.")
@click.option("--context-dtype", default=_DEFAULTS.context_dtype, show_default=True,
              type=click.Choice(["same", "float8_e4m3"]),
              help="How context is stored: 'same' as --dtype, or float8_e4m3 (E4M3 with one "
                   "float32 scale per token and layer: half a bf16 store's raw context bytes; "
                   "train and eval read it back as --dtype).")
@click.option("--load-as", default=_DEFAULTS.load_as, show_default=True,
              type=click.Choice(["causal-lm", "multimodal"]),
              help="Load the checkpoint as CausalLM or as its multimodal wrapper.")
@click.option("--revision", default=None, help="Model revision, recorded in provenance.")
@click.option("--enable-thinking/--no-enable-thinking", default=_DEFAULTS.enable_thinking,
              show_default=True,
              help="Chat template thinking mode; must match serving.")
@click.option("--regenerate", is_flag=True,
              help="Replace each last assistant turn by the target's own continuation "
                   "(greedy unless --temperature > 0).")
@click.option("--max-new-tokens", default=_DEFAULTS.max_new_tokens, show_default=True,
              type=click.IntRange(1), help="Tokens generated per prompt with --regenerate.")
@click.option("--capture", default=_DEFAULTS.capture, show_default=True,
              type=click.Choice(["auto", "generation", "forward"]),
              help="With --regenerate on the loaded target: store the states the target "
                   "computed while generating (generation: one pass; a part's states wait in "
                   "memory until it is written), or run a second forward over prompt + answer "
                   "(forward: memory bounded by --batch-tokens). They differ by float "
                   "rounding only. auto: generation when a part's states fit in 4 GiB.")
@click.option("--temperature", default=_DEFAULTS.sampling.temperature, show_default=True,
              type=click.FloatRange(0), metavar="T",
              help="With --regenerate: sample the answers at temperature T (0: greedy), each "
                   "draw keyed by --seed, the row and the position, so any batching (and live "
                   "sample-and-match decoding with that seed) draws the same tokens; with "
                   "--server, the server draws with a seed per request instead (the store is "
                   "then marked in-distribution only).")
@click.option("--top-p", default=_DEFAULTS.sampling.top_p, show_default=True,
              type=click.FloatRange(0, 1, min_open=True), metavar="P",
              help="With --temperature: draw among the most probable tokens up to cumulative "
                   "probability P (1: off).")
@click.option("--sample-top-k", default=_DEFAULTS.sampling.top_k, show_default=True,
              type=click.IntRange(0), metavar="K",
              help="With --temperature: draw among the K most probable tokens (0: off; "
                   "--top-k is the verifier's stored top-k).")
@click.option("--seed", default=_DEFAULTS.sampling.seed, show_default=True,
              type=click.IntRange(0, KEY_LIMIT - 1),
              help="With --temperature: the seed of the draws, recorded in the store.")
@click.option("--mask-token-id", type=click.IntRange(0), default=None,
              help="Mask token id recorded for training; default: the tokenizer's mask token, "
                   "else the published id for the model type (Qwen3.5/3.6: 248070), else the "
                   "first row past the tokenizer, else a special token no chat uses.")
@click.option("--dry-run", is_flag=True,
              help="Print bytes/token, total size and the parts plan; load no model.")
@click.option("--progress/--no-progress", default=_DEFAULTS.progress, help="Show a progress bar.")
@click.option("--server", "servers", multiple=True, metavar="URL",
              help="With --regenerate: an OpenAI-compatible server (vLLM) serving --model, "
                   "e.g. http://127.0.0.1:8000, that generates instead of the loaded target "
                   "(prompts and completions as token ids; greedy, or sampled as "
                   "--temperature says); repeat for several. "
                   "One serving another model is refused before anything is written.")
@click.option("--server-requests", default=_DEFAULTS.server_requests, show_default=True,
              type=click.IntRange(1),
              help="Completion requests in flight at once across all --server URLs.")
@click.option("--server-timeout", default=_DEFAULTS.server_timeout, show_default=True,
              type=float, metavar="SECONDS",
              help="Seconds a --server request may go unanswered before extract stops naming "
                   "the row and server (a completion answers only once it is whole: cover the "
                   "longest generation). 30 s without any answer names the oldest request "
                   "on stderr.")
def extract(**options) -> None:
    """Run the target once over a dataset and fill a feature store.

    Re-running the same command resumes; under torchrun every rank fills its own parts.
    """
    from dflash_train.extract.pipeline import run_extract

    options["data"] = list(options["data"])
    options["servers"] = list(options["servers"])
    drawn = {k: options.pop(k) for k in ("temperature", "top_p", "seed")}
    drawn["top_k"] = options.pop("sample_top_k")
    with reported_as_one_line():
        cfg = ExtractConfig(**options, sampling=SamplingConfig(**drawn))
        rank, world = _rank_and_world()
        summary = run_extract(cfg, rank=rank, world_size=world, echo=click.echo)
    if not cfg.dry_run:
        for line in summary.lines():
            click.echo(line)
