"""benchmarks/roofline.py --quick: its tables have the rows and columns the docs rely on, every
rate is positive and every share a plausible fraction of its bound, --update-docs replaces
only the text between the markers, and refuses a file without them before measuring."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import roofline

REPO = Path(__file__).resolve().parents[2]
STAGES = ("target forward", "regeneration (built-in, states kept)", "drafter step", "loader",
          "store writer", "offline replay", "cached live round")
BOUNDS = ("compute (float32 GEMM)", "compute (bfloat16 GEMM)", "memory (copy)",
          "disk (synced write)", "compression (the context codec)")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """(stdout, the docs file after) of one --quick run that updates a marked file."""
    docs = tmp_path_factory.mktemp("docs") / "benchmarks.md"
    docs.write_text(f"# Before\n{roofline.BEGIN}\nold table\n{roofline.END}\n# After\n")
    done = subprocess.run([sys.executable, "-m", "benchmarks.roofline", "--quick",
                           "--update-docs", str(docs)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=True)
    return done.stdout, docs.read_text()


def _rows(text: str, header: str) -> dict[str, list[str]]:
    """{first cell: the other cells} of the markdown table whose header starts `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _value(cell: str) -> float:
    number, unit = cell.split(" ", 1)
    return float(number) * {"T": 1e12, "G": 1e9, "M": 1e6}.get(unit[0], 1.0)


def test_peaks_are_measured_for_both_dtypes_at_the_square_and_smollm2_shapes(quick_run):
    peaks = _rows(quick_run[0], "| peak |")
    for dtype in ("float32", "bfloat16"):
        for m, k, n in ((1024, 1024, 1024), *roofline.SMOLLM2_GEMMS):
            assert _value(peaks[f"GEMM {dtype} {m}x{k}x{n}"][0]) > 0
    assert peaks["memory copy"][0].endswith("B/s")


def test_every_stage_has_a_share_of_its_bound_and_says_what_bounds_it(quick_run):
    stages = _rows(quick_run[0], "| stage | shape |")
    for name in STAGES:
        shape, work, intensity, bound, share, by = stages[name]
        assert 0 < float(share) <= 1.5, (name, share)
        assert _value(work) > 0 and _value(bound) > 0
        assert by in BOUNDS or name == "drafter step", (name, by)
    assert stages["store writer"][-1] in BOUNDS[2:]
    # the step's FLOPs are counted as run, per dtype, and the shares name them
    assert stages["drafter step"][-1].startswith("compute (GEMM; FLOPs ")
    assert "%" in stages["drafter step"][-1]


def test_counted_flops_are_each_matmuls_by_its_output_dtype():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with roofline.CountedFlops() as counted:
        a @ b
        a.bfloat16() @ b.bfloat16()
        torch.bmm(a[None], b[None])
        a + 1  # no FLOPs counted outside matmuls
    assert counted.by_dtype == {"float32": 2 * (2 * 8 * 16 * 4), "bfloat16": 2 * 8 * 16 * 4}


def test_counted_flops_count_the_cpu_flash_attention_as_torch_counts_the_cuda_kernels():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    for kv_heads in (4, 2):  # 2: grouped-query attention, K/V heads shared by two Q heads
        q = torch.randn(2, 4, 8, 16, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, 12, 16, requires_grad=True) for _ in range(2))
        with roofline.CountedFlops() as forward:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with roofline.CountedFlops() as backward:
            out.sum().backward()
        assert forward.by_dtype == {"float32": sdpa_flop_count(q.shape, k.shape, v.shape)}
        want = sdpa_backward_flop_count(out.shape, q.shape, k.shape, v.shape)
        assert backward.by_dtype == {"float32": want}


def test_the_h200_table_counts_the_capture_in_h200s(quick_run):
    h200 = _rows(quick_run[0], "| stage | needed per second |")
    assert set(h200) == {"drafter step", "target forward (capture)", "store writer / loader"}
    assert float(h200["target forward (capture)"][-1]) > 0
    assert "Assumed:" in quick_run[0]


def test_update_docs_replaces_only_the_text_between_the_markers(quick_run):
    stdout, docs = quick_run
    assert docs.startswith(f"# Before\n{roofline.BEGIN}\n") and docs.endswith(
        f"{roofline.END}\n# After\n")
    assert "old table" not in docs and "| drafter step |" in docs


def test_a_file_without_markers_is_refused_before_anything_is_measured(tmp_path, monkeypatch):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# no markers here\n")
    monkeypatch.setattr(sys, "argv", ["roofline", "--update-docs", str(docs)])
    monkeypatch.setattr(roofline, "report", lambda *a: pytest.fail("measured anyway"))
    with pytest.raises(SystemExit, match="roofline:begin"):
        roofline.main()
    assert docs.read_text() == "# no markers here\n"
