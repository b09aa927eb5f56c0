"""Build the environment speculators' trainer runs in, apart from ours, the same way each time.

    python -m benchmarks.peer.venv [--dir ~/.cache/dflash-train/speculators-venv] [--rebuild]

A plain `pip install speculators==0.9.0` pulls torchvision and torchaudio, whose newest
releases pull a CUDA torch 2.14 (and 3 GB of CUDA libraries and triton) in place of the CPU
one. So the CPU wheel goes in first and speculators is installed with `torch==2.13.0` pinned
in the same command: pip then picks the torchvision / torchaudio built for 2.13 and keeps the
CPU torch. The two are removed after (its trainer never imports them), and the result is
checked: a CPU torch 2.13.0, no CUDA libraries, no triton. Prints every step, the versions
that ended up installed and how long it took.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

SPECULATORS = "speculators==0.9.0"
TORCH = "torch==2.13.0"
DEFAULT_DIR = Path.home() / ".cache" / "dflash-train" / "speculators-venv"
UNWANTED = ("torchvision", "torchaudio")
"""Pulled in by speculators' requirements, never imported by its trainer."""
STAMP = "dflash-peer.json"
"""Written into the venv last: what was installed, so a finished build is not redone."""


def _run(cmd: list[str], echo) -> None:
    echo("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def torch_source(wheel: str | None) -> list[str]:
    """pip arguments that install the CPU torch: a local wheel, else `torch==2.13.0` as the
    README installs it (pip's own configuration decides where from)."""
    return [wheel] if wheel else [TORCH]


def build(venv: Path, torch_wheel: str | None, speculators: str = SPECULATORS,
          echo=print) -> dict:
    """Create `venv` and install speculators on a CPU torch; returns what was installed."""
    start = time.perf_counter()
    if venv.exists():
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)], echo)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input"]
    _run(pip + torch_source(torch_wheel), echo)
    _run(pip + [speculators, TORCH], echo)
    _run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", *UNWANTED], echo)
    versions = installed(venv)
    _check_cpu_only(venv, versions)
    record = {"speculators": speculators, "torch_source": torch_source(torch_wheel),
              "versions": versions, "seconds": round(time.perf_counter() - start, 1)}
    (venv / STAMP).write_text(json.dumps(record, indent=2) + "\n")
    return record


def installed(venv: Path) -> dict[str, str]:
    """Versions of the packages that matter to the comparison, as the venv reports them."""
    code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
            "('speculators', 'torch', 'transformers', 'datasets', 'hs-connectors')}))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def _check_cpu_only(venv: Path, versions: dict[str, str]) -> None:
    """Refuse a venv whose torch is not the CPU 2.13.0 or that holds CUDA libraries / triton
    (with triton importable, torch and transformers take GPU kernel paths on a CPU box)."""
    site = next((venv / "lib").glob("python*/site-packages"))
    gpu = sorted(p.name for p in site.iterdir()
                 if p.name.startswith(("nvidia", "triton", "cuda_")) and p.suffix != ".pth")
    if not versions["torch"].startswith("2.13.0") or "+cpu" not in versions["torch"] or gpu:
        raise SystemExit(f"{venv}: expected a CPU torch 2.13.0 and no CUDA packages, got torch "
                         f"{versions['torch']} and {gpu[:6]}; pip resolved differently than "
                         "this script expects")


def python_of(venv: Path) -> Path:
    """The venv's python, refusing a venv whose build did not finish."""
    if not (venv / STAMP).is_file():
        raise SystemExit(f"{venv}: no finished speculators venv (no {STAMP}); build it with "
                         "`python -m benchmarks.peer.venv`")
    return venv / "bin" / "python"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the venv goes")
    ap.add_argument("--torch-wheel", default=None,
                    help="a local CPU torch 2.13.0 wheel (default: pip install torch==2.13.0)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild a finished venv")
    args = ap.parse_args()
    if (args.dir / STAMP).is_file() and not args.rebuild:
        print(f"{args.dir}: already built: {(args.dir / STAMP).read_text().strip()}")
        return
    record = build(args.dir, args.torch_wheel)
    print(f"built {args.dir} in {record['seconds']} s: {record['versions']}")


if __name__ == "__main__":
    main()
