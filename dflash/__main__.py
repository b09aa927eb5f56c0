"""`python -m dflash` runs the CLI (what subprocess tests and launchers call)."""

from dflash.cli import main

main()
