"""The layers docs/architecture.md draws, checked on every import the package makes.

Each module belongs to one part (its folder, or its own name at the top of the package); a part
may import its own layer and the layers below, never above. Imports inside functions count too:
a lazy import is still a dependency. gin stays out of the library and the core, so a Keras user
takes `framework.remat` alone; actions see the loop, never the trainer.
"""

import ast
import collections
import pathlib

import pytest

from tests.subprocesses import REPO_DIR

PACKAGE = REPO_DIR / "framework"

# Lowest first. cli (flags and gin files) and configurables (gin's names for the library) are the
# gin edge the trainer and the planner stand on; the binaries are the package's top-level modules.
LAYERS = (
    ("core",),
    ("remat", "memory", "models", "data", "shard"),
    ("runtime",),
    ("rundir",),
    ("trainer", "cli", "configurables"),
    ("planner",),
    ("train", "sample", "export", "plan", "trained_model", "planner.__main__"),
)
LAYER = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
WITHOUT_GIN = ("core", "remat", "memory", "models", "data", "shard")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(path): path
    for path in sorted(PACKAGE.rglob("*.py"))
    if "configs" not in path.relative_to(PACKAGE).parts
}


def _part(module: str) -> str:
    """The part of the architecture `module` belongs to ("framework" for the package itself)."""
    if module == "framework.planner.__main__":
        return "planner.__main__"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "framework"


def _resolve(name: str) -> str | None:
    """The framework module an imported name lives in (`framework.remat.policy` -> the module
    `framework.remat` when `policy` is a name in it), or None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """What `module` imports: framework modules by name, and "gin" for gin."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + [base]).strip(".")
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "gin" or name.startswith("gin."):
                found.add("gin")
            elif name.startswith("framework") and (target := _resolve(name)) != module:
                found.add(target)
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_only_its_layer_and_those_below(module):
    part, imports = _part(module), _imports(module)
    if part == "framework":  # the package's __init__: importing `framework` loads no part
        assert not imports, imports
        return
    assert part in LAYER, f"{module}: its part {part!r} is not in docs/architecture.md's layers"
    above = sorted(
        target
        for target in imports - {"gin"}
        if _part(target) != "framework" and LAYER[_part(target)] > LAYER[part]
    )
    assert not above, f"{module} imports a layer above its own: {above}"
    if part in WITHOUT_GIN:
        assert "gin" not in imports, f"{module} is library code and imports gin"


def test_actions_and_settings_do_not_import_the_trainer():
    for module in ("framework.trainer.actions", "framework.trainer.settings"):
        assert "framework.trainer.trainer" not in _imports(module), module


def test_no_import_cycle_between_modules():
    """Among all imports, those inside functions and under `TYPE_CHECKING` included: a cycle at
    load time breaks `import` itself, and any cycle makes two modules that cannot be read or
    changed apart."""
    edges = {module: _imports(module) - {"gin"} for module in MODULES}
    state: dict[str, str] = collections.defaultdict(str)  # "" unseen, "open", "done"

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            assert state[target] != "open", "import cycle: " + " -> ".join(path + [target])
            if not state[target]:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(MODULES):
        if not state[module]:
            visit(module, [module])
