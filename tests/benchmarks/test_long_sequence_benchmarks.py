"""Smoke tests of `long_sequences.py`: blockwise attention and the chunked loss."""

import pytest

from tests.benchmarks.tables import run_benchmark, table_cells

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def test_long_sequences_quick(tmp_path):
    out = tmp_path / "long_sequences.md"
    run_benchmark("long_sequences.py", "--quick", f"--out={out}", timeout=600)
    report = out.read_text()
    assert "XLA:CPU and TPU v5e (libtpu, compile-only)" in report, report
    rows = {(r[0], r[1]): r for r in table_cells(report, 7) if r[0] in ("256", "512")}
    assert set(rows) == {(s, w) for s in ("256", "512") for w in ("plain", "blockwise")}, report
    assert all(float(r[2]) > 0 and float(r[5]) > 0 for r in rows.values()), report
    losses = {r[1]: r for r in table_cells(report, 4) if r[1] in ("whole", "chunked")}
    assert set(losses) == {"whole", "chunked"}, report


def test_long_sequences_times_the_settings_quick(tmp_path):
    out = tmp_path / "long_sequences_time.md"
    run_benchmark("long_sequences.py", "--quick", "--time", "--repeats=1", f"--out={out}")
    rows = [r for r in table_cells(out.read_text(), 5) if r[0] in ("256", "512")]
    assert [r[1] for r in rows[:3]] == [
        "plain",
        "blockwise attention",
        "blockwise + chunked loss",
    ]
    assert all(float(r[2]) > 0 for r in rows), rows
