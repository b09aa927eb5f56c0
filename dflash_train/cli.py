"""The `dflash` command line: one click group; each stage registers the commands that work."""

import click

from dflash_train import __version__
from dflash_train.drafter.command import export_command
from dflash_train.evaluate.command import eval_command
from dflash_train.extract.command import extract
from dflash_train.quickstart import quickstart
from dflash_train.store_schema.command import store
from dflash_train.train.command import log_group, train_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, message="%(prog)s (dflash-train) %(version)s")
def main() -> None:
    """Train DFlash speculative-decoding drafters offline.

    extract runs the target once into a Zarr feature store; train and eval read only the store.
    """


main.add_command(extract)
main.add_command(store)
main.add_command(train_command)
main.add_command(eval_command)
main.add_command(export_command)
main.add_command(log_group)
main.add_command(quickstart)
