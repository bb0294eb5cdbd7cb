"""Smoke tests of `scan_layers.py`: scanned stacks against unrolled ones."""

import pytest

from tests.benchmarks.tables import run_benchmark

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def test_scan_layers_quick(tmp_path):
    out = tmp_path / "scan_layers.md"
    run_benchmark("scan_layers.py", "--quick", f"--out={out}", "--steps=1", "--depths=2")
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/scan_layers.py --quick")
    assert "Step `trainer`" in report
    rows = [line for line in report.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1, report
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        # depth, batch, policy, compile s (2), XLA temp (2) and ratio, peak (2), step s, ratio.
        assert cells[1] == "2" and all(float(c) >= 0 for c in cells[3:]), row


def test_scan_layers_plans_every_batch_quick(tmp_path):
    out = tmp_path / "scan_layers_plans.md"
    run_benchmark(
        "scan_layers.py",
        "--quick",
        f"--out={out}",
        "--depths=2",
        "--batches=1,2",
        "--compile_only",
        "--step=sgd",
    )
    report = out.read_text()
    assert "Plans for XLA:CPU" in report and "Step `sgd`" in report, report
    rows = [line for line in report.splitlines() if line.startswith("| 2 ")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    assert [c[1] for c in cells] == ["1", "2"], report
    # depth, batch, policy, compile s (2), temps (2) and their ratio, totals (2); XLA:CPU
    # reports no code size.
    assert all(float(c) > 0 for row in cells for c in row[7:10]), report
    assert all(row[10:] == ["-", "-"] for row in cells), report


def test_scan_layers_planned_for_a_tpu_quick(tmp_path):
    out = tmp_path / "scan_layers_tpu.md"
    run_benchmark("scan_layers.py", "--quick", f"--out={out}", "--depths=2", "--target=v5e")
    report = out.read_text()
    assert "TPU v5e (libtpu" in report, report
    rows = [line for line in report.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1, report
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    # depth, batch, policy, compile s (2), temps (2) and their ratio, totals (2), code (2): a
    # plan, no step time. The tiny model's temporaries fit in the chip's on-chip memory, so its
    # HBM temps may be 0.
    assert len(cells) == 12, rows[0]
    compile_s, temps, totals_and_code = cells[3:5], cells[5:7], cells[8:12]
    assert all(float(c) > 0 for c in compile_s + totals_and_code), rows[0]
    assert all(float(c) >= 0 for c in temps), rows[0]
