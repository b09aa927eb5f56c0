"""The `dflash eval` click command: options -> EvalConfig -> run_eval -> table and files.

Owns option parsing and turning any stage's error (dflash_train.errors.DflashError)
into one line on stderr and exit status 1 (never a traceback for a user mistake). The lead
registers `eval_command` in dflash_train/cli.py.
"""

import click

from dflash_train.blocks import MAX_SEED
from dflash_train.devices import DEFAULT_DEVICE, DEVICE_HELP
from dflash_train.dtypes import DTYPE_CHOICES
from dflash_train.errors import reported_as_one_line
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.report import dumps

_DEFAULTS = EvalSettings()


SETTINGS_OPTIONS = ("mode", "tree_budgets", "recall_at", "batch_tokens", "blocks_per_forward",
                    "position_bin")
"""The options that are EvalSettings fields; the others are EvalConfig's."""




def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError as e:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers") from e
    if any(x < 1 for x in items):
        raise click.BadParameter(f"{value!r}: every value must be >= 1")
    return items


def _tree_budgets(ctx, param, value: str) -> tuple[int, ...]:
    budgets = _int_list(ctx, param, value)
    from dflash_train.evaluate.tree import budget_cap_refusal

    for budget in budgets:
        if (rule := budget_cap_refusal(budget)):
            raise click.BadParameter(f"{value!r}: a budget must be {rule}")
    return budgets


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("--store", required=True,
              help="Held-out feature store (path or fsspec URL); no target model is loaded.")
@click.option("--mode", type=click.Choice(["replay", "all"]), default=_DEFAULTS.mode,
              show_default=True,
              help="replay: the anchors live decoding visits (first response token, then "
                   "a + tau); all: every eligible anchor.")
@click.option("--tree-budget", "tree_budgets", default="16,32,64", show_default=True,
              callback=_tree_budgets,
              help="DDTree node budgets (comma list; '' for none): offline, and live with "
                   "--online, a tree of each budget is decoded as its own walk.")
@click.option("--recall-at", default="1,2,4,8", show_default=True, callback=_int_list,
              help="k of the per-slot top-k recall (comma list).")
@click.option("--position-bin", default=_DEFAULTS.position_bin, show_default=True,
              type=click.IntRange(1),
              help="Tokens per bin of tau by the anchor's position (counted from the start "
                   "of the sequence, prompt included): each bin's blocks, mean tau and 95 % "
                   "interval in the table, report.json and the plot.")
@click.option("--limit", type=click.IntRange(1), default=None,
              help="Evaluate this many samples, drawn uniformly with --seed. Default: all.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, MAX_SEED),
              help="Seed of the --limit draw.")
@click.option("--batch-tokens", default=_DEFAULTS.batch_tokens, show_default=True,
              type=click.IntRange(1), help="Sequences per batch: count x longest <= this.")
@click.option("--blocks-per-forward", default=_DEFAULTS.blocks_per_forward,
              show_default=True, type=click.IntRange(1),
              help="Blocks per sequence per drafter forward (--mode all).")
@click.option("--device", default=DEFAULT_DEVICE, show_default=True, help=DEVICE_HELP)
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(DTYPE_CHOICES),
              help="Drafter compute dtype; auto = bf16 on CUDA, fp32 on CPU.")
@click.option("--out", default=None,
              help="Directory for report.json, blocks.parquet (per-block rows) and "
                   "acceptance.png (when matplotlib is installed).")
@click.option("--plot", default=None, help="Write the per-slot acceptance PNG here "
                                           "(needs matplotlib: pip install 'dflash-train[plot]').")
@click.option("--json", "as_json", is_flag=True,
              help="Print the JSON report on stdout instead of the table.")
@click.option("--show", default=0, show_default=True, type=click.IntRange(0),
              help="Print N decoded blocks (context tail, target, each draft).")
@click.option("--online", is_flag=True,
              help="Also run live greedy speculative decoding with the target (--model) on "
                   "the same prompts, with chains and with a DDTree of each --tree-budget: "
                   "the ground truth offline replay must match, round by round.")
@click.option("--no-cache", is_flag=True,
              help="--online without the target's cache: recompute the whole sequence every "
                   "round (O(L^2); the reference the cached loop is checked against).")
@click.option("--served", is_flag=True,
              help="Also serve the target (--model) with each checkpoint through a serving "
                   "engine (--engine) on the same prompts, greedy or with a sampled store's "
                   "settings and a seed per request, and report the engine's own acceptance "
                   "counters beside offline and --online.")
@click.option("--temperature", default=None, type=click.FloatRange(0),
              help="The temperature this evaluation is meant for: refused unless it is the "
                   "store's (0 for a greedy store). Every mode decodes with the store's "
                   "sampling settings; this only makes the intent checked.")
@click.option("--engine", type=click.Choice(["vllm", "llama.cpp"]), default="vllm",
              show_default=True,
              help="--served's engine: vLLM (--model a directory) or llama.cpp's llama-server "
                   "(--model a .gguf; each checkpoint is exported as a DFlash GGUF).")
@click.option("--speed/--no-speed", default=True, show_default=True,
              help="--served also decodes every prompt without the drafter, taking turns "
                   "with it, and reports decode tokens/s and ms per token with and without "
                   "it, their ratio and the tau that breaks even (--no-speed: acceptance "
                   "only, in about half the time).")
@click.option("--llama-server", default=None,
              help="The llama-server binary for --served --engine llama.cpp. Default: "
                   "$DFLASH_LLAMA_SERVER, else the one scripts/llama_cpp_build.sh builds "
                   "(~/.cache/dflash-train/llama.cpp-11434/bin/llama-server).")
@click.option("--vllm-python", default=None,
              help="The Python that runs vLLM for --served. Default: this one if it "
                   "imports vllm, else the venv of scripts/vllm_venv.sh "
                   "($DFLASH_VLLM_VENV or ~/.cache/dflash-train/vllm-venv).")
@click.option("--model", default=None,
              help="Target checkpoint (directory or .gguf) for --online and --served; "
                   "refused without them (offline replay never loads the target).")
@click.option("--max-new-tokens", default=None, type=click.IntRange(1),
              help="--online / --served generation length (refused without them). "
                   "Default: the store's --regenerate setting.")
@click.option("--skip-corrupt", is_flag=True,
              help="Skip damaged samples of the store (missing shard, failed checksum, torn "
                   "part metadata) and list them in the report, instead of refusing it.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
def eval_command(checkpoints, as_json, **options) -> None:
    """Compare drafter checkpoints offline by acceptance streak on a held-out store.

    CHECKPOINTS: training checkpoint dirs, exported drafters or third-party DFlash drafters
    (HF format). Every checkpoint drafts the same blocks; one table compares them.
    """
    from dflash_train.evaluate.pipeline import EvalConfig, run_eval

    settings = EvalSettings(**{name: options.pop(name) for name in SETTINGS_OPTIONS})
    cfg = EvalConfig(checkpoints=list(checkpoints), settings=settings, **options)
    with reported_as_one_line():
        outcome = run_eval(cfg, echo=lambda line: click.echo(line, err=True))
    if as_json:
        click.echo(dumps(outcome.report))
    else:
        click.echo(outcome.text)
    for path in outcome.written:
        click.echo(f"wrote {path}", err=as_json)
    for note in outcome.notes:
        click.echo(note, err=True)
