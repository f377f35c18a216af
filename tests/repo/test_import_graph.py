"""The package's import graph has no circles.

Every `import` counts, at module level or inside a function or a TYPE_CHECKING block: a
circle that only closes at run time or for the type checker still means two modules that
cannot be read, tested or changed apart. Importing `swarmpipe.a.b` also imports the package
`swarmpipe.a`, so package `__init__` modules take part too, except as the ancestors of the
importer itself: Python runs those before the importer, whatever it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "swarmpipe"
ROOT = Path(__file__).resolve().parents[2]
NOT_PACKAGE = {"tests", "scripts", "docs", "deploy", "build", "dist"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if rel[0] in NOT_PACKAGE or any(part.startswith(".") for part in rel):
            continue
        modules[_module_name(path)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    own_ancestors = {".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 1)}

    def add(target: str, *, named: bool = True) -> None:
        # `swarmpipe.a.b.c` imports swarmpipe.a, swarmpipe.a.b and (if a module) .c;
        # the root package holds only the version, so it is left out.
        parts = target.split(".")
        for end in range(2, len(parts) + 1):
            candidate = ".".join(parts[:end])
            explicit = named and end == len(parts)
            if candidate in modules and (explicit or candidate not in own_ancestors):
                found.add(candidate)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if not module.startswith(PACKAGE + "."):
                continue
            # `from swarmpipe.protos import stage_pb2` imports a submodule; a name that is
            # no submodule comes from the module itself.
            targets = [f"{module}.{alias.name}" for alias in node.names]
            submodules = [t for t in targets if t in modules]
            add(module, named=len(submodules) < len(targets))
            for target in submodules:
                add(target)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules: is ROOT right?"
    found = circles(graph)
    described = [
        " <-> ".join(c)
        + "\n    "
        + "\n    ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in found
    ]
    assert not found, "import circles:\n" + "\n".join(described)


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_only_the_entry_point_imports_the_daemon() -> None:
    graph = import_graph()
    importers = sorted(m for m, targets in graph.items() if "swarmpipe.node.daemon" in targets)
    assert importers == ["swarmpipe.node.main"]
