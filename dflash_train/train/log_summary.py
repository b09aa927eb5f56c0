"""Answers about a run from its log.jsonl, the questions people otherwise script by hand.

Pure functions over the step records the training loop writes (train.record.StepRecord);
`read_log` refuses a line that is not such a record (naming the file and line), so the
summaries below can read their fields (which lines are read at all, blank, torn or not JSON,
is run_reader.log_lines' rule, shared with the run's other readers); `summarize_log` returns
a plain dict and `format_summary` the text `dflash log summary` prints.
"""

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dflash_train.json_fields import Fields, is_number, show_value
from dflash_train.run_layout import LOG
from dflash_train.run_reader import LogLineError, log_lines
from dflash_train.train.errors import TrainError
from dflash_train.train.record import StepRecord

REQUIRED = {"step": "count", "epoch": "count", "loss": "number", "lr": "number",
            "tokens": "number"}
"""Fields every record the loop writes holds, and what each must be (json_fields: a count
is an integer >= 0; a number may be NaN or Inf, which a diverged step logs)."""
OPTIONAL = {"grad_norm": "number", "samples": "number", "skipped": "count", "blocks": "count",
            "noise_std": "number", "data_wait_s": "number", "step_s": "number",
            "tokens_per_s": "number", "train_tau": "number", "selector_recall": "number"}
"""Fields a record holds on some steps (or in some versions) only: a value of that kind or
null. StepRecord.from_json reads each of them, so each is checked here."""
_VALIDATION = {"tau": "number", "blocks": "count"}
"""Scalar fields of train.record.StoreFigures (the pooled figures and each store's)."""
_BUDGET_DIGITS = 15
"""A DDTree node budget is a small whole number; the key's length is bounded so that int()
never meets a number too long to read."""
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
               float: "number", type(None): "null"}


def read_log(run_dir: str | Path, note: Callable[[str], None] | None = None
             ) -> list[StepRecord]:
    """The records of RUN_DIR/log.jsonl, the last one of each step; a line that is not a
    record the loop writes is a TrainError naming the file and line. Lines are read by
    run_reader.log_lines: a torn last line is passed over, and `note` is told so."""
    path = Path(run_dir) / LOG
    if not path.is_file():
        raise TrainError(f"{path} does not exist: is {run_dir} a training run directory?")
    torn: list[tuple[int, str]] = []
    try:
        records = _checked_records(path, torn.append)
    except LogLineError as e:
        why = "" if e.line is None else "; is this a dflash training log?"
        raise TrainError(f"{e}{why}") from e
    if torn and not records:
        number, why = torn[0]
        raise TrainError(f"{path} line {number} is {why}; the log holds no complete record: a "
                         "run killed in its first step, or not a dflash training log?")
    if torn and note is not None:
        number = torn[0][0]
        note(f"note: {path} line {number} is torn (a crash mid-write?); read the "
             f"{number - 1} lines before it")
    if not records:
        raise TrainError(f"{path} holds no records yet (the run has not finished a step)")
    # A resumed run appends: keep the last record written for each step.
    by_step = {r.step: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def _checked_records(path: Path, torn: Callable[[tuple[int, str]], None]
                     ) -> list[StepRecord]:
    """Each line log_lines reads, in order, checked (check_record) and made a StepRecord;
    a torn last line goes to `torn` as (number, what it is)."""
    records, slots = [], None
    for number, record in log_lines(path, lambda n, why: torn((n, why))):
        try:
            check_record(record, f"{path} line {number}", slots)
        except TrainError as e:
            raise TrainError(f"{e}; each line of a training log is a JSON object with "
                             f"{', '.join(REQUIRED)} (is this a dflash training log?)") from None
        records.append(StepRecord.from_json(record))
        if record.get("slot_acc") is not None:
            slots = (len(record["slot_acc"]), number)
    return records


def check_record(record, where: str, slots: tuple[int, int] | None = None) -> None:
    """Refuse (TrainError naming `where` and the field) a parsed log line that is not a
    record the loop writes: every field StepRecord.from_json reads is checked, so the
    summaries never meet a value of another type. `slots`: (slots, line) of an earlier
    record's slot_acc, which every one must match."""
    if not isinstance(record, dict):
        kind = _JSON_TYPES.get(type(record), type(record).__name__)
        raise TrainError(f"{where}: is a JSON {kind}")
    fields = Fields(record, where, TrainError)
    for name, kind in REQUIRED.items():
        _read(fields, name, kind)
    for name, kind in OPTIONAL.items():
        _optional(fields, name, kind)
    if record.get("slot_acc") is not None:
        _check_slot_acc(fields, slots)
    if record.get("validation") is not None:
        _check_validation(fields.mapping("validation"))


def _read(fields: Fields, name: str, kind: str) -> None:
    if kind == "count":
        fields.integer(name, low=0)
    else:
        fields.number(name, finite=False)


def _optional(fields: Fields, name: str, kind: str) -> None:
    """A field the loop writes as null when it has no value (or older logs lack)."""
    if fields.raw.get(name) is not None:
        _read(fields, name, kind)


def _check_slot_acc(fields: Fields, slots: tuple[int, int] | None) -> None:
    acc = fields.sequence("slot_acc")
    if not all(a is None or is_number(a) for a in acc):
        raise TrainError(f"{fields.where}: field 'slot_acc' is {show_value(acc)}, not a list of "
                         "numbers")
    if slots is not None and len(acc) != slots[0]:
        raise TrainError(f"{fields.where}: 'slot_acc' has {len(acc)} slots, line "
                         f"{slots[1]}'s has {slots[0]} (one run has one block size)")


def _check_validation(validation: Fields) -> None:
    """The `validation` object train.validation writes (record.ValidationFigures)."""
    _check_figures(validation)
    _optional(validation, "seconds", "number")
    _optional(validation, "best_step", "count")
    if validation.raw.get("tau_ci95") is not None:
        ci = validation.sequence("tau_ci95")
        if len(ci) != 2 or not all(is_number(x) for x in ci):
            raise TrainError(f"{validation.where}: field 'tau_ci95' is {show_value(ci)}, not two "
                             "numbers")
    if validation.raw.get("stores") is not None:
        stores = validation.mapping("stores")
        for url in stores.raw:
            _check_figures(stores.mapping(url))


def _check_figures(figures: Fields) -> None:
    """One record.StoreFigures: tau and blocks, and tau per DDTree node budget."""
    for name, kind in _VALIDATION.items():
        _optional(figures, name, kind)
    if figures.raw.get("tree_tau") is None:
        return
    trees = figures.mapping("tree_tau")
    for budget in trees.raw:
        # str.isdigit alone takes '²', which int() refuses
        if not (budget.isascii() and budget.isdigit() and len(budget) <= _BUDGET_DIGITS):
            raise TrainError(f"{trees.where}: key {show_value(budget)} is not a node budget (a "
                             "whole number)")
        _optional(trees, budget, "number")


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(values)) if values else None


def step_ranges(records: list[StepRecord], parts: int) -> list[dict]:
    """Mean loss, per-slot accuracy and train tau over `parts` equal step ranges."""
    out = []
    for chunk in np.array_split(np.arange(len(records)), min(parts, len(records))):
        rs = [records[i] for i in chunk]
        measured = [r.accuracy for r in rs if r.accuracy is not None]
        accs = [a.slot_acc for a in measured if a.slot_acc]
        slot_acc = None
        if accs:
            slot_acc = [_mean(col) for col in zip(*accs, strict=True)]
        out.append({"steps": (rs[0].step, rs[-1].step), "loss": _mean(r.loss for r in rs),
                    "slot_acc": slot_acc, "train_tau": _mean(a.train_tau for a in measured)})
    return out


def lr_phase(records: list[StepRecord]) -> dict:
    """Where the schedule is: warmup (rising), decay (falling) or flat, and the peak."""
    lrs = [r.lr for r in records]
    peak = int(np.argmax(lrs))
    tail = lrs[-min(5, len(lrs)):]
    if len(tail) < 2 or math.isclose(tail[0], tail[-1], rel_tol=1e-9, abs_tol=1e-15):
        phase = "flat"
    elif tail[-1] > tail[0]:
        phase = "warmup"
    else:
        phase = "decay"
    return {"phase": phase, "current_lr": lrs[-1], "peak_lr": lrs[peak],
            "peak_step": records[peak].step}


def epoch_boundaries(records: list[StepRecord], window: int = 5) -> list[dict]:
    """Loss just before and just after each epoch change (a jump means a data-order effect)."""
    out = []
    for i in range(1, len(records)):
        if records[i].epoch != records[i - 1].epoch:
            before = records[max(0, i - window):i]
            after = records[i:i + window]
            out.append({"epoch": records[i].epoch, "step": records[i].step,
                        "loss_before": _mean(r.loss for r in before),
                        "loss_after": _mean(r.loss for r in after)})
    return out


def noise_effect(records: list[StepRecord]) -> dict:
    """Noise level and loss in the first and last fifth of the run."""
    k = max(1, len(records) // 5)
    early, late = records[:k], records[-k:]
    return {"early": {"noise_std": _mean(r.noise_std for r in early),
                      "loss": _mean(r.loss for r in early)},
            "late": {"noise_std": _mean(r.noise_std for r in late),
                     "loss": _mean(r.loss for r in late)}}


def _percentiles(values) -> dict:
    a = np.asarray(values, dtype=float)
    return {"p10": float(np.percentile(a, 10)), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "min": float(a.min()), "max": float(a.max())}


def summarize_log(records: list[StepRecord], parts: int = 5) -> dict:
    # a field an older or hand-written log lacks counts as 0 in these sums
    waits = sum(r.data_wait_s or 0.0 for r in records)
    busy = sum(r.step_s or 0.0 for r in records)
    speeds = [r.tokens_per_s for r in records if r.tokens_per_s]
    speed = _percentiles(speeds) if speeds else None
    if speed is not None:
        speed["cv"] = float(np.std(speeds) / np.mean(speeds)) if np.mean(speeds) else 0.0
    return {
        "steps": records[-1].step,
        "epochs_seen": sorted({r.epoch for r in records}),
        "ranges": step_ranges(records, parts),
        "lr": lr_phase(records),
        "epoch_boundaries": epoch_boundaries(records),
        "noise": noise_effect(records),
        "batch_tokens": _percentiles([r.tokens for r in records]),
        "batch_samples": _percentiles([r.samples or 0 for r in records]),
        "tokens_per_s": speed,
        "data_wait_share": waits / (waits + busy) if waits + busy > 0 else None,
        "validation": validation_curve(records),
    }


def validation_curve(records: list[StepRecord]) -> dict | None:
    """The validation figures step by step (pooled over the stores) and the best step the
    run chose (validation.best_by), or None for a run without validation stores."""
    validated = [r for r in records if r.validation is not None]
    if not validated:
        return None
    curve = [{"step": r.step, "tau": r.validation.pooled.tau,
              "tree_tau": {str(b): t for b, t in r.validation.pooled.tree_tau.items()},
              "blocks": r.validation.pooled.blocks, "seconds": r.validation.seconds}
             for r in validated]
    best_step = validated[-1].validation.best_step
    best = next((point for point in curve if point["step"] == best_step), None)
    return {"curve": curve, "best_step": best_step, "best": best,
            "stores": sorted(validated[-1].validation.stores)}


def _fmt(v, spec=".4g") -> str:
    return "-" if v is None else format(v, spec)


def format_summary(s: dict) -> str:
    lines = [f"steps {s['steps']}, epochs {s['epochs_seen'][0]}..{s['epochs_seen'][-1]}", "",
             "loss and accuracy by step range:",
             f"  {'steps':>13} {'loss':>8} {'tau':>6}  slot acc 1,2,4,8,15"]
    for r in s["ranges"]:
        acc = r["slot_acc"]
        picks = "-" if not acc else ", ".join(_fmt(acc[k - 1], ".2f") for k in (1, 2, 4, 8, 15)
                                              if k <= len(acc))
        lines.append(f"  {r['steps'][0]:>6}-{r['steps'][1]:<6} {_fmt(r['loss']):>8} "
                     f"{_fmt(r['train_tau'], '.2f'):>6}  {picks}")
    lr = s["lr"]
    lines += ["", f"lr schedule: {lr['phase']} (now {lr['current_lr']:.3g}, peak "
              f"{lr['peak_lr']:.3g} at step {lr['peak_step']})"]
    n = s["noise"]
    lines.append(f"noise: early std {_fmt(n['early']['noise_std'])} loss "
                 f"{_fmt(n['early']['loss'])}; late std {_fmt(n['late']['noise_std'])} loss "
                 f"{_fmt(n['late']['loss'])}")
    for b in s["epoch_boundaries"]:
        lines.append(f"epoch {b['epoch']} starts at step {b['step']}: loss "
                     f"{_fmt(b['loss_before'])} -> {_fmt(b['loss_after'])}")
    bt, bs = s["batch_tokens"], s["batch_samples"]
    lines.append(f"batch tokens p10/p50/p90 {bt['p10']:.0f}/{bt['p50']:.0f}/{bt['p90']:.0f}; "
                 f"samples {bs['p10']:.0f}/{bs['p50']:.0f}/{bs['p90']:.0f}")
    if s["tokens_per_s"]:
        t = s["tokens_per_s"]
        lines.append(f"tokens/s p10/p50/p90 {t['p10']:.0f}/{t['p50']:.0f}/{t['p90']:.0f} "
                     f"(variation {t['cv']:.0%})")
    if s["data_wait_share"] is not None:
        lines.append(f"data wait: {s['data_wait_share']:.1%} of step time")
    if s.get("validation"):
        lines += ["", *_format_validation(s["validation"])]
    return "\n".join(lines)


def _format_validation(v: dict) -> list[str]:
    budgets = sorted({b for p in v["curve"] for b in p["tree_tau"]}, key=int)
    lines = [f"validation on {', '.join(v['stores'])} (pooled):",
             f"  {'step':>8} {'tau':>7} " + " ".join(f"{'tree@' + b:>9}" for b in budgets)
             + f" {'blocks':>8} {'seconds':>8}"]
    for p in v["curve"]:
        lines.append(f"  {p['step']:>8} {_fmt(p['tau'], '.4f'):>7} "
                     + " ".join(f"{_fmt(p['tree_tau'].get(b), '.4f'):>9}" for b in budgets)
                     + f" {p['blocks']:>8} {p['seconds']:>8.1f}")
    best = v["best"]
    lines.append("best: none yet" if best is None else
                 f"best: step {best['step']} (tau {_fmt(best['tau'], '.4f')}"
                 + "".join(f", tree@{b} {_fmt(t, '.4f')}" for b, t in best["tree_tau"].items())
                 + ")")
    return lines
