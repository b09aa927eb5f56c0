"""`--help` shows the real defaults: each option's shown default is its config dataclass
field's default (TrainConfig for `dflash train`, ExtractConfig for `dflash extract`), read
from the rendered help a user sees, so neither can be edited without the other."""

import re
from dataclasses import MISSING, fields

import click
from click.testing import CliRunner

from dflash_train.extract.command import extract
from dflash_train.extract.config import ExtractConfig
from dflash_train.train.command import train_command
from dflash_train.train.config import TrainConfig
from dflash_train.train.drafter_shape import DRAFTER_LAYERS
from dflash_train.train.options import CLI_OPTIONS


def _shown_defaults(command: click.Command) -> dict[str, str]:
    """Option -> the `[default: ...]` its --help entry shows. Wide enough that an entry is one
    line, or two where click moves the help under a long option; click adds a range after
    '; '."""
    text = CliRunner().invoke(command, ["--help"], terminal_width=10_000,
                              max_content_width=10_000).output
    shown, option = {}, None
    for line in text.splitlines():
        starts = re.match(r"\s+(--[\w-]+)", line)
        option = starts[1] if starts else option
        found = re.search(r"\[default: ([^;\]]*)", line)
        if option and found:
            shown[option] = found[1]
    return shown


def _option(command: click.Command, name: str) -> click.Option:
    return next(p for p in command.params if name in p.opts)


def _check(command: click.Command, option: str, default: object, shown: dict[str, str]):
    """A non-None default is shown as itself (an on/off flag: click's default is it); a None
    default, or an empty list (a repeatable option given no times), is free to be described
    in words."""
    param = _option(command, option)
    if isinstance(default, bool):
        on = param.get_default(click.Context(command))
        assert on in (None, default), option  # None: a --config file decides
    elif isinstance(default, (list, tuple)) and default:  # a comma list, as the option reads
        assert shown.get(option) == ",".join(map(str, default)), option
    elif default not in (None, [], ()):
        assert shown.get(option) == str(default), option


def test_train_help_shows_train_config_defaults():
    shown, defaults = _shown_defaults(train_command), TrainConfig()
    for key, option in CLI_OPTIONS.items():
        section, name = key.split(".")
        _check(train_command, option, getattr(getattr(defaults, section), name), shown)
    assert shown["--layers"] == str(DRAFTER_LAYERS)  # None in ModelConfig: the resolved count


def test_extract_help_shows_extract_config_defaults():
    shown = _shown_defaults(extract)
    options = {p.name: p.opts[0] for p in extract.params}
    checked = 0
    for f in fields(ExtractConfig):
        if f.name in options and f.default is not MISSING:  # not --model, --data, --out
            _check(extract, options[f.name], f.default, shown)
            checked += 1
    assert checked >= 20  # every option is a field of the same name
