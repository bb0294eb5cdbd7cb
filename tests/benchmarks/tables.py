"""How the smoke tests of `benchmarks/` run a benchmark and read its tables.

Each benchmark runs in `--quick` mode: the full runs take many minutes and their numbers depend
on the machine; the tests check only the plumbing (subprocess per setting, measuring, ratios,
gradient check), on tiny models.
"""

import subprocess
import sys

from tests.subprocesses import REPO_DIR, child_env


def run_benchmark(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `benchmarks/SCRIPT ARGS` in a fresh interpreter; fails the test if it fails."""
    proc = subprocess.run(
        [sys.executable, str(REPO_DIR / "benchmarks" / script), *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def table_rows(text: str, model: str) -> dict[str, list[str]]:
    """Table rows of `model`, keyed by setting, as lists of cells."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 2 and cells[0] == model:
            rows[cells[1]] = cells
    return rows


def table_cells(text: str, width: int) -> list[list[str]]:
    """Rows of the markdown table with `width` columns, in order, as lists of cells."""
    lines = text.splitlines()
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    return [cells for cells in rows if len(cells) == width]


def rows_by_first_cell(text: str, width: int) -> dict[str, list[str]]:
    """Rows of the markdown table with `width` columns, keyed by their first cell."""
    return {cells[0]: cells for cells in table_cells(text, width)}
