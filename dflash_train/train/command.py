"""`dflash train`: flags and a TOML file onto TrainConfig, then the loop."""

import click

from dflash_train.devices import DEVICE_HELP, RANKS_HELP
from dflash_train.errors import reported_as_one_line
from dflash_train.run_layout import LOG
from dflash_train.run_reader import run_checkpoint
from dflash_train.train.config import TrainConfig, load_train_config
from dflash_train.train.drafter_shape import DRAFTER_LAYERS
from dflash_train.train.errors import TrainError
from dflash_train.train.options import CLI_OPTIONS

# Common settings get their own flag (options.CLI_OPTIONS); every other field is reachable
# with --set. Keyed by click's parameter name: --max-steps -> max_steps.
_FLAGS = {option[2:].replace("-", "_"): key for key, option in CLI_OPTIONS.items()}

_DEFAULTS = TrainConfig()


def _budgets(ctx, param, value: str | None) -> list[int] | None:
    """--tree-budget's comma list ('' : none), or None when not given."""
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers") from e


def _default(key: str, when_none: object = None) -> str:
    """The help's `[default: ...]` of a flag, read from TrainConfig so --help cannot drift
    from what training uses. The flags' own click default stays None: a flag overrides a
    --config file only when given. `when_none` says what a None field means."""
    section, name = key.split(".")
    value = getattr(getattr(_DEFAULTS, section), name)
    return f"  [default: {when_none if value is None else value}]"


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", "stores", multiple=True, required=True,
              help="Feature store to train on (repeat to mix several of one target).")
@click.option("--weights", help="Comma-separated passes per epoch over each --store, e.g. 1,0.5."
              + _default("loader.store_weights", "1 per store"))
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="TOML file of settings ([loader], [model], [loss], [noise], [optim], [run]).")
@click.option("--out", help="Run directory for checkpoints and logs." + _default("run.out_dir"))
@click.option("--resume", is_flag=True, help="Continue from the run directory's latest checkpoint.")
@click.option("--epochs", type=click.IntRange(1),
              help="Passes over the store." + _default("optim.epochs"))
@click.option("--max-steps", type=click.IntRange(1), help="Stop after this many steps.")
@click.option("--lr", type=float, help="Peak learning rate." + _default("optim.lr"))
@click.option("--batch-tokens", type=click.IntRange(1),
              help="Padded tokens per global batch." + _default("loader.batch_tokens"))
@click.option("--max-length", type=click.IntRange(3),
              help="Cut longer samples to this many tokens."
              + _default("loader.max_length", "none (no cut)"))
@click.option("--gamma", type=float,
              help="Position decay of the loss weights." + _default("loss.gamma"))
@click.option("--loss", type=click.Choice(["ce", "kl-topk"]),
              help="Hard CE on the verifier argmax, or KL to its stored top-k."
              + _default("loss.kind"))
@click.option("--noise", type=click.Choice(["none", "uniform", "gaussian"]),
              help="Noise on the fc input (context features only)." + _default("noise.kind"))
@click.option("--noise-std", type=float,
              help="Noise std, relative to each context layer's RMS." + _default("noise.std"))
@click.option("--anchors-per-seq", type=click.IntRange(1),
              help="Blocks per sequence per epoch." + _default("run.anchors_per_seq"))
@click.option("--layers", type=click.IntRange(1), help="Drafter decoder layers."
              + _default("model.num_hidden_layers", DRAFTER_LAYERS))
@click.option("--device", help=DEVICE_HELP + RANKS_HELP + _default("run.device"))
@click.option("--seed", type=int, help="Seed of weights, anchors and noise." + _default("run.seed"))
@click.option("--set", "sets", multiple=True, metavar="SECTION.FIELD=VALUE",
              help="Any other setting (repeatable), e.g. --set optim.weight_decay=0.01; "
                   "--set loss.position_weights=dpace for D-PACE weights (loss.dpace_alpha); "
                   "--set optim.optimizer=muon for Muon on the 2-D weights (optim.muon_lr, "
                   "...); --set model.kind=dflash2 for a DFlash 2 drafter "
                   "(model.selector_codebooks, loss.selector_weight, "
                   "loss.selector_out_of_top_k).")
@click.option("--fsdp", is_flag=True, default=None,
              help="Under torchrun: shard the drafter with FSDP2 instead of DDP.")
@click.option("--skip-corrupt", is_flag=True, default=None,
              help="Skip samples of a damaged store (missing shard, failed checksum, torn part "
                   "metadata) and list them in RUN/skipped.jsonl, instead of refusing it.")
@click.option("--val-store", "val_stores", multiple=True,
              help="Store of the same target never trained on (repeatable): at every "
                   "checkpoint the drafter is replayed on it offline (chain tau and DDTree tau, "
                   "as dflash eval computes them); the best checkpoint is marked in the run "
                   "directory and kept. A store sharing a sample with a --store is refused.")
@click.option("--val-limit", type=click.IntRange(1),
              help="Samples of each --val-store replayed per validation (drawn once)."
              + _default("validation.limit", "all"))
@click.option("--tree-budget", callback=_budgets,
              help="DDTree node budgets validation measures (comma list; '' for the chain "
                   "only).  [default: "
                   + ",".join(map(str, _DEFAULTS.validation.tree_budgets)) + "]")
@click.option("--progress/--no-progress", default=_DEFAULTS.run.progress,
              help="Show a progress bar.")
def train_command(stores, val_stores, config_file, resume, sets, progress, **flags) -> None:
    """Train a DFlash (or DFlash 2) drafter from feature stores; no target model is loaded.

    Labels are the stored verifier argmax; noise touches only the fc input; the loss is
    hard cross-entropy with position decay exp(-(k-1)/gamma). Under torchrun every rank
    reads its own share of each batch (DDP).
    """
    from dflash_train.train.loop import train

    overrides = {"stores": list(stores), "run.progress": progress}
    if val_stores:  # else a --config file's validation stores stand
        overrides["validation.stores"] = list(val_stores)
    for name, value in flags.items():
        if value is not None:
            overrides[_FLAGS[name]] = value
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not SECTION.FIELD=VALUE", param_hint="--set")
        overrides[key.strip()] = value.strip()
    with reported_as_one_line():
        cfg = load_train_config(config_file, overrides)
        result = train(cfg, resume=resume, echo=click.echo)
    if result.already_complete:
        click.echo(f"{result.run_dir} is already complete (step {result.steps} of "
                   f"{result.steps}); nothing to train; checkpoint {result.checkpoint}")
    elif result.trained == 0:
        click.echo(f"{result.stopped or 'nothing left to train'}; nothing trained; "
                   f"checkpoint {result.checkpoint}")
    else:
        if result.stopped:
            click.echo(result.stopped)
        click.echo(f"trained {result.steps} steps, final loss {result.final_loss:.4f}; "
                   f"checkpoint {result.checkpoint}; log {result.run_dir / LOG}")
    if cfg.validation.stores:
        with reported_as_one_line():
            chosen, why = run_checkpoint(result.run_dir)
        click.echo(f"dflash export / eval {result.run_dir} take {why}: {chosen}")


@click.group("log")
def log_group() -> None:
    """Read a training run's log."""


@log_group.command("summary")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--ranges", default=5, show_default=True, type=click.IntRange(1),
              help="Step ranges to split loss and accuracy over.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def log_summary(run_dir: str, ranges: int, as_json: bool) -> None:
    """Loss and per-slot accuracy by step range, lr phase, noise early vs late, epoch
    boundaries, batch sizes, throughput consistency and data-wait share of RUN_DIR."""
    import json

    from dflash_train.train.log_summary import format_summary, read_log, summarize_log

    try:
        summary = summarize_log(read_log(run_dir, lambda m: click.echo(m, err=True)), ranges)
    except TrainError as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))
