"""What `dflash eval` shows and writes: the side-by-side table, JSON, per-block parquet rows,
the plot (per-slot acceptance; tau by anchor position), and decoded example blocks.

Everything here is a pure function of results already computed (dflash_train.evaluate.results,
filled by replay, --online and --served); this module never runs a model and never reads the
store.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dflash_train.drafter.files import write_file_atomically
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.errors import EvalError
from dflash_train.evaluate.results import Agreement
from dflash_train.evaluate.summary import RUN_LABELS, EvalSummary, RunLabel
from dflash_train.store_schema import StoreMeta
from dflash_train.store_schema.info import sampling_settings
from dflash_train.store_schema.meta import DRAWN_BY_KEY, SERVER_DRAWN

REPORT_FILE = "report.json"
"""The report `dflash eval --out DIR` writes in DIR (EvalReport.to_json)."""
BLOCKS_FILE = "blocks.parquet"
"""The per-block rows `dflash eval --out DIR` writes beside it (block_rows)."""

PLOT_EXTRA = "pip install 'dflash-train[plot]'  (matplotlib)"
"""How to get the optional plotting dependency."""


def estimate_warning(meta: StoreMeta, agreement: Agreement) -> str | None:
    """Why offline tau is only an estimate of live tau here, or None when it is exact. Never
    on a sampled store: its answers differ from the verifier's top-1 by design, and replay
    on them equals live sample-and-match at their settings (docs/reference.md §8a)."""
    if meta.sampling is not None:
        return None
    rate = agreement.rate
    shown = "n/a" if rate is None else f"{100 * rate:.2f}%"
    if not meta.source.regenerated:
        return (f"the store's responses are not the target's own greedy output (agreement "
                f"{shown}): offline tau is only an estimate of live tau; extract with "
                f"--regenerate for exact numbers")
    if rate is not None and agreement.matches < agreement.total:
        return (f"the store was regenerated but agrees with its verifier on only {shown} of "
                f"tokens: offline tau is only an estimate of live tau")
    return None


@dataclass
class CheckpointEntry:
    """One checkpoint's entry in the report."""

    name: str
    path: str
    trained_on: list[str] | None
    """The training data of its run (its provenance), when it has one."""
    summaries: dict[RunLabel, EvalSummary]
    """Its summary per run made."""

    def to_json(self) -> dict:
        return {"name": self.name, "path": self.path, "trained_on": self.trained_on,
                **{label: s.to_json() if (s := self.summaries.get(label)) else None
                   for label in RUN_LABELS}}


@dataclass
class EvalReport:
    """The report of `dflash eval`; `to_json` is its one serialisation, which report.json,
    --json, the table and the plot all read."""

    store: str
    """The --store URL as given."""
    meta: StoreMeta
    settings: EvalSettings
    samples: int
    """Samples evaluated (damaged ones skipped left out)."""
    limit: int | None
    seed: int
    agreement: Agreement
    """The store's agreement rate (stored next token == verifier argmax); not written for a
    sampled store, whose labels are its stored tokens."""
    checkpoints: list[CheckpointEntry]
    """In command order."""
    checks: dict[RunLabel, dict]
    """Each decode mode's agreement check, as that mode writes it."""
    skipped: dict | None = None
    """Damaged data skipped (--skip-corrupt)."""

    def to_json(self) -> dict:
        ag = self.agreement
        sampled = self.meta.sampling
        # a greedy store's report keeps exactly the keys it always had
        how = {} if sampled is None else {"sampling": sampled} | (
            {DRAWN_BY_KEY: SERVER_DRAWN} if self.meta.server_drawn else {})
        agreement = None if sampled else {"matches": ag.matches, "total": ag.total,
                                          "rate": ag.rate}
        return {
            "store": self.store,
            "target": self.meta.target.name_or_path,
            "context_layer_ids": list(self.meta.context_layer_ids),
            "regenerated": self.meta.source.regenerated,
            **how,
            "mode": self.settings.mode,
            "samples": self.samples,
            "limit": self.limit,
            "seed": self.seed,
            "tree_budgets": list(self.settings.tree_budgets),
            "recall_at": list(self.settings.recall_at),
            "agreement": agreement,
            "warning": estimate_warning(self.meta, ag),
            "checkpoints": [c.to_json() for c in self.checkpoints],
            **{f"{label}_check": self.checks.get(label) for label in RUN_LABELS[1:]},
            "skipped": self.skipped or {"samples": 0, "parts": 0, "skipped": []},
        }


def dumps(report: dict) -> str:
    """The report as report.json holds it and --json prints it."""
    return json.dumps(report, indent=2)


def write_json(report: dict, path: str | Path) -> None:
    """report.json, through a temporary file renamed into place: never read half-written."""
    write_file_atomically(Path(path), lambda tmp: tmp.write_text(dumps(report) + "\n"))


def block_rows(runs: dict[RunLabel, dict]) -> dict[str, list]:
    """All per-block rows of every run ({label: results per checkpoint}) in one column
    dict, with `checkpoint` and `run` columns (a served run has chain rows only)."""
    columns: dict[str, list] = {"checkpoint": [], "run": []}
    for run, results in runs.items():
        for name, r in results.items():
            table = r.table()
            n = len(table["tau"])
            columns["checkpoint"] += [name] * n
            columns["run"] += [run] * n
            for key, values in table.items():
                columns.setdefault(key, []).extend(values)
    return columns


def write_parquet(columns: dict[str, list], path: str | Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_file_atomically(Path(path), lambda tmp: pq.write_table(pa.table(columns), str(tmp)))


# -- terminal table ---------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _columns(report: dict) -> list[tuple[str, dict]]:
    cols = []
    for c in report["checkpoints"]:
        cols.append((c["name"], c["offline"]))
        for run in ("online", "served"):
            if c.get(run) is not None:
                cols.append((f"{c['name']} ({run})", c[run]))
    return cols


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = zip(row, widths, strict=True)
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(cells))

    return [line(header), *map(line, rows)]


def _streak_rows(metrics: list[dict], slots: int) -> list[list[str]]:
    """One row per streak length up to the longest any column reached; the empty tail (a
    weak drafter leaves most of 0..B-1 at zero) folds into one row of zeros."""
    hists = [m["streak_hist"] for m in metrics]
    longest = max((s for h in hists for s, n in enumerate(h) if n), default=0)
    rows = [[str(s), *[str(h[s]) if s < len(h) else "" for h in hists]]
            for s in range(longest + 1)]
    if longest < slots:
        span = str(slots) if longest + 1 == slots else f"{longest + 1}..{slots}"
        rows.append([span, *["0"] * len(hists)])
    return rows


def format_table(report: dict) -> str:
    """The side-by-side text table: summary, tree acceptance, per-slot rates, histogram."""
    cols = _columns(report)
    names = [n for n, _ in cols]
    metrics = [m for _, m in cols]
    slots = max(m["block_size"] for m in metrics) - 1
    out = [*_header(report), ""]
    out += _grid(["", *names], _summary_rows(metrics, report["tree_budgets"]))
    recall = [k for k in report["recall_at"] if k > 1]
    shown_recall = str(max(recall)) if recall else None
    out += ["", "per slot: P(accept | earlier accepted) / marginal accuracy"
            + (f" / top-{shown_recall} recall" if shown_recall else "")]
    out += _grid(["slot", *names], _slot_rows(metrics, slots, shown_recall))
    out += ["", "streak histogram (blocks)"]
    out += _grid(["streak", *names], _streak_rows(metrics, slots))
    out += _position_section(names, metrics)
    check = report.get("online_check")
    if check and "checkpoints" in check:
        out += ["", *_online_law_lines(check)]
    elif check:
        out += ["", f"online check over {check['prompts']} prompts: generated text equals the "
                f"stored text for {check['same_text']}"]
        for name, same in check["same_taus"].items():
            trees = "".join(f", tree @{b} {n}" for b, n in
                            check.get("same_tree_taus", {}).get(name, {}).items())
            out.append(f"  {name}: prompts whose offline replay taus equal the online ones: "
                       f"chain {same}{trees}")
    if report.get("served_check"):
        out += ["", *format_served(report)]
    return "\n".join(out)


def _online_law_lines(check: dict) -> list[str]:
    """--online on a store a server sampled: per checkpoint, live against offline tau of the
    chain and of each DDTree budget, each with its 95 % interval."""
    out = [f"online check over {check['prompts']} prompts (the store's answers were drawn by "
           f"a server): text and rounds {check['text']}"]
    for name, entry in check["checkpoints"].items():
        out.append(f"  {name}, chain:")
        out += _tau_check_lines(entry["tau_check"])
        for budget, tau in entry["tree_tau_checks"].items():
            out.append(f"  {name}, tree @{budget}:")
            out += _tau_check_lines(tau)
    return out


def _header(report: dict) -> list[str]:
    """The run, the store's agreement (or sampling), and what to read the numbers with."""
    out = [
        f"dflash eval: {report['store']}  mode={report['mode']}  samples={report['samples']}"
        + (f" (limit {report['limit']}, seed {report['seed']})" if report["limit"] else ""),
        _answers_line(report),
    ]
    if report["warning"]:
        out.append(f"WARNING: {report['warning']}")
    skipped = report.get("skipped") or {}
    if skipped.get("skipped"):
        where = ", ".join(f"part {d['part']}" + ("" if d["sample"] is None else
                                                 f" sample {d['sample']}")
                          for d in skipped["skipped"][:10])
        more = ", ..." if len(skipped["skipped"]) > 10 else ""
        out.append(f"SKIPPED as damaged (--skip-corrupt): {skipped['samples']} sample(s), "
                   f"{skipped['parts']} part(s): {where}{more}")
    if report["mode"] == "all":
        out.append("note: --mode all scores every eligible anchor; live decoding visits only "
                   "the --mode replay anchors")
    return out


def _answers_line(report: dict) -> str:
    """The store's agreement; for a sampled store, the settings its answers were drawn at
    (the labels then are those draws, and --online draws the same way)."""
    s = report.get("sampling")
    if s is not None:
        settings = sampling_settings(s)
        if report.get(DRAWN_BY_KEY) == SERVER_DRAWN:
            return (f"store answers: the target's, sampled by a server at {settings}, a seed "
                    f"per request from seed {s['seed']}; labels are these draws, "
                    "in-distribution only (no live decode draws them again)")
        return (f"store answers: the target's, sampled at {settings} with seed {s['seed']}; "
                "labels are these draws (live: sample-and-match with that seed)")
    ag = report["agreement"]
    return (f"store agreement (stored next token == verifier argmax): "
            f"{_fmt(None if ag['rate'] is None else 100 * ag['rate'], 2)}% "
            f"({ag['matches']}/{ag['total']})")


def _summary_rows(metrics: list[dict], tree_budgets: list[int]) -> list[list[str]]:
    rows = [["blocks", *[str(m["n_blocks"]) for m in metrics]],
            ["mean tau", *[_fmt(m["mean_tau"]) for m in metrics]],
            ["tau 95% CI", *[("-" if m["tau_ci95"] is None else
                              f"{m['tau_ci95'][0]:.3f}..{m['tau_ci95'][1]:.3f}")
                             for m in metrics]],
            ["mean streak", *[_fmt(m["mean_streak"]) for m in metrics]]]
    for b in tree_budgets:  # a served run has no trees: "-"
        trees = [m["tree"].get(str(b), {}) for m in metrics]
        rows.append([f"tree tau @{b}", *[_fmt(t.get("mean_tau")) for t in trees]])
        rows.append(["  its rounds", *[str(t.get("rounds", "-")) for t in trees]])
    return rows


def _slot_rows(metrics: list[dict], slots: int, shown_recall: str | None
               ) -> list[list[str]]:
    """Per slot and column: conditional acceptance, marginal accuracy (and top-k recall)."""
    rows = []
    for k in range(slots):
        row = [str(k + 1)]
        for m in metrics:
            if k >= m["block_size"] - 1:
                row.append("")
                continue
            cell = f"{_fmt(m['cond_accept'][k])} {_fmt(m['slot_accuracy'][k])}"
            if shown_recall:
                recall = m["topk_recall"].get(shown_recall)
                cell += f" {_fmt(None if recall is None else recall[k])}"
            row.append(cell)
        rows.append(row)
    return rows


def _position_section(names: list[str], metrics: list[dict]) -> list[str]:
    """The chain's tau per anchor-position bin: one row per bin from the first to the last
    any column has blocks in, a column per checkpoint and run; "-" where a column has none.
    Nothing for summaries without it."""
    by_position = [m.get("tau_by_position") or {"bins": []} for m in metrics]
    width = next((p["bin_tokens"] for p in by_position if p.get("bin_tokens")), None)
    starts = [b["start"] for p in by_position for b in p["bins"]]
    if width is None or not starts:
        return []
    cells = [{b["start"]: _position_cell(b) for b in p["bins"]} for p in by_position]
    rows = [[f"{start}-{start + width - 1}", *[c.get(start, "-") for c in cells]]
            for start in range(min(starts), max(starts) + 1, width)]
    return ["", f"tau by anchor position from the sequence start (bins of {width} tokens): "
                "mean ±CI95 (blocks)", *_grid(["position", *names], rows)]


def _position_cell(b: dict) -> str:
    ci = b["tau_ci95"]
    spread = "" if ci is None else f" ±{(ci[1] - ci[0]) / 2:.3f}"
    return f"{_fmt(b['mean_tau'])}{spread} ({b['n_blocks']})"


def _rates(values: list) -> str:
    return " ".join(_fmt(v, 2) for v in values)


def _served_by(report: dict):
    """The mode of the engine that served (the served columns hold its counters under its
    report key)."""
    from dflash_train.evaluate.engines import SERVING_ENGINES  # they run engines: only here

    modes = list(SERVING_ENGINES.values())
    for c in report["checkpoints"]:
        for mode in modes:
            if (c.get("served") or {}).get(mode.report_key) is not None:
                return mode
    return modes[0]


def _engine_line(name: str, mode, served: dict) -> str:
    """One checkpoint's counters in the engine's convention."""
    v, info = served[mode.report_key], served.get("info") or {}
    resolved = (info.get("resolved") or {}).get("architectures")
    version = (info.get("versions") or {}).get(mode.engine, "?")
    return (f"  {name}: {mode.engine} {version}"
            + (f" as {','.join(resolved)}" if resolved else "")
            + f": drafts {v['num_drafts']}, accepted {v['num_accepted_tokens']}, "
            f"mean acceptance length {_fmt(v['mean_acceptance_length'])}; per "
            f"position {_rates(v['acceptance_rate_per_pos'])}; per-request counts "
            + ("equal" if v["counters_agree"] else "DIFFER FROM")
            + " its Prometheus totals")


def _speed_lines(speed: dict) -> list[str]:
    """Decode speed with and without the drafter, and the tau that breaks even."""
    drafted, plain = speed["with_drafter"], speed["without_drafter"]
    spread = speed["speedup_per_prompt"]
    per_prompt = "" if spread is None else \
        f" (per prompt {_fmt(spread['min'], 2)}..{_fmt(spread['max'], 2)}, median " \
        f"{_fmt(spread['median'], 2)})"
    return [f"    speed, decode only ({speed['prompts']} prompts, {speed['concurrency']}; "
            f"same text without the drafter for {speed['same_text']}): "
            f"{_fmt(drafted['tokens_per_s'], 1)} tokens/s with the drafter, "
            f"{_fmt(plain['tokens_per_s'], 1)} without ({_fmt(drafted['ms_per_token'], 1)} vs "
            f"{_fmt(plain['ms_per_token'], 1)} ms per token): x{_fmt(speed['speedup'], 2)}"
            + per_prompt,
            f"    break-even: a round (draft + verify) costs {_fmt(speed['break_even_tau'], 2)} "
            f"decode steps without the drafter, so it pays where tau > "
            f"{_fmt(speed['break_even_tau'], 2)}; here {_fmt(drafted['tokens_per_round'], 2)} "
            "tokens per round"]


def format_served(report: dict) -> list[str]:
    """The engine's own counters (its convention) and the served-vs-offline check, per
    checkpoint."""
    check = report["served_check"]
    mode = _served_by(report)
    engine = mode.title
    out = [f"served through {engine}, {check['prompts']} prompts; the served columns above "
           f"count committed tokens, like offline. {engine}'s own counters (accepted drafts "
           "per verify step, counted before its stop check; mean acceptance length = 1 + "
           "accepted / drafts):"]
    sampled = check.get("sampling")
    if sampled is not None:
        out.append(f"  sampled with the store's settings (temperature {sampled['temperature']}, "
                   f"top-p {sampled['top_p']}, top-k {sampled['top_k'] or 'off'}; a seed per "
                   f"request from seed {sampled['seed']}); served text and rounds "
                   f"{check['text']}")
    for c in report["checkpoints"]:
        served = c.get("served")
        if served is None:
            continue
        out.append(_engine_line(c["name"], mode, served))
        if served.get("speed"):
            out += _speed_lines(served["speed"])
        entry = check["checkpoints"][c["name"]]
        out += (_tau_check_lines(entry["tau_check"]) if "tau_check" in entry
                else _text_check_lines(entry, check))
    return out


def _text_check_lines(entry: dict, check: dict) -> list[str]:
    """A greedy store's served check of one checkpoint: same text and taus, first difference."""
    same = [f"text equal to the stored text for {entry['same_text']}"]
    same += [f"taus equal to {k.removeprefix('same_taus_as_')} for {n}"
             for k, n in entry.items() if k.startswith("same_taus_as_")]
    out = [f"    {', '.join(same)} of {check['prompts']} prompts"]
    diff = entry["first_difference"]
    if diff is not None:
        out.append(f"    first difference from {check['against']}: {_describe(diff)}")
        out += [f"      possible cause: {x}" for x in entry["likely_causes"]]
    return out


def _tau_check_lines(tau: dict) -> list[str]:
    """One agreement.tau_check: mean tau live (served or online) and offline on the same
    prompts, each with its 95 % interval."""
    def side(x: dict) -> str:
        ci = x["tau_ci95"]
        spread = "no interval" if ci is None else f"{ci[0]:.3f}-{ci[1]:.3f}"
        return f"{_fmt(x['mean_tau'])} ({spread})"

    verdict = {True: "within their intervals", False: "outside their intervals",
               None: "too few rounds for intervals"}[tau["within"]]
    label = next(k for k in tau if k not in ("offline", "within"))
    live, offline = tau[label], tau["offline"]
    return [f"    {label} tau {side(live)} vs offline {side(offline)}: {verdict} "
            f"({live['rounds']} and {offline['rounds']} rounds)"]


def _describe(diff: dict) -> str:
    if diff["kind"] == "text":
        return (f"prompt {diff['prompt']}, response token {diff['response_token']} (position "
                f"{diff['position']}): served {diff['served']}, reference {diff['reference']}")
    return (f"prompt {diff['prompt']}, round {diff['round']} at position {diff['position']}: "
            f"served tau {diff['served']}, reference tau {diff['reference']}")


# -- plot -------------------------------------------------------------------------------


def require_matplotlib() -> None:
    """EvalError with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise EvalError(f"the plot needs matplotlib: {PLOT_EXTRA}") from e


RUN_STYLES = (("offline", "-"), ("online", "--"), ("served", "-."))
"""Each run's line style in the plot."""


def plot_acceptance(report: dict, path: str | Path) -> None:
    """PNG of two panels, one line per checkpoint and run (online dashed, served
    dash-dotted): per-slot acceptance above, tau by anchor position below."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (slots_ax, position_ax) = plt.subplots(2, 1, figsize=(8, 8.5), dpi=120)
    _plot_slots(slots_ax, report)
    _plot_positions(position_ax, report)
    fig.tight_layout()
    write_file_atomically(Path(path), lambda tmp: fig.savefig(str(tmp), format="png"))
    plt.close(fig)


def _plot_slots(ax, report: dict) -> None:
    """Per-slot conditional acceptance, and the offline marginal accuracy (dotted)."""
    for i, c in enumerate(report["checkpoints"]):
        color = f"C{i % 10}"
        for run, style in RUN_STYLES:
            m = c.get(run)
            if m is None:
                continue
            slots = list(range(1, m["block_size"]))
            cond = [math.nan if v is None else v for v in m["cond_accept"]]
            label = f"{c['name']} (tau {_fmt(m['mean_tau'], 2)})" + \
                ("" if run == "offline" else f" {run}")
            ax.plot(slots, cond, style, color=color, marker="o", markersize=3, label=label)
            if run == "offline":
                acc = [math.nan if v is None else v for v in m["slot_accuracy"]]
                ax.plot(slots, acc, ":", color=color, alpha=0.7)
    ax.set_xlabel("slot k (draft position in the block)")
    ax.set_ylabel("P(slot k accepted | slots < k accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"per-slot acceptance, mode {report['mode']} (dotted: marginal accuracy)",
                 fontsize=10)
    ax.legend(fontsize=8)


def _plot_positions(ax, report: dict) -> None:
    """The chain's mean tau at each position bin's midpoint with its 95 % interval as error
    bars; a bin without blocks breaks the line."""
    width = None
    for i, c in enumerate(report["checkpoints"]):
        for run, style in RUN_STYLES:
            by_position = (c.get(run) or {}).get("tau_by_position")
            if not by_position or not by_position["bins"]:
                continue
            width = by_position["bin_tokens"]
            x, y, err = _position_points(by_position)
            label = c["name"] + ("" if run == "offline" else f" {run}")
            ax.errorbar(x, y, yerr=err, fmt=style, color=f"C{i % 10}", marker="o",
                        markersize=3, capsize=2, label=label)
    if width is None:
        ax.text(0.5, 0.5, "no blocks", ha="center", va="center", transform=ax.transAxes)
        return
    ax.set_xlabel(f"anchor position (tokens from the sequence start, prompt included; "
                  f"bins of {width})")
    ax.set_ylabel("mean tau (tokens per round)")
    ax.grid(alpha=0.3)
    ax.set_title("tau by anchor position (bars: 95 % interval)", fontsize=10)
    ax.legend(fontsize=8)


def _position_points(by_position: dict) -> tuple[list[float], list[float], list[list[float]]]:
    """Midpoints, means and [below, above] error lengths of every bin from the first to the
    last holding blocks (NaN mean and no bar where a bin has none or one block)."""
    width = by_position["bin_tokens"]
    bins = {b["start"]: b for b in by_position["bins"]}
    x, y, below, above = [], [], [], []
    for start in range(min(bins), max(bins) + 1, width):
        b = bins.get(start, {"mean_tau": None, "tau_ci95": None})
        mean, ci = b["mean_tau"], b["tau_ci95"]
        x.append(start + (width - 1) / 2)
        y.append(math.nan if mean is None else mean)
        below.append(0.0 if ci is None else mean - ci[0])
        above.append(0.0 if ci is None else ci[1] - mean)
    return x, y, [below, above]


# -- decoded example blocks -------------------------------------------------------------


@dataclass
class ShownBlock:
    """One block to print: its text around the anchor and every checkpoint's draft."""

    where: str
    """e.g. "part 0 sample 3 (source row 17), anchor 42"."""
    context: list[int]
    """Tokens up to and including the anchor token (a tail of them)."""
    target: list[int]
    """The target's tokens for slots 1.. (verifier argmax at a+k-1), valid slots only."""
    drafts: dict[str, list[int]]
    """Per checkpoint: its draft (top-1) for slots 1..B-1."""


def _decoder(tokenizer):
    if tokenizer is None:
        return lambda ids: " ".join(str(i) for i in ids)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def format_shown(blocks: list[ShownBlock], tokenizer) -> str:
    """Decoded blocks: context tail, target continuation, each draft split at its first
    mismatch with `‖`, so garbled drafts are seen, not inferred."""
    decode = _decoder(tokenizer)
    out = []
    for b in blocks:
        out.append(f"--- {b.where}")
        out.append(f"  context : …{decode(b.context)!r}")
        out.append(f"  target  : {decode(b.target)!r}")
        width = max(len(n) for n in b.drafts)
        for name, draft in b.drafts.items():
            streak = 0
            while streak < min(len(draft), len(b.target)) and draft[streak] == b.target[streak]:
                streak += 1
            out.append(f"  {name.ljust(width)} : {decode(draft[:streak])!r} ‖ "
                       f"{decode(draft[streak:])!r}  (streak {streak})")
    return "\n".join(out)
