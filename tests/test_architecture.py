"""The package's layering: topology -> planner -> runtime, data flowing one way, and no module importing itself back."""

import ast
from pathlib import Path

import holmes_lightning

PACKAGE = Path(holmes_lightning.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports (at any depth of its code)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("holmes_lightning", *path.relative_to(PACKAGE).with_suffix("").parts))
        name = name.removesuffix(".__init__")
        modules = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules.add(node.module)
            elif isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
        found[name] = {m for m in modules if m.startswith("holmes_lightning")}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, if the graph has any (depth-first search with an explicit path)."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for target in sorted(graph.get(module, ())):
            cycle = visit(target, [*path, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module, []))), None)


def test_no_module_imports_itself_back() -> None:
    assert _cycle(_imports()) is None


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_topology_and_planner_import_neither_the_runtime_nor_torch() -> None:
    imports = _imports()
    for name, modules in imports.items():
        if name.startswith(("holmes_lightning.topology", "holmes_lightning.planner")):
            lower = {m for m in modules if not m.startswith(("holmes_lightning.topology", "holmes_lightning.planner"))}
            assert not lower, f"{name} imports {sorted(lower)}"
    for path in [*(PACKAGE / "planner").glob("*.py"), *(PACKAGE / "topology").glob("*.py")]:
        assert "import torch" not in path.read_text(), path


# Packages from the ground up: each imports only packages below it (the root package's lazy names stand apart).
LAYERS = ("topology", "planner", "launch", "measure", "runtime", "hf", "recipes", "lab", "cli", "bench")


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a package to one above it (or to a package outside the layers)."""
    found = []
    for module, imported in sorted(graph.items()):
        package = _package(module)
        if package not in LAYERS:
            continue
        below = set(LAYERS[: LAYERS.index(package)]) | {package, "__init__"}
        found += [f"{module} -> {target}" for target in sorted(imported) if _package(target) not in below]
    return found


def test_each_package_imports_only_the_packages_below_it() -> None:
    """topology -> planner -> starting ranks -> measuring -> runtime -> Hugging Face models -> recipes -> the lab -> the
    command-line tools -> the bench: the lab and the bench (tooling) are never imported by the runtime or the
    launcher."""
    assert _upward(_imports()) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        "holmes_lightning.runtime.strategy": {"holmes_lightning.planner", "holmes_lightning.lab.run"},
        "holmes_lightning.launch.processes": {"holmes_lightning.bench.runner", "holmes_lightning.topology"},
        "holmes_lightning.bench.runner": {"holmes_lightning.lab.run", "holmes_lightning.runtime"},
    }
    assert _upward(graph) == [
        "holmes_lightning.launch.processes -> holmes_lightning.bench.runner",
        "holmes_lightning.runtime.strategy -> holmes_lightning.lab.run",
    ]
