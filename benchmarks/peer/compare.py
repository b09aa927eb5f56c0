"""Ours and speculators side by side on any store: train both, evaluate both, one table.

    python -m benchmarks.peer.compare --store train.zarr --held-out held_out.zarr \
        --model TARGET_DIR --work /tmp/peer-run [--steps 20 --lr 6e-3 ...]

1. speculators' training files from --store (benchmarks.peer.writer) and its verifier
   directory from the store's frozen rows (benchmarks.peer.verifier), kept in --work and
   reused by a later run on the same store;
2. both trainers with the same PeerSettings (benchmarks.peer.runner): the same steps, or
   with --seconds the same training wall time: each trainer first runs --calibrate-steps
   steps, and its real run gets the steps that fill --seconds at that rate (so each
   schedule still ends at its last step);
3. speculators' checkpoint converted into a drafter directory (benchmarks.peer.convert) and
   ours exported in bf16 (`dflash export`, the dtype speculators saves in);
4. `dflash eval --store HELD_OUT` on both in one run, and a table of tau, training tokens/s,
   peak RSS and bytes on disk of each format, also written to --work/compare.json.
Needs the speculators venv (python -m benchmarks.peer.venv). Timings on a shared machine are
noise: read the ratios of one run.
"""

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Literal, get_args, get_origin

from benchmarks.peer.convert import convert
from benchmarks.peer.runner import REPO, Measured, PeerSettings, run_ours, run_speculators
from benchmarks.peer.venv import DEFAULT_DIR, python_of
from benchmarks.peer.verifier import write_verifier
from benchmarks.peer.writer import (
    TargetFinalLayer,
    speculators_layer_ids,
    tree_bytes,
    write_dataset,
)
from dflash_train.store_schema import open_store
from dflash_train.store_schema.layout import PARTS_GROUP


def speculators_data(store_url: str, model: str, work: Path) -> Path:
    """The store's speculators files under `work`, written once."""
    out = work / "speculators-data"
    if not out.exists():
        store = open_store(store_url)
        written = write_dataset(store_url, out, TargetFinalLayer(model, store))
        (work / "speculators-data.json").write_text(json.dumps(asdict(written), indent=2))
    return out


def data_bytes(store: str, data: Path) -> dict[str, int]:
    """Bytes on disk of the training data in each format, whole and per sample data only
    (ours also holds the frozen target rows and tokenizer; speculators reads those from the
    target's own files)."""
    return {"our store": tree_bytes(Path(store)),
            "our store, samples only": tree_bytes(Path(store) / PARTS_GROUP),
            "speculators files": tree_bytes(data)}


def evaluate(held_out: str, checkpoints: list[str], work: Path) -> dict:
    out = work / "eval"
    cmd = [sys.executable, "-m", "dflash_train", "eval", "--store", held_out, *checkpoints,
           "--device", "cpu", "--out", str(out), "--no-progress"]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "report.json").read_text())


def steps_filling(seconds: float, calibration: Measured) -> int:
    """Steps that fill `seconds` of training at the calibration run's seconds per step."""
    return max(1, round(seconds * calibration.steps / calibration.train_seconds))


def compare(store: str, held_out: str, model: str, work: Path, s: PeerSettings,
            venv: Path = DEFAULT_DIR, seconds: float | None = None,
            calibrate_steps: int = 10) -> dict:
    python = python_of(venv)
    work.mkdir(parents=True, exist_ok=True)
    src = open_store(store)
    data = speculators_data(store, model, work)
    samples = src.num_samples
    mean_length = src.num_tokens / samples
    verifier = work / "speculators-verifier"
    if not verifier.exists():
        write_verifier(src, verifier)

    def theirs_for(settings: PeerSettings, into: Path) -> Measured:
        return run_speculators(python, str(data), verifier,
                               speculators_layer_ids(src.meta.context_layer_ids),
                               int(src.meta.extra["mask_token_id"]), samples, mean_length,
                               into, settings)

    calibration = {}
    s_ours = s_theirs = s
    if seconds is not None:
        into = work / "calibrate"
        into.mkdir(exist_ok=True)
        short = replace(s, steps=calibrate_steps)
        calibration = {"ours": run_ours(store, into, short), "theirs": theirs_for(short, into)}
        s_ours = replace(s, steps=steps_filling(seconds, calibration["ours"]))
        s_theirs = replace(s, steps=steps_filling(seconds, calibration["theirs"]))
    ours = run_ours(store, work, s_ours)
    theirs = theirs_for(s_theirs, work)
    theirs_dir = convert(theirs.checkpoint, work / "speculators-drafter",
                         src.meta.target.num_hidden_layers, overwrite=True)
    ours_dir = work / "ours-drafter"
    subprocess.run([sys.executable, "-m", "dflash_train", "export", ours.checkpoint,
                    str(ours_dir), "--overwrite"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    report = evaluate(held_out, [str(ours_dir), str(theirs_dir)], work)
    result = {
        "settings": asdict(s), "seconds": seconds,
        "calibration": {k: asdict(m) for k, m in calibration.items()},
        "store": store, "held_out": held_out, "samples": samples, "tokens": src.num_tokens,
        "runs": [dict(asdict(m), tokens_per_s=m.tokens_per_s) for m in (ours, theirs)],
        "tau": [c["offline"]["mean_tau"] for c in report["checkpoints"]],
        "bytes": data_bytes(store, data) | {
            "our checkpoint (fp32 + optimiser)": tree_bytes(Path(ours.checkpoint)),
            "speculators checkpoint (bf16 + optimiser)": tree_bytes(Path(theirs.checkpoint)),
            "our export (bf16)": tree_bytes(ours_dir),
            "speculators converted (bf16)": tree_bytes(theirs_dir)},
    }
    (work / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict) -> str:
    ours, theirs = (Measured(**{f.name: r[f.name] for f in fields(Measured)})
                    for r in result["runs"])
    rows = [("", "dflash-train", "speculators 0.9.0", "theirs / ours"),
            ("held-out mean tau", *(f"{t:.3f}" for t in result["tau"]),
             f"{result['tau'][1] / result['tau'][0]:.2f}"),
            ("steps", str(ours.steps), str(theirs.steps), ""),
            ("training seconds", f"{ours.train_seconds:,.0f}", f"{theirs.train_seconds:,.0f}",
             f"{theirs.train_seconds / ours.train_seconds:.2f}"),
            ("training tokens", str(ours.train_tokens), str(theirs.train_tokens),
             f"{theirs.train_tokens / ours.train_tokens:.2f}"),
            ("training tokens/s", f"{ours.tokens_per_s:,.0f}", f"{theirs.tokens_per_s:,.0f}",
             f"{theirs.tokens_per_s / ours.tokens_per_s:.2f}"),
            ("peak RSS (MiB)", f"{ours.peak_rss_mib:,.0f}", f"{theirs.peak_rss_mib:,.0f}",
             f"{theirs.peak_rss_mib / ours.peak_rss_mib:.2f}")]
    b = result["bytes"]
    pairs = [("training data", "our store", "speculators files"),
             ("  samples only", "our store, samples only", "speculators files"),
             ("checkpoint", "our checkpoint (fp32 + optimiser)",
              "speculators checkpoint (bf16 + optimiser)"),
             ("drafter (bf16)", "our export (bf16)", "speculators converted (bf16)")]
    for name, a, c in pairs:
        rows.append((f"{name} bytes", f"{b[a]:,}", f"{b[c]:,}", f"{b[c] / b[a]:.2f}"))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, width, strict=True)).rstrip()
                     for r in rows)


def positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="store both trainers train on")
    ap.add_argument("--held-out", required=True, help="store both drafters are evaluated on")
    ap.add_argument("--model", required=True, help="the stores' target (a local directory)")
    ap.add_argument("--work", type=Path, required=True, help="directory for every output")
    ap.add_argument("--venv", type=Path, default=DEFAULT_DIR, help="speculators' venv")
    ap.add_argument("--seconds", type=positive, default=None,
                    help="equal training wall time instead of equal steps (--steps ignored)")
    ap.add_argument("--calibrate-steps", type=int, default=10, choices=range(2, 1001),
                    metavar="2..1000",
                    help="steps each trainer runs to measure its seconds per step")
    for f in fields(PeerSettings):
        kind = f.type if f.type in (int, float) else int if f.type == (int | None) else str
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                        choices=get_args(f.type) if get_origin(f.type) is Literal else None,
                        help=f"PeerSettings.{f.name} (default {f.default})")
    args = ap.parse_args()
    try:
        s = PeerSettings(**{f.name: getattr(args, f.name) for f in fields(PeerSettings)})
    except ValueError as e:
        ap.error(str(e))
    result = compare(args.store, args.held_out, args.model, args.work, s, args.venv,
                     args.seconds, args.calibrate_steps)
    print(table(result))


if __name__ == "__main__":
    main()
