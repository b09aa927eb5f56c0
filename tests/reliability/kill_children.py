"""What the kill tests run in a child (kill_points.run_child): real commands, and one held
at a gate so that another can run beside it."""


def extract(args: list[str]) -> None:
    """`dflash extract ARGS`."""
    from dflash_train.cli import main

    main(["extract", *args], prog_name="dflash")


def dflash(args: list[str]) -> None:
    """`dflash ARGS`."""
    from dflash_train.cli import main

    main(args, prog_name="dflash")


def convert_held(args: list[str], copying, go) -> None:
    """`dflash store convert ARGS`, held after its first sample is copied: sets `copying`,
    then waits for `go` (kill_points.events) before it copies the rest."""
    from dflash_train.store_schema import command

    real = command.copy_store

    def keep(sample) -> bool:
        if not copying.is_set():
            copying.set()
            go.wait(120)
        return True

    command.copy_store = lambda *a, **k: real(*a, keep=keep, **k)
    dflash(["store", "convert", *args])
