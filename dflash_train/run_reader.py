"""Reads a training run directory: which checkpoints are whole, the store provenance one was
trained on, and which checkpoint the run stands for (its best on validation, else its newest).

Below every stage: `dflash export RUN`, `dflash eval RUN` and training itself read runs
through here, so no stage imports another to find a checkpoint. The names come from
run_layout; this module reads files and never writes one (train.best and train.checkpoint
write them).

The best checkpoint is re-derived from the run's saved validation (the `validation` object of
log.jsonl's checkpoint-step records, each holding `best_step`), whatever best.json says: a
marker left stale or missing by a crash between a save and its marking, or edited by hand,
never picks the drafter. best.json decides only for a run whose log holds no validation.

How a line of log.jsonl is read lives here too (`log_lines`), the one rule for every reader
of a run's log (this module's saved validation and train.log_summary): blank lines skipped,
only the last line may be torn by a crash, any other line that is not JSON refused.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_train.errors import DflashError
from dflash_train.json_fields import Fields
from dflash_train.run_layout import (
    BEST,
    CHECKPOINT_FILES,
    CHECKPOINTS,
    COMPLETE,
    CONFIG,
    CONFIG_NAME,
    DRAFTER_SUBDIR,
    LOG,
    PROVENANCE,
    STEP_PREFIX,
    checkpoint_dir,
)
from dflash_train.store_schema import StoreError, StoreMeta
from dflash_train.store_schema.errors import one_line

FIGURES = ("tau", "tree_tau")
"""What validation.best_by may follow: the chain's tau, or the largest budget's tree tau."""


class RunDirError(DflashError):
    """A run directory (or its best.json / log.jsonl) that cannot be read as a run."""


class LogLineError(DflashError):
    """A log.jsonl that cannot be read (`line` None), or a line of it before the last that
    is not JSON; the message says which line and what it is instead. Each reader of the log
    turns it into its own error type and advice."""

    def __init__(self, path: Path, line: int | None, why: str):
        self.line = line
        super().__init__(f"{path} cannot be read: {why}" if line is None
                         else f"{path} line {line} is {why}")


@dataclass
class BestMark:
    """Which checkpoint is best on validation, and by what figure (what best.json holds)."""

    step: int
    """The step of the best checkpoint (RUN/checkpoints/step_N)."""
    figure: str
    """The validation figure it is best by: `tau` (the chain's) or `tree_tau@B`."""
    value: float
    """Its value there, pooled over the validation stores."""

    def checkpoint(self, run_dir: str | Path) -> Path:
        return checkpoint_dir(run_dir, self.step)


def is_run_dir(path: str | Path) -> bool:
    """A training run directory (it holds checkpoints/), not a checkpoint or drafter."""
    return (Path(path) / CHECKPOINTS).is_dir()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{STEP_PREFIX}*") if (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def training_checkpoint_root(path: str | Path) -> Path | None:
    """The training checkpoint `path` is or lies in (its `drafter/`), else None: a
    directory with no config.json of its own that holds `drafter/` or any of
    CHECKPOINT_FILES."""
    path = Path(path)
    if path.name == DRAFTER_SUBDIR and any((path.parent / n).exists() for n in CHECKPOINT_FILES):
        return path.parent
    if (path / CONFIG_NAME).is_file():
        return None
    if (path / DRAFTER_SUBDIR).is_dir() or any((path / n).exists() for n in CHECKPOINT_FILES):
        return path
    return None


def read_provenance(path: str | Path) -> StoreMeta | None:
    """The store provenance a checkpoint (or its drafter/) was trained on, or None for a
    bare drafter dir or a checkpoint without provenance.json. One that does not read (not
    JSON, not a provenance) is a StoreError naming the file."""
    file = (training_checkpoint_root(path) or Path(path)) / PROVENANCE
    if not file.is_file():
        return None
    try:
        return StoreMeta.from_dict(json.loads(file.read_text()))
    except (ValueError, StoreError) as e:  # JSON and UTF-8 decode errors are ValueErrors
        raise StoreError(f"{file}: unreadable provenance ({one_line(e)})") from e


def read_best(run_dir: str | Path) -> BestMark | None:
    """The run's best.json, every field checked, or None when it has none."""
    path = Path(run_dir) / BEST
    if not path.is_file():
        return None
    where = f"{path}"
    try:
        fields = Fields(json.loads(path.read_text()), where, RunDirError)
        figure = fields.text("figure")
        if figure != "tau" and not _is_tree_figure(figure):
            raise RunDirError(f"{where}: field 'figure' is {figure!r}, not tau or tree_tau@B")
        return BestMark(fields.integer("step", low=1), figure, fields.number("value"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise RunDirError(f"{path} is unreadable ({type(e).__name__}: {e}); name a checkpoint "
                          f"({Path(run_dir) / CHECKPOINTS}/step_N) instead") from e
    except RunDirError as e:
        raise RunDirError(f"{path} is unreadable ({str(e).removeprefix(where + ': ')}); name "
                          f"a checkpoint ({Path(run_dir) / CHECKPOINTS}/step_N) instead") from e


def saved_best(run_dir: str | Path) -> BestMark | None:
    """The best checkpoint by the run's saved validation, up to its newest complete
    checkpoint (a later record belongs to steps a resume trains again); None when the log
    holds no validation there, or no log at all."""
    newest = complete_checkpoints(run_dir)
    if not newest:
        return None
    last = int(newest[-1].name.removeprefix(STEP_PREFIX))
    validations = {s: v for s, v in _saved_validations(run_dir).items() if s <= last}
    if not validations:
        return None
    where = f"{Path(run_dir) / LOG} step {max(validations)}"
    best_step = validations[max(validations)].get("best_step")
    if best_step is None:  # no validation scored a figure yet (every one empty)
        return None
    if best_step not in validations:
        raise RunDirError(f"{where}: 'best_step' {best_step} names a step without a "
                          "validation record; name a checkpoint instead")
    figure = _figure(run_dir)
    return BestMark(best_step, figure, _figure_value(validations[best_step], figure, where))


def run_checkpoint(run_dir: str | Path) -> tuple[Path, str]:
    """The checkpoint a run directory stands for, with why in a few words: its best on its
    saved validation, else (a log without validation) the one best.json names, else its
    newest complete one."""
    found = complete_checkpoints(run_dir)
    if not found:
        raise RunDirError(f"{run_dir} holds no complete checkpoint under {CHECKPOINTS}/")
    best = saved_best(run_dir)
    if best is not None:
        return _whole(run_dir, best, f"{Path(run_dir) / LOG}'s validation names step "
                                     f"{best.step}"), _best_reason(run_dir, best)
    marked = read_best(run_dir)
    if marked is not None:
        return _whole(run_dir, marked, f"{Path(run_dir) / BEST} names step {marked.step}"), \
            f"its best checkpoint ({marked.figure} {marked.value:.4f} on validation)"
    return found[-1], f"its newest checkpoint (the run has no validation: no {BEST})"


def _best_reason(run_dir: str | Path, best: BestMark) -> str:
    """Why the derived best is taken, saying when best.json disagrees or does not read."""
    why = f"its best checkpoint ({best.figure} {best.value:.4f} on validation)"
    try:
        marked = read_best(run_dir)
    except RunDirError as e:
        return f"{why}; {BEST} ignored: {e}"
    if marked is None:
        return f"{why}; {BEST} was missing"
    if marked.step != best.step:
        return f"{why}; {BEST} named step {marked.step}, stale"
    return why


def _whole(run_dir: str | Path, mark: BestMark, named: str) -> Path:
    path = mark.checkpoint(run_dir)
    if not (path / COMPLETE).is_file():
        raise RunDirError(f"{named}, but {path} is not a complete checkpoint (copied in "
                          "part?); name a checkpoint instead")
    return path


def log_lines(path: Path, torn: Callable[[int, str], None] | None = None
              ) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of each non-blank line of a log.jsonl, in order. Only the
    last line may fail to read (a crash mid-write): it is passed over and `torn` is told its
    number and what it is. Any other line that does not read, and a file that cannot be
    read, is a LogLineError saying which line and why."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise LogLineError(path, None, str(e)) from e
    while lines and not lines[-1].strip():
        lines.pop()
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            value = _json_line(raw)
        except ValueError as e:
            if number < len(lines):
                raise LogLineError(path, number, str(e)) from e
            if torn is not None:
                torn(number, str(e))
            return
        yield number, value


def _json_line(raw: bytes):
    """One line as JSON, or ValueError saying what it is instead."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError("not UTF-8 text") from e
    try:
        return json.loads(text)
    except RecursionError as e:
        raise ValueError("not a record: JSON nested too deeply") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    except ValueError as e:  # json parses digits with int(), which caps their number
        raise ValueError("not a record: it holds a number too long to read") from e


def _saved_validations(run_dir: str | Path) -> dict[int, dict]:
    """step -> the `validation` object of the last record written for that step; the lines
    are read by log_lines' rule, a line that does not read is a RunDirError."""
    path = Path(run_dir) / LOG
    if not path.is_file():
        return {}
    found = {}
    try:
        for number, record in log_lines(path):
            if isinstance(record, dict) and "validation" in record:
                step, validation = _validation_record(record, f"{path} line {number}")
                found[step] = validation
    except LogLineError as e:
        if e.line is None:
            raise RunDirError(str(e)) from e
        raise RunDirError(f"{e}; name a checkpoint instead") from None
    return found


def _validation_record(record: dict, where: str) -> tuple[int, dict]:
    fields = Fields(record, where, RunDirError)
    step = fields.integer("step", low=1)
    validation = fields.mapping("validation")
    best = validation.raw.get("best_step")
    if best is not None:
        validation.integer("best_step", low=1)
    return step, dict(validation.raw)


def _figure(run_dir: str | Path) -> str:
    """The figure the run follows (its config's validation.best_by), `tau` when unreadable:
    a config is read for the name only, never to choose the step."""
    import tomllib

    try:
        section = tomllib.loads((Path(run_dir) / CONFIG).read_text()).get("validation", {})
    except (OSError, ValueError):
        return "tau"
    budgets = [b for b in section.get("tree_budgets") or [] if isinstance(b, int)]
    if section.get("best_by") == "tree_tau" and budgets:
        return f"tree_tau@{max(budgets)}"  # the largest budget, as ValidationConfig sorts
    return "tau"


def _figure_value(validation: dict, figure: str, where: str) -> float:
    fields = Fields(validation, where, RunDirError)
    if figure == "tau":
        return fields.number("tau")
    return fields.mapping("tree_tau").number(figure.removeprefix("tree_tau@"))


def _is_tree_figure(figure: str) -> bool:
    budget = figure.removeprefix("tree_tau@")
    return budget != figure and budget.isdigit() and len(budget) < 16
