"""No benchmark imports another: what they share lives in the benchmarks' helper modules."""

import ast

from tests.subprocesses import REPO_DIR

BENCHMARKS = REPO_DIR / "benchmarks"
HELPERS = {"reporting", "step_models", "synthetic_text"}


def test_benchmarks_import_only_the_shared_helpers():
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")} - HELPERS
    assert {"remat_policies", "gpu_plans", "vocab_sample"} <= scripts
    found = {}
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] in scripts:
                    found.setdefault(path.name, []).append(name)
    assert not found, found
