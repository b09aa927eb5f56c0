"""benchmarks/gpu.py only ever runs when a GPU is lent, for minutes: a script broken by a
change elsewhere would waste them. Its CPU smoke run takes every code path but CUDA's."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, "benchmarks/gpu.py", "--cpu-smoke", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_gpu_benchmark_measures_every_part_at_tiny_shapes():
    rows = dict(re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", _run(), re.M))
    train = rows["train: 2x64 tokens, 4 blocks/seq, dense mask"]
    assert float(re.match(r"([\d,]+) context tok/s", train)[1].replace(",", "")) > 0
    for part in ("extract: bare forward (output_hidden_states)",
                 "extract: forward_states + top-k", "extract: + background store writer"):
        assert float(re.match(r"([\d,]+) tok/s", rows[part])[1].replace(",", "")) > 0


def test_parts_not_started_within_the_budget_are_skipped():
    out = _run("--budget", "0")
    assert re.search(r"^  train\s+skipped: the 0 s budget is spent$", out, re.M)
    assert re.search(r"^  extract\s+skipped: the 0 s budget is spent$", out, re.M)
    assert "tok/s" not in out
