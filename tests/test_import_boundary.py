"""Dependency direction between the package's layers, read from the source (no imports run).

- `speculation/` never imports `engine/`: the engine drives proposers through the
  `Proposer` protocol and owns request state.
- `server/` reaches the engine only through its interface: the `specserve.engine` package's
  exports and `specserve.engine.interface`, never the core, scheduler or block manager.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specserve"
ENGINE_INTERFACE = {"specserve.engine", "specserve.engine.interface"}


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved; for `from X
    import name` both X and X.name, since name may be a submodule)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module[:-9]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def engine_imports(path: Path) -> set[str]:
    return {m for m in imported_modules(path)
            if m == "specserve.engine" or m.startswith("specserve.engine.")}


def test_imported_modules_resolves_relative_imports():
    spec_file = PACKAGE / "speculation" / "proposers.py"
    names = imported_modules(spec_file)
    assert "specserve.model.runner" in names and "specserve.speculation.tree" in names
    assert engine_imports(PACKAGE / "engine" / "core.py") >= {"specserve.engine.scheduler"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "speculation").glob("*.py")),
                         ids=lambda p: p.name)
def test_spec_never_imports_engine(path):
    assert not engine_imports(path), f"{path.name} imports {sorted(engine_imports(path))}"


def engine_exports() -> set[str]:
    """`specserve.engine.__all__`, read from the source."""
    tree = ast.parse((PACKAGE / "engine" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def is_engine_interface(module: str) -> bool:
    if module in ENGINE_INTERFACE or module.startswith("specserve.engine.interface."):
        return True
    parent, _, name = module.rpartition(".")
    return parent == "specserve.engine" and name in engine_exports()


def test_engine_interface_check_tells_exports_from_internals():
    assert is_engine_interface("specserve.engine.AsyncEngine")
    assert is_engine_interface("specserve.engine.interface.ModelInfo")
    assert not is_engine_interface("specserve.engine.core")
    assert not is_engine_interface("specserve.engine.block_manager.BlockManager")


@pytest.mark.parametrize("path", sorted((PACKAGE / "server").glob("*.py")), ids=lambda p: p.name)
def test_server_uses_only_the_engine_interface(path):
    internals = {m for m in engine_imports(path) if not is_engine_interface(m)}
    assert not internals, f"{path.name} imports engine internals {sorted(internals)}"


def package_import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (any depth of the tree)."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p
               for p in package.rglob("*.py")}
    return {name: {m for m in imported_modules(path) if m in modules and m != name}
            for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (each reported once, from where it closed)."""
    cycles, state = [], {}
    def walk(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, stack + [nxt])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return cycles


def test_import_cycles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles():
    # Package __init__ modules re-export their children; a child importing its own package's
    # __init__ is not a cycle of the code, so __init__ edges are left out.
    graph = {m: {d for d in deps if not (PACKAGE / "/".join(d.split(".")[1:]) / "__init__.py")
                 .is_file()}
             for m, deps in package_import_graph(PACKAGE).items() if not m.endswith("__init__")}
    assert import_cycles(graph) == []
