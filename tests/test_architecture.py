"""The layers stay layers: the import graph, the op table and its three consumers."""

import ast
import os
import subprocess
import sys
import types

import pytest

from megatron.pipeline import executor
from megatron.schedules import simulator, validator
from megatron.schedules.instructions import OP_SPECS, Op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron")
# Lower layers never import higher ones (common < schedules < offload/optimizer/models <
# pipeline < training).
FORBIDDEN = {
    "common": ("schedules", "offload", "optimizer", "models", "pipeline", "training"),
    "schedules": ("offload", "optimizer", "pipeline", "training"),
    "offload": ("optimizer", "models", "pipeline", "training"),  # the three are siblings
    "optimizer": ("offload", "models", "pipeline", "training"),
    "models": ("offload", "optimizer", "pipeline", "training"),
    "pipeline": ("training",),
}


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__"), path


def _project_import(node: ast.AST, module: str) -> list[str]:
    """Names of this project's modules an import statement imports (not megatron.core)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            base = ".".join(parts[: len(parts) - node.level] + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    else:
        return []
    return [n for n in names if n.startswith("megatron.") and not n.startswith("megatron.core")
            and not n.endswith("._cpu_adam")]


def _graph():
    modules = dict(_modules())
    graph, nested = {}, []
    for module, path in modules.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        edges = set()
        for node in tree.body:
            edges.update(n for n in _project_import(node, module) if n in modules)
        graph[module] = edges
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if _project_import(inner, module):
                        nested.append(f"{module}:{inner.lineno}")
    return graph, nested


def test_no_import_cycle_and_no_deferred_project_import():
    graph, nested = _graph()
    assert nested == [], f"function-level imports of project modules: {nested}"
    state: dict[str, int] = {}

    def visit(module, path):
        state[module] = 1
        for dep in graph[module]:
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [dep])}")
            if not state.get(dep):
                visit(dep, path + [dep])
        state[module] = 2

    for module in graph:
        if not state.get(module):
            visit(module, [module])


def test_lower_layers_never_import_higher_ones():
    graph, _ = _graph()
    for module, deps in graph.items():
        layer = module.split(".")[1]
        for dep in deps:
            assert dep.split(".")[1] not in FORBIDDEN.get(layer, ()), f"{module} imports {dep}"


def test_the_schedule_package_runs_without_torch():
    code = ("import sys; import megatron.schedules as s; "
            "s.validate(s.build_schedule('decoupled', 2, 4, 2, 4)); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'torch'], 'torch imported'")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def _is_empty(function: types.FunctionType) -> bool:
    def empty(*args):
        pass

    def documented(*args):
        """doc"""

    return function.__code__.co_code in (empty.__code__.co_code, documented.__code__.co_code)


@pytest.mark.parametrize("consumer", [
    validator._Checker, simulator._Simulator, executor.PipelineExecutor])
def test_every_op_has_a_real_handler_in_each_consumer(consumer):
    """One table, OP_SPECS, names each op's handler; the validator (its rule), the simulator
    (its cost) and the executor (its action) each implement it, none as a no-op."""
    assert set(OP_SPECS) == set(Op)
    assert len({spec.handler for spec in OP_SPECS.values()}) == len(Op)
    for op, spec in OP_SPECS.items():
        handler = getattr(consumer, spec.method, None)
        assert callable(handler), f"{consumer.__name__}: {op.value} -> missing {spec.method}"
        assert not _is_empty(handler), f"{consumer.__name__}: {op.value} -> {spec.method} is empty"


def test_every_op_spec_names_a_simulated_resource():
    resources = {"compute", "h2d", "d2h", "network", "cpu-optimizer", "host", "none"}
    for op, spec in OP_SPECS.items():
        assert spec.resource in resources, op
        assert spec.action, op
