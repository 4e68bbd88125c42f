"""The layers stay layers: the import graph, the op table and its three consumers."""

import ast
import functools
import json
import os
import subprocess
import sys
import types

import pytest

from megatron.config.run import ONE_PROCESS_SCHEDULE
from megatron.pipeline import executor
from megatron.schedules import simulator, validator
from megatron.schedules.generators import SCHEDULE_NAMES
from megatron.schedules.instructions import OP_SPECS, Op
from megatron.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron")
# Lower layers never import higher ones: common < config < schedules < planning, and
# offload/optimizer/models < data, pipeline < training (siblings never import each other).
LAYERS = ("common", "config", "schedules", "planning", "offload", "optimizer", "models",
          "data", "pipeline", "training")
FORBIDDEN = {
    "common": LAYERS[1:],
    "config": LAYERS[2:],
    "schedules": LAYERS[3:],
    "planning": ("offload", "optimizer", "models", "data", "pipeline", "training"),
    "offload": ("planning", "optimizer", "models", "data", "pipeline", "training"),
    "optimizer": ("planning", "offload", "models", "data", "pipeline", "training"),
    "models": ("planning", "offload", "optimizer", "data", "pipeline", "training"),
    "data": ("planning", "offload", "optimizer", "pipeline", "training"),
    "pipeline": ("data", "training"),
    # the loop reaches shared memory and its errors through the pipeline's interface
    # (megatron/pipeline/node_memory.py), never the offload layer's internals
    "training": ("offload",),
}
COMMAND_LINE = "megatron.training.arguments"  # the one module that reads argparse


@functools.cache
def _modules() -> tuple[tuple[str, ast.Module], ...]:
    """(dotted name, syntax tree) of every module of the package: parsed once per session,
    as every test here reads the same source."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                with open(path, encoding="utf-8") as f:
                    found.append((rel.removesuffix(".__init__"), ast.parse(f.read())))
    return tuple(found)


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


def _imports_in_functions(tree: ast.Module, module: str) -> list[str]:
    """module:line of each project import inside a function (at any depth), once each."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if in_function and _project_import(node, module):
            found.append(f"{module}:{node.lineno}")
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


@functools.cache
def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = dict(_modules())
    graph, nested = {}, []
    for module, tree in modules.items():
        edges = set()
        for node in tree.body:
            edges.update(n for n in _project_import(node, module) if n in modules)
        graph[module] = edges
        nested += _imports_in_functions(tree, module)
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


def test_every_module_sits_in_a_known_layer():
    graph, _ = _graph()
    assert {module.split(".")[1] for module in graph} == set(LAYERS)


def test_nothing_below_the_command_line_receives_a_namespace():
    """Only the command-line module imports argparse; no function elsewhere takes an
    `args` parameter or one annotated as a Namespace: they read the RunConfig."""
    found = []
    for module, tree in _modules():
        if module == COMMAND_LINE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                found.append(f"{module}:{node.lineno} imports argparse")
            if isinstance(node, ast.ImportFrom) and node.module == "argparse":
                found.append(f"{module}:{node.lineno} imports from argparse")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    note = ast.unparse(arg.annotation) if arg.annotation else ""
                    if arg.arg == "args" or "Namespace" in note:
                        found.append(f"{module}:{node.lineno} {node.name}({arg.arg}: {note})")
    assert found == []


def test_schedules_are_known_by_their_traits_not_their_names():
    """Only the registry (generators.py) and the one-process constant spell a schedule's
    name: everything else asks the registry entry, so adding a schedule is one entry."""
    names = set(SCHEDULE_NAMES) | {ONE_PROCESS_SCHEDULE}
    allowed = {"megatron.schedules.generators": set(SCHEDULE_NAMES),
               "megatron.config.run": {ONE_PROCESS_SCHEDULE}}
    spelled = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in names
                    and node.value not in allowed.get(module, ())):
                spelled.append(f"{module}:{node.lineno} {node.value!r}")
    assert spelled == []


def _runs_without_torch(code: str, stdin: str = "") -> str:
    check = f"{code}\nimport sys\nassert 'torch' not in sys.modules, 'torch imported'"
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                         text=True, input=stdin)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_schedule_package_runs_without_torch():
    _runs_without_torch("import megatron.schedules as s\n"
                        "s.validate(s.build_schedule('decoupled', 2, 4, 2, 4))")


def test_planning_runs_from_the_configuration_without_torch():
    """--plan --auto-config (search, evaluation, report) from a RunConfig alone."""
    flags = parse_args(["--plan", "--auto-config", "--json", "--model-preset", "10b",
                        "--num-layers", "12", "--bf16", "--gpus-per-node", "4",
                        "--global-batch-size", "16"]).flags()
    out = _runs_without_torch("import json, sys\n"
                              "from megatron.config.run import RunConfig\n"
                              "from megatron.planning.report import run_plan\n"
                              "run_plan(RunConfig.from_flags(json.load(sys.stdin)))",
                              stdin=json.dumps(flags))
    printed = json.loads(out)
    assert printed["fits"] and len(printed["candidates"]) == 5


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
    parts = (consumer, *getattr(consumer, "handler_parts", ()))  # a consumer's helpers
    for op, spec in OP_SPECS.items():
        handler = next((getattr(part, spec.method) for part in parts
                        if hasattr(part, spec.method)), None)
        assert callable(handler), f"{consumer.__name__}: {op.value} -> missing {spec.method}"
        assert not _is_empty(handler), f"{consumer.__name__}: {op.value} -> {spec.method} is empty"


def test_every_op_spec_names_a_simulated_resource():
    resources = {"compute", "h2d", "d2h", "network", "cpu-optimizer", "disk", "host", "none"}
    from megatron.schedules.grid import cell
    from megatron.schedules.instructions import Instruction
    for op, spec in OP_SPECS.items():
        assert spec.resource in resources, op
        assert spec.action, op
        assert cell(Instruction(op)), op  # a code in the error grid
