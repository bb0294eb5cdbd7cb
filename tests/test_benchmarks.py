"""Smoke tests of `benchmarks/`: each benchmark runs in `--quick` mode and prints its table.

The full runs take many minutes and their numbers depend on the machine; here only the plumbing is
checked (subprocess per setting, measuring, ratios, gradient check), on tiny models.
"""

import re
import subprocess
import sys

from tests.subprocesses import REPO_DIR, child_env


def _table_rows(text: str, model: str) -> dict[str, list[str]]:
    """Table rows of `model`, keyed by setting, as lists of cells."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 2 and cells[0] == model:
            rows[cells[1]] = cells
    return rows


def test_remat_policies_quick(tmp_path):
    out = tmp_path / "remat_policies.md"
    command = [
        sys.executable,
        str(REPO_DIR / "benchmarks" / "remat_policies.py"),
        "--quick",
        "--models=stack",
        "--settings=none,nothing_saveable",
        f"--out={out}",
    ]
    proc = subprocess.run(
        command, env=child_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/remat_policies.py --quick")
    assert "Machine: " in report and "TensorFlow 2." in report
    rows = _table_rows(report, "stack")
    assert set(rows) == {"no remat", "`nothing_saveable`"}, report
    # Columns: model, setting, peak MiB, memory ratio, XLA temp, XLA total, step s, time ratio,
    # gradient error.
    base, full = rows["no remat"], rows["`nothing_saveable`"]
    assert base[3] == "1.00" and base[7] == "1.00" and base[8] == "reference", base
    assert 0 < float(full[3]) < 1, full
    assert float(full[7]) > 0, full
    assert float(full[8]) < 1e-5, full


def test_profile_step_quick():
    command = [
        sys.executable,
        str(REPO_DIR / "benchmarks" / "profile_step.py"),
        "--quick",
        "--model=stack",
        "--settings=none,nothing_saveable",
        "--steps=1",
    ]
    proc = subprocess.run(
        command, env=child_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
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


def test_scan_layers_quick(tmp_path):
    out = tmp_path / "scan_layers.md"
    command = [sys.executable, str(REPO_DIR / "benchmarks" / "scan_layers.py"), "--quick"]
    proc = subprocess.run(
        command + [f"--out={out}", "--steps=1"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/scan_layers.py --quick")
    rows = [
        line for line in report.splitlines() if line.startswith("| 2 ") or line.startswith("| 4 ")
    ]
    assert len(rows) == 2, report
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        # depth, policy, compile s (2), XLA temp (2), peak (2), step s, ratio: all measured.
        assert all(float(c) >= 0 for c in cells[2:]), row
