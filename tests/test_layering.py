"""The package's dependency rules, read statically from every `import` in tandem/ (inside
functions too, since a lazy import is still a dependency).

Why a test: the serving runtime has to stay small, torch-free where it says so and free of the
tools around it (benches, the planner, training), and layering only survives if a change that
breaks it fails. The rules are the ones docs/architecture.md states:

- no import cycle between modules, and none between packages (a top-level package or a module
  at the package root is one node);
- the runtime never imports a tool, the launcher or the command line;
- the router, the HTTP edge and the trust boundary never import the torch side;
- the modules that must run where torch is not installed (the router's process, the memory
  model, the flag tables, the scheduler and block pool) import no torch themselves.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tandem"

# Tools and entry points: they may import the runtime, never the other way round.
TOOLS = {"bench", "plan", "train"}
ENTRY = {"cli", "__main__", "launch"}
# Packages that import torch (or need it to be imported at all).
TORCH_SIDE = {"engine", "executor", "worker", "models", "layers", "kernels", "distributed", "spec",
              "loader", "llm"}
TORCH_FREE = {"router", "edge", "trust"}
# Import no torch at all, directly: packages and single modules.
NO_TORCH = ("router", "edge", "trust", "tokenization", "sizing", "flags", "launch", "config", "config_checks", "types",
            "batch.scheduler_output", "engine.scheduler", "engine.block_pool", "engine.kv_cache_manager",
            "structured")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def module_graph() -> dict[str, set[str]]:
    """Module -> the tandem modules it imports (a `from pkg import name` counts pkg.name)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    anchor = base
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    target = f"{anchor}.{target}" if target else anchor
                names = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            for name in names:
                if name.startswith("tandem."):
                    resolved = _resolve(name, modules)
                    if resolved and resolved != module:
                        graph[module].add(resolved)
    return graph


def node_of(module: str) -> str:
    """The package-level node: `tandem.engine.scheduler` -> `engine`, `tandem.llm` -> `llm`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tandem"


def package_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Node -> imported node -> the module edges behind it (for the failure message)."""
    packages: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, targets in graph.items():
        for target in targets:
            if node_of(module) != node_of(target) and "tandem" not in (node_of(module), node_of(target)):
                packages[node_of(module)][node_of(target)].append(f"{module} -> {target}")
    return packages


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return module_graph()


def test_no_module_import_cycles(graph: dict[str, set[str]]) -> None:
    # A package's __init__ re-exporting its children makes a loop with them that is not a real
    # dependency between jobs: those are left out.
    real = [c for c in cycles(graph)
            if not all(m == min(c, key=len) or m.startswith(min(c, key=len) + ".") for m in c)]
    assert not real, f"module import cycles: {real}"


def test_no_package_import_cycles(graph: dict[str, set[str]]) -> None:
    packages = package_graph(graph)
    found = cycles({node: set(targets) for node, targets in packages.items()})
    detail = {f"{a} -> {b}": packages[a][b][:3]
              for component in found for a in component for b in component if b in packages[a]}
    assert not found, f"package import cycles: {found}; edges: {detail}"


def test_runtime_never_imports_tools_or_entry_points(graph: dict[str, set[str]]) -> None:
    packages = package_graph(graph)
    wrong = {f"{a} -> {b}": edges[:3] for a, targets in packages.items() for b, edges in targets.items()
             if a not in TOOLS | ENTRY and b in TOOLS | ENTRY}
    assert not wrong, f"the runtime imports a tool or an entry point: {wrong}"


def test_router_edge_and_trust_stay_off_the_torch_side(graph: dict[str, set[str]]) -> None:
    packages = package_graph(graph)
    wrong = {f"{a} -> {b}": edges[:3] for a, targets in packages.items() for b, edges in targets.items()
             if a in TORCH_FREE and b in TORCH_SIDE}
    assert not wrong, f"a torch-free package imports the torch side: {wrong}"


def imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            return True
    return False


@pytest.mark.parametrize("name", NO_TORCH)
def test_torch_free_modules_import_no_torch(name: str) -> None:
    target = PACKAGE.joinpath(*name.split("."))
    paths = sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    assert paths and all(p.exists() for p in paths), f"{name} not found"
    assert [str(p.relative_to(PACKAGE.parent)) for p in paths if imports_torch(p)] == []


def test_the_rules_see_a_break() -> None:
    """The checker itself: a planted cycle and a planted tool import are found."""
    planted = {"tandem.engine.a": {"tandem.worker.b"}, "tandem.worker.b": {"tandem.engine.c"},
               "tandem.engine.c": set(), "tandem.router.x": {"tandem.bench.y"}, "tandem.bench.y": set()}
    packages = package_graph(planted)
    assert cycles({n: set(t) for n, t in packages.items()}) == [["engine", "worker"]]
    assert "bench" in packages["router"]
