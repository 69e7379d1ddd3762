"""The engine core has no import cycle, counting imports inside functions: a module's imports show where it sits.

The core (a4/core.py and the packages the engine is made of) is read as source, every `import` and `from ... import`
of an a4 module collected wherever it stands (module level, inside a function, under TYPE_CHECKING), and the graph
of those imports must be acyclic. A function-level import that closes a cycle is still a cycle: it only hides it
from Python's import machinery, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

from a4._overlay import REPO_ROOT

# The engine's packages and modules (the course tooling and the benches sit on top of them and are not counted).
CORE = ("core", "llm", "engine", "scheduler", "kvcache", "layers", "models", "speculative", "kernels", "distributed")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_modules(root: Path) -> dict[str, Path]:
    modules = {}
    for path in sorted((root / "a4").rglob("*.py")):
        name = module_name(path, root)
        if name.split(".")[1:2] and name.split(".")[1] in CORE:
            modules[name] = path
    return modules


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The core modules `path` imports, anywhere in it (`from a4.x import y` counts a4.x.y when that is a module)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {target for target in targets if target in modules and target != name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def test_the_engine_core_has_no_import_cycle():
    # The reference solutions are the files that run (A4_SOLUTIONS=1); each is read in place of its student file.
    for with_solutions in (False, True):
        modules = core_modules(REPO_ROOT)
        if with_solutions:
            modules.update(core_modules(REPO_ROOT / "solutions"))
        graph = {name: imported(path, name, modules) for name, path in modules.items()}
        packages = {name for name, path in modules.items() if path.name == "__init__.py"}
        # A package's __init__ imports nothing of its modules here; a module importing its package is no cycle.
        graph = {name: targets - packages for name, targets in graph.items()}
        assert cycles(graph) == [], f"import cycles (solutions read: {with_solutions}): {cycles(graph)}"


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a4" / "engine").mkdir(parents=True)
    (tmp_path / "a4" / "core.py").write_text("def f():\n    from a4.engine.x import g\n")
    (tmp_path / "a4" / "engine" / "x.py").write_text("from a4.core import f\n")
    modules = core_modules(tmp_path)
    graph = {name: imported(path, name, modules) for name, path in modules.items()}
    assert cycles(graph) == [["a4.core", "a4.engine.x"]]
