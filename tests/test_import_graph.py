"""The package's import graph: no circles, and arrows that point down the layers.

Every import counts, at module level or inside a function (a lazy import is still a
dependency), read from the sources with ``ast``: nothing is imported to build the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rvllm"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` runs last: the name itself, or the
    package or module it is an attribute of."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.split(".")[0] == "rvllm" else None
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(GRAPH[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return circles


def test_the_graph_is_read_from_the_sources() -> None:
    assert "rvllm.engine.llm_engine" in GRAPH
    assert "rvllm.engine.scheduler" in GRAPH["rvllm.engine.llm_engine"]


def test_no_two_modules_import_each_other_even_through_others() -> None:
    assert _circles() == []


def _importers_of(lower: str, higher: tuple[str, ...]) -> list[str]:
    """Imports from modules under ``lower`` of modules under any of ``higher``."""
    return sorted(f"{a} -> {b}" for a, targets in GRAPH.items()
                  if a == lower or a.startswith(lower + ".")
                  for b in targets if any(b == h or b.startswith(h + ".") for h in higher))


ABOVE_KERNELS = ("rvllm.layers", "rvllm.models", "rvllm.engine", "rvllm.executor",
                 "rvllm.server", "rvllm.bench", "rvllm.forward_context", "rvllm.config")


@pytest.mark.parametrize(("lower", "higher"), [
    ("rvllm.kernels", ABOVE_KERNELS),
    ("rvllm.layers", ("rvllm.models", "rvllm.engine", "rvllm.executor", "rvllm.server")),
    ("rvllm.models", ("rvllm.engine", "rvllm.executor", "rvllm.server")),
    ("rvllm.engine", ("rvllm.server",)),
])
def test_lower_layers_never_import_higher_ones(lower: str, higher: tuple[str, ...]) -> None:
    assert _importers_of(lower, higher) == []


def test_the_cpu_and_triton_kernels_do_not_import_each_other() -> None:
    assert _importers_of("rvllm.kernels.cpu", ("rvllm.kernels.triton",)) == []
    assert _importers_of("rvllm.kernels.triton", ("rvllm.kernels.cpu",)) == []


def test_the_engine_reaches_model_code_only_through_the_loader_and_registry() -> None:
    allowed = {"rvllm.models.loader", "rvllm.models.registry", "rvllm.models.default_model"}
    reached = {b for a, targets in GRAPH.items() if a.startswith("rvllm.engine.")
               for b in targets if b.startswith("rvllm.models.")}
    assert reached <= allowed
