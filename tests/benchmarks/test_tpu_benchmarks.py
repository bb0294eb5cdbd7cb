"""Smoke tests of the libtpu benchmarks: `tpu_xla_remat.py`, `tpu_compile_options.py`."""

import pytest

from tests.benchmarks.tables import rows_by_first_cell, run_benchmark

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def test_tpu_xla_remat_quick():
    proc = run_benchmark(
        "tpu_xla_remat.py",
        "--quick",
        "--model=stack",
        "--fractions=0.5",
        "--policies=nothing_saveable",
    )
    rows = rows_by_first_cell(proc.stdout, width=5)
    assert rows["no remat"][3] == "1.000", proc.stdout
    # Half the no-remat peak is below what this tiny step needs however XLA recomputes.
    (limited,) = [name for name in rows if name.startswith("no remat, XLA limit 0.5")]
    assert rows[limited][1].startswith("does not fit: RESOURCE_EXHAUSTED"), proc.stdout
    assert float(rows["`nothing_saveable`"][3]) > 1, proc.stdout  # the recomputed products


def test_tpu_compile_options_quick():
    proc = run_benchmark(
        "tpu_compile_options.py",
        "--quick",
        "--repeats=1",
        "--option_sets=xla_jf_llvm_use_fast_opt=true;exec_time_optimization_effort=-1",
    )
    rows = rows_by_first_cell(proc.stdout, width=7)
    # Columns: options, compile s, time / defaults, same plan, temp MiB, code MiB, FLOPs.
    assert rows["defaults"][2:4] == ["1.00", "yes"], proc.stdout
    # Code generation's own switch leaves the memory plan as it is; XLA's lowest effort does not
    # (it fuses differently), which the comparison must be able to see.
    assert rows["`xla_jf_llvm_use_fast_opt=true`"][3] == "yes", proc.stdout
    assert rows["`exec_time_optimization_effort=-1`"][3] == "**no**", proc.stdout
