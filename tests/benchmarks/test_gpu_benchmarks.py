"""Smoke test of `gpu_plans.py`: plans for GPUs by XLA:GPU's compiler."""

import pytest

from tests.benchmarks.tables import run_benchmark, table_cells

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def test_gpu_plans_quick(tmp_path):
    """One card (a plan for another is tests/planner/test_gpu_plan.py's): its plan, its plan
    with micro-batches, and XLA:GPU's own rematerialization under a limit."""
    out = tmp_path / "gpu_plans.md"
    run_benchmark(
        "gpu_plans.py",
        "--quick",
        "--cards=p100",
        "--microbatches=2",
        "--fractions=0.5",
        f"--out={out}",
        timeout=600,
    )
    report = out.read_text()
    assert "planned by XLA:GPU p100 sm_60" in report, report
    assert report.count("pick: remat policy none at batch size 64") == 2, report
    rows = table_cells(report, 5)[2:]  # under the header and its rule
    assert [r[0] for r in rows] == ["unlimited", "its own", "0.5 of it"], report
