"""The engine has no import cycle, counting imports inside functions: a module's imports show where it sits.

The core (a4/core.py, a4/model_config.py and the packages the engine and its server are made of) is read as source,
every `import` and `from ... import` of an a4 module collected wherever it stands (module level, inside a function,
under TYPE_CHECKING), and the graph of those imports must be acyclic, between modules and between packages. A
function-level import that closes a cycle is still a cycle: it only hides it from Python's import machinery, not from
a reader.

The packages, each importing only from those below it (README, "Where things live"):

    server, llm       the HTTP server and the offline API, over the engine
    engine            the step loop: scheduler -> model runner -> model -> sampler, the speculative and
                      tensor-parallel workers (speculative_worker.py, tp_driver.py, tp_worker.py), the factories
                      that choose what is built, which hand notebook 11's verify functions to the layers and pools
    scheduler         which requests run, their pages and slots
    distributed       tensor parallelism's pieces: process groups, parallel layers, sharding, the ranks' messages
    speculative       the drafters and notebook 11's verify functions
    models            one file per model, config.json parsers, weight loading, the registry
    layers, kvcache   the layers (and their GPU forwards, layers/fused.py); the KV pool, state pool, prefix caches
    kernels           Triton kernels, which import no layer
    core, model_config  the engine's vocabulary and the model's shapes: they import nothing of a4 above them
"""

from __future__ import annotations

import ast
from pathlib import Path

from a4._overlay import REPO_ROOT

# The engine's packages and modules (the course tooling and the benches sit on top of them and are not counted).
CORE = ("core", "model_config", "llm", "server", "engine", "scheduler", "kvcache", "layers", "models", "speculative",
        "kernels", "distributed")  # fmt: skip


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


def package_of(module: str) -> str:
    """a4.engine.model_runner -> engine; a top-level module (a4.core) is a node of its own."""
    return module.split(".")[1]


def package_graph(module_graph: dict[str, set[str]]) -> dict[str, set[str]]:
    graph = {package_of(name): set() for name in module_graph}
    for name, targets in module_graph.items():
        graph[package_of(name)] |= {package_of(target) for target in targets} - {package_of(name)}
    return graph


def module_graphs() -> dict[bool, dict[str, set[str]]]:
    """The core's module graph, as the student files stand and as the reference solutions do (A4_SOLUTIONS=1: each is
    read in place of its student file)."""
    graphs = {}
    for with_solutions in (False, True):
        modules = core_modules(REPO_ROOT)
        if with_solutions:
            modules.update(core_modules(REPO_ROOT / "solutions"))
        graph = {name: imported(path, name, modules) for name, path in modules.items()}
        packages = {name for name, path in modules.items() if path.name == "__init__.py"}
        # A package's __init__ imports nothing of its modules here; a module importing its package is no cycle.
        graphs[with_solutions] = {name: targets - packages for name, targets in graph.items()}
    return graphs


def test_the_engine_core_has_no_import_cycle():
    for with_solutions, graph in module_graphs().items():
        assert cycles(graph) == [], f"import cycles (solutions read: {with_solutions}): {cycles(graph)}"


def test_the_engine_packages_have_no_import_cycle():
    # Packages as nodes: kernels -> layers and layers -> kernels is a cycle even where no two modules close one.
    for with_solutions, graph in module_graphs().items():
        found = cycles(package_graph(graph))
        edges = {
            (package_of(name), package_of(target)): f"{name} -> {target}"
            for name, targets in graph.items()
            for target in targets
            if any({package_of(name), package_of(target)} <= set(component) for component in found)
            and package_of(name) != package_of(target)
        }
        assert found == [], f"package cycles (solutions read: {with_solutions}): {found}, e.g. {sorted(edges.values())}"


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a4" / "engine").mkdir(parents=True)
    (tmp_path / "a4" / "core.py").write_text("def f():\n    from a4.engine.x import g\n")
    (tmp_path / "a4" / "engine" / "x.py").write_text("from a4.core import f\n")
    modules = core_modules(tmp_path)
    graph = {name: imported(path, name, modules) for name, path in modules.items()}
    assert cycles(graph) == [["a4.core", "a4.engine.x"]]


def test_the_package_graph_finds_a_cycle_no_two_modules_close(tmp_path):
    (tmp_path / "a4" / "kernels").mkdir(parents=True)
    (tmp_path / "a4" / "layers").mkdir()
    (tmp_path / "a4" / "kernels" / "patch.py").write_text("def use(model):\n    from a4.layers.mlp import MLP\n")
    (tmp_path / "a4" / "kernels" / "kernel.py").write_text("")
    (tmp_path / "a4" / "layers" / "mlp.py").write_text("from a4.kernels.kernel import f\n")
    modules = core_modules(tmp_path)
    graph = {name: imported(path, name, modules) for name, path in modules.items()}
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == [["kernels", "layers"]]
