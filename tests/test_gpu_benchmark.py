"""benchmarks/gpu.py only ever runs when a GPU is lent, for minutes: a script broken by a
change elsewhere would waste them. Its CPU smoke run takes every code path but CUDA's."""

import faulthandler
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _call(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--cpu-smoke", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _run(*args: str) -> str:
    out = _call(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _number(text: str, unit: str) -> float:
    return float(re.match(rf"([\d,.]+) {unit}", text)[1].replace(",", ""))


def test_the_gpu_benchmark_measures_every_part_at_tiny_shapes():
    rows = dict(re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", _run(), re.M))
    train = rows["train: 2x64 tokens, 4 blocks/seq, dense mask"]
    assert _number(train, "context tok/s") > 0
    for vocab in (128, 512):  # the smoke run's draft vocabulary, then the whole one
        head = rows[f"head: 120 labelled slots x {vocab} rows"]
        assert _number(head, "ms") > 0 and "% of the training step" in head
    assert float(re.fullmatch(r"([\d.]+)x", rows["head: 512 rows / 128 rows, time"])[1]) > 0
    for workers, cold in ((0, "cold"), (2, "cold"), (0, "warm")):
        label = f"loader: {workers} workers, {cold}"
        loader = next(v for k, v in rows.items() if k.startswith(label))
        assert _number(loader, "MB/s") > 0 and "a step's" in loader
    for part in ("extract: bare forward (output_hidden_states)",
                 "extract: forward_states + top-k", "extract: + background store writer"):
        assert _number(rows[part], "tok/s") > 0


def test_parts_not_started_within_the_budget_are_skipped():
    out = _run("--budget", "0")
    assert re.search(r"^  train\s+skipped: the 0 s budget is spent$", out, re.M)
    assert re.search(r"^  extract\s+skipped: the 0 s budget is spent$", out, re.M)
    assert "tok/s" not in out


def test_parts_run_alone_and_in_the_benchmark_order():
    out = _run("--parts", "loader,head")
    parts = re.findall(r"^  (train|head|loader|extract):", out, re.M)
    assert set(parts) == {"head", "loader"}
    assert parts == sorted(parts, key=["head", "loader"].index)
    # no train part: the head has no step to be a share of, the loader takes the estimate
    assert "% of the training step" not in out and "13k tok/s, assumed" in out


@pytest.mark.parametrize("args, words", [
    (("--parts", "train,warp"), "unknown part(s) warp"),
    (("--parts", ","), "(none given)"),
    (("--budget", "-1"), "'-1' is not a number of seconds >= 0"),
    (("--budget", "nan"), "'nan' is not a number of seconds >= 0"),
])
def test_bad_options_are_refused_before_anything_runs(args, words):
    out = _call(*args)
    assert out.returncode == 2 and words in out.stderr and "tok/s" not in out.stdout


def test_a_part_that_fails_is_reported_and_the_next_part_still_runs(monkeypatch, capfd):
    import benchmarks.gpu as gpu

    def head_that_fails(*args):
        raise RuntimeError("no space left on /dev/shm")

    monkeypatch.setattr(gpu, "bench_head", head_that_fails)
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--cpu-smoke", "--parts", "head,loader"])
    try:
        gpu.main()
    finally:  # main's SIGTERM stack dump would write to this test's captured stderr
        faulthandler.unregister(signal.SIGTERM)
    out = capfd.readouterr().out
    assert re.search(r"^  head\s+failed: RuntimeError: no space left on /dev/shm$", out, re.M)
    assert re.search(r"^  loader: 0 workers, cold .* MB/s after the first batch", out, re.M)


def test_a_second_process_sets_head_and_loader_against_the_first_ones_step(tmp_path):
    measured = tmp_path / "measured.json"
    _run("--parts", "train", "--measured", str(measured))
    step = json.loads(measured.read_text())
    assert step["step_s"] > 0 and step["context_tok_s"] == pytest.approx(128 / step["step_s"])
    out = _run("--parts", "head,loader", "--measured", str(measured))
    assert "% of the training step" in out and "(the train part's)" in out


@pytest.mark.parametrize("content, words", [
    ("not json", "not readable as JSON"),
    ('{"step_s": -1, "context_tok_s": 5}', "expected step_s and context_tok_s > 0"),
    ('{"step_s": 1, "tokens": 5}', "expected step_s and context_tok_s > 0"),
    ("[1, 2]", "expected step_s and context_tok_s > 0"),
    ('{"step_s": true, "context_tok_s": true}', "expected step_s and context_tok_s > 0"),
])
def test_a_measured_file_that_is_not_a_step_is_refused_naming_it(tmp_path, content, words):
    bad = tmp_path / "measured.json"
    bad.write_text(content)
    out = _call("--parts", "head", "--measured", str(bad))
    assert out.returncode != 0 and f"--measured {bad}: {words}" in out.stderr
    assert "head:" not in out.stdout


def test_a_measured_file_in_a_missing_folder_is_refused_before_any_part_runs(tmp_path):
    """It is written after each part: found missing after the first, the rest were lost."""
    missing = tmp_path / "no-such-folder" / "measured.json"
    out = _call("--parts", "head,loader", "--measured", str(missing))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == (f"--measured {missing}: its folder {missing.parent} does not "
                                  "exist (or is not a folder); create it or choose another path")
    assert "head:" not in out.stdout and not missing.parent.exists()


def test_a_measured_file_that_cannot_be_written_is_said_and_the_parts_go_on(tmp_path, capsys):
    import benchmarks.gpu as gpu

    gone = tmp_path / "gone" / "measured.json"  # its folder removed while the parts ran
    gpu.save_measured(gone, {"step_s": 1.0})
    said = capsys.readouterr().out
    assert said.strip().startswith(f"--measured {gone}: cannot write it (No such file")
    assert "the later parts run without it" in said
