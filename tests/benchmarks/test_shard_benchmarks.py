"""Smoke tests of the sharded-state benchmarks (`shard_levels.py`, `shard_plans.py`)."""

import re
import subprocess
import sys

import pytest

from tests.benchmarks.tables import rows_by_first_cell, run_benchmark, table_cells
from tests.subprocesses import REPO_DIR, child_env

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def test_shard_levels_quick(tmp_path):
    out = tmp_path / "shard_levels.md"
    run_benchmark("shard_levels.py", "--quick", "--replicas=2", f"--out={out}", timeout=600)
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/shard_levels.py --quick")
    rows = rows_by_first_cell(report, 7)
    levels = [r for r in rows if r.startswith("`")]
    assert levels == ["`none`", "`optimizer`", "`gradients`", "`weights`"], report
    assert rows["`none`"][2] == "1.00" and float(rows["`weights`"][1]) > 0
    # Unsharded, no all-gather; sharded, one, and less optimizer state kept per replica.
    assert rows["`none`"][4] == "0 B" and rows["`weights`"][4] != "0 B", report


def test_shard_plans_quick(tmp_path):
    out = tmp_path / "shard_plans.md"
    run_benchmark(
        "shard_plans.py", "--quick", "--policies=nothing_saveable", f"--out={out}", timeout=600
    )
    report = out.read_text()
    assert "libtpu's compiler (compile-only) for v5e-8" in report, report
    rows = {r[1]: r for r in table_cells(report, 8) if r[1].startswith("`")}
    assert list(rows) == ["`none`", "`optimizer`", "`gradients`", "`weights`"], report
    kept = {level: float(row[5]) for level, row in rows.items()}
    # "program (temporaries; code)": what the program takes in and gives out is the rest.
    program = {
        level: [float(x) for x in re.findall(r"[\d.]+", row[4])] for level, row in rows.items()
    }
    inputs_and_outputs = {
        level: total - temp - code for level, (total, temp, code) in program.items()
    }
    # AdamW's two slots whole, against an eighth of them (plus the weights' shards); the
    # "weights" program takes (and gives back) shards where the others take whole weights.
    # Temporaries and code are left out: a tiny decoder's are the compiler's fixed costs.
    assert kept["`none`"] > 4 * kept["`optimizer`"] > 4 * kept["`weights`"], report
    assert inputs_and_outputs["`weights`"] < inputs_and_outputs["`gradients`"] / 2, report
    assert program["`none`"][0] > 0, report
    assert all(row[7] == "yes" for row in rows.values()), report


@pytest.mark.parametrize(
    "flag, said", [("--sizes=5b", "unknown size 5b"), ("--depths=x", "--depths takes block counts")]
)
def test_shard_plans_refuses_a_size_it_does_not_know(flag, said):
    proc = subprocess.run(
        [sys.executable, str(REPO_DIR / "benchmarks" / "shard_plans.py"), flag],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and f"error: {said}" in proc.stderr, proc.stderr
