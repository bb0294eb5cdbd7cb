"""Smoke tests of the remat benchmarks (`remat_policies.py`, on XLA:CPU and planned for a TPU,
`remat_user_models.py`, `profile_step.py`, `peak_buffers.py`) and of their peers
(`jax_vit_memory.py`, `parity_timm.py`)."""

import importlib.util
import re

import pytest

from tests.benchmarks.tables import rows_by_first_cell, run_benchmark, table_rows

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def test_remat_policies_quick(tmp_path):
    out = tmp_path / "remat_policies.md"
    run_benchmark(
        "remat_policies.py",
        "--quick",
        "--models=stack",
        "--settings=none,budget:0.2",
        f"--out={out}",
        f"--plot={tmp_path / 'remat_policies.png'}",
    )
    assert (tmp_path / "remat_policies.png").read_bytes().startswith(b"\x89PNG")
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/remat_policies.py --quick")
    assert "Machine: " in report and "TensorFlow 2." in report
    rows = table_rows(report, "stack")
    assert set(rows) == {"no remat", "`budget:0.2`"}, report
    # Columns: model, setting, peak MiB, memory ratio, XLA temp, XLA total, step s, time ratio,
    # gradient error.
    base, full = rows["no remat"], rows["`budget:0.2`"]
    assert base[3] == "1.00" and base[7] == "1.00" and base[8] == "reference", base
    assert 0 < float(full[3]) < 1, full
    assert float(full[7]) > 0, full
    assert float(full[8]) < 1e-5, full


def test_remat_policies_compiled_for_a_tpu_quick(tmp_path):
    out = tmp_path / "remat_policies_tpu.md"
    run_benchmark(
        "remat_policies.py",
        "--quick",
        "--models=stack,decoder_lm",
        "--settings=none,nothing_saveable",
        "--target=v5e",
        "--compile_only",
        f"--out={out}",
    )
    report = out.read_text()
    assert "| XLA:CPU temp MiB | ratio | TPU v5e (libtpu 0.0.42" in report, report
    for model in ("stack", "decoder_lm"):
        rows = table_rows(report, model)
        assert set(rows) == {"no remat", "`nothing_saveable`"}, report
        # Columns: model, setting, XLA:CPU temp MiB, ratio, TPU temp MiB, ratio (a tiny step's
        # scratch fits on chip: 0 MiB in HBM, no ratio), matmul FLOPs / no remat.
        base, full = rows["no remat"], rows["`nothing_saveable`"]
        assert base[3] == "1.00" and float(full[3]) < 1, report
        assert float(base[4]) >= 0 and float(full[4]) >= 0, report
        assert base[6] == "1.000" and float(full[6]) > 1, report  # the recomputed products
    assert "step s" not in report  # nothing ran


def test_peak_buffers_names_what_the_plan_holds():
    proc = run_benchmark(
        "peak_buffers.py", "--gin_file=quickstart.gin", "--policy=nothing_saveable", "--top=3"
    )
    kinds = rows_by_first_cell(proc.stdout, width=2)
    # The weights at the peak are the model's parameters in float32; the optimizer's state is
    # listed beside the program; the temporaries are grouped by the op they come from.
    assert float(kinds["weights"][1]) > 0 and float(kinds["gradients"][1]) > 0, proc.stdout
    assert "optimizer state (outside the program)" in kinds, proc.stdout
    assert len(rows_by_first_cell(proc.stdout, width=3)) >= 2, proc.stdout  # header + groups


@pytest.mark.parametrize("layout", [[], ["--scan"]])
def test_jax_vit_memory_quick(layout):
    """JAX's own checkpointing on the same ViT, planned by jax's XLA:CPU (the TPU compile is the
    full run's): a step holds more than its temporaries, and full remat recomputes products."""
    proc = run_benchmark(
        "jax_vit_memory.py",
        "--quick",
        "--target=",
        "--policies=nothing_saveable",
        "--steps=1",
        *layout,
    )
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 6:
            rows[cells[0]] = cells
    base, full = rows["no remat"], rows["`nothing_saveable`"]
    assert float(base[1]) > float(base[2]) > 0, proc.stdout
    assert base[3] == "1.00" and float(full[3]) > 1.1, proc.stdout
    # The timed SGD step: seconds, and the ratio to no remat's.
    assert float(full[4]) > 0 and base[5] == "1.00" and float(full[5]) > 0, proc.stdout


def test_profile_step_quick():
    proc = run_benchmark(
        "profile_step.py",
        "--quick",
        "--model=stack",
        "--settings=none,nothing_saveable",
        "--steps=1",
    )
    assert "| operation kind | no remat ms | `nothing_saveable` ms |" in proc.stdout, proc.stdout
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            rows[cells[0]] = [float(c) for c in cells[1:] if re.fullmatch(r"[\d.]+", c)]
    kinds = [name for name in rows if name.startswith("`")]
    assert kinds and all(len(rows[k]) == 2 for k in kinds), proc.stdout
    # Innermost operations only: the executable's `call` wrappers are never counted.
    assert "`call`" not in kinds, proc.stdout
    assert all(t > 0 for t in rows["all operations (summed over threads)"]), proc.stdout
    assert all(t > 0 for t in rows["step wall time, profiled"]), proc.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("timm") is None, reason="PyTorch and timm are not installed"
)
def test_parity_timm_quick():
    report = run_benchmark("parity_timm.py", "--quick").stdout
    rows = [line for line in report.splitlines() if line.startswith("| ") and "case" not in line]
    assert len(rows) == 3 and all(row.endswith("| yes |") for row in rows), report


def test_remat_user_models_quick(tmp_path):
    out = tmp_path / "remat_user_models.md"
    run_benchmark("remat_user_models.py", "--quick", "--models=mixtral,mobilenetv3", f"--out={out}")
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/remat_user_models.py --quick")
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if "| " in line}
    assert "Segment" not in rows["mixtral"] and "Segments" in rows["mobilenetv3"], report
    for name in ("mixtral", "mobilenetv3"):  # Mixtral's blocks add losses: regions' results
        error = float(rows[name].strip("|").split("|")[-1])
        assert error < 1e-4, report
