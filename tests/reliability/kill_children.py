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


def extract_killed_in_frozen(args: list[str]) -> None:
    """`dflash extract ARGS`, SIGKILLed once the target rows and the first tokenizer file are
    stored: inside the store's frozen unit, on any kind of store."""
    import os
    import signal

    from dflash_train.store_schema import Store

    real = Store.write_files

    def write_files(self, group, files):
        if group == "tokenizer":
            real(self, group, dict(list(files.items())[:1]))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, group, files)

    Store.write_files = write_files
    extract(args)
