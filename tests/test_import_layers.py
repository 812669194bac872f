"""The import layers, checked statically: the serving runtime never imports the tools.

The runtime (engine, worker, server, router, KV cache, models, layers, kernels, loader,
distributed, speculative decoding) must run from a deployment that never needs the planner or
the benches, and a tool's change must not reach a server. The planner sizes with
`tandem.sizing`, as the runtime does; the benches import the planner, never the reverse, so
there is no cycle between them. Every `import` statement counts, at the top or in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tandem"
RUNTIME = ("engine", "worker", "server", "router", "kvcache", "models", "layers", "kernels", "loader",
           "distributed", "spec")
TOOLS = ("tandem.plan", "tandem.bench")


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in `path` names (relative ones resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
    return names


def offenders(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for name in packages:
        for path in sorted((PACKAGE / name).rglob("*.py")):
            bad = sorted(m for m in imported_modules(path)
                         if any(m == f or m.startswith(f + ".") for f in forbidden))
            found += [f"{path.relative_to(PACKAGE.parent)} imports {m}" for m in bad]
    return found


@pytest.mark.parametrize("package", RUNTIME)
def test_the_runtime_imports_no_tool(package: str) -> None:
    assert offenders((package,), TOOLS) == []


def test_the_planner_does_not_import_the_benches() -> None:
    assert offenders(("plan",), ("tandem.bench",)) == []


def test_sizing_imports_neither_tools_nor_torch() -> None:
    assert offenders(("sizing",), (*TOOLS, "torch")) == []

