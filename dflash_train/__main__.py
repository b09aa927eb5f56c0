"""`python -m dflash_train` runs the CLI (what subprocess tests and launchers call)."""

from dflash_train.cli import main

main()
