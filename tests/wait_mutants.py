"""The runtime's stream waits, found in the source, and how to remove one in a process.

`find_waits()` parses every module under megatron/ except the device layer itself and
lists each call of `.wait_event(...)` or `.wait_stream(...)` (a stream waits) and each
`.wait()` on what the module declares a device-layer `Event` (a host thread waits: an
argument, field or variable annotated `Event`, imported from megatron.offload.device, or
an attribute assigned from such an argument): a wait added to the runtime is a new mutant
without a change here. `drop_wait(site)` recompiles the site's module with
that call replaced by `None` and gives the enclosing top-level function (or method) the new
code, so every caller, wherever it imported the function from, runs the mutant.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
from dataclasses import asdict, dataclass
from types import CodeType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAITS = ("wait_event", "wait_stream")  # a stream waits
HOST_WAIT = "wait"  # on an Event: a host thread waits
# The device layer implements the waits; what is scanned is the code that calls them.
DEVICE_LAYER = ("megatron/offload/device.py", "megatron/offload/sanitizer.py")
DROP_ENV = "MEGATRON_TEST_DROP_WAIT"


@dataclass(frozen=True)
class WaitSite:
    path: str  # relative to the repository root
    line: int
    col: int
    qualname: str  # of the enclosing function, as Python names it
    source: str  # the line, stripped

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"

    def spec(self) -> str:
        """The site whole, as DROP_ENV takes it: `parse` reads it back without a scan of
        the package (about a second of CPU, as much as a mutant run's training)."""
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str) -> WaitSite:
        """`spec()`'s JSON, or path:line:col (by hand: the site is looked up in find_waits)."""
        if text.startswith("{"):
            return cls(**json.loads(text))
        path, line, col = text.rsplit(":", 2)
        return next(s for s in find_waits() if (s.path, s.line, s.col) == (path, int(line), int(col)))


def _is_event(annotation: ast.expr | None) -> bool:
    return annotation is not None and any(
        isinstance(node, ast.Name) and node.id == "Event" for node in ast.walk(annotation))


def _event_names(tree: ast.Module) -> set[str]:
    """Names and attributes the module declares to hold a device-layer Event."""
    imports_event = any(
        isinstance(node, ast.ImportFrom) and node.module == "megatron.offload.device"
        and any(alias.name == "Event" for alias in node.names) for node in ast.walk(tree))
    if not imports_event:
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and _is_event(node.annotation):
            target = node.target
            names.add(target.attr if isinstance(target, ast.Attribute) else target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            params = {a.arg for a in args if _is_event(a.annotation)}
            names |= params
            for sub in ast.walk(node):  # self.x = param
                if (isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Name)
                        and sub.value.id in params):
                    names |= {t.attr for t in sub.targets if isinstance(t, ast.Attribute)}
    return names


def _receiver(call: ast.Call) -> str | None:
    owner = call.func.value  # type: ignore[attr-defined]
    if isinstance(owner, ast.Attribute):
        return owner.attr
    return owner.id if isinstance(owner, ast.Name) else None


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, lines: list[str], events: set[str]) -> None:
        self.path, self.lines, self.events = path, lines, events
        self.scope: list[str] = []
        self.sites: list[WaitSite] = []

    def _scoped(self, node: ast.AST, name: str, function: bool) -> None:
        self.scope.append(name)
        if function:
            self.scope.append("<locals>")
        self.generic_visit(node)
        del self.scope[-2 if function else -1:]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name, False)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and (
                node.func.attr in WAITS
                or (node.func.attr == HOST_WAIT and _receiver(node) in self.events)):
            qualname = ".".join(self.scope[:-1]) if self.scope else "<module>"
            self.sites.append(WaitSite(self.path, node.lineno, node.col_offset, qualname,
                                       self.lines[node.lineno - 1].strip()))
        self.generic_visit(node)


def find_waits(root: str = ROOT) -> list[WaitSite]:
    sites = []
    for folder, _, files in sorted(os.walk(os.path.join(root, "megatron"))):
        for name in sorted(files):
            path = os.path.relpath(os.path.join(folder, name), root)
            if not name.endswith(".py") or path in DEVICE_LAYER:
                continue
            with open(os.path.join(root, path)) as f:
                text = f.read()
            tree = ast.parse(text)
            finder = _Finder(path, text.splitlines(), _event_names(tree))
            finder.visit(tree)
            sites += finder.sites
    return sites


class _Drop(ast.NodeTransformer):
    def __init__(self, site: WaitSite) -> None:
        self.site = site

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if (node.lineno, node.col_offset) == (self.site.line, self.site.col):
            return ast.copy_location(ast.Constant(None), node)
        return self.generic_visit(node)


def _code_named(code: CodeType, qualname: str) -> CodeType | None:
    if code.co_qualname == qualname:
        return code
    for const in code.co_consts:
        if isinstance(const, CodeType) and (found := _code_named(const, qualname)):
            return found
    return None


def drop_wait(site: WaitSite) -> None:
    """Make this process run `site`'s function without that wait."""
    with open(os.path.join(ROOT, site.path)) as f:
        tree = _Drop(site).visit(ast.parse(f.read()))
    code = compile(ast.fix_missing_locations(tree), os.path.join(ROOT, site.path), "exec")
    # A wait inside a nested function: the outer function's code holds the nested one's.
    outer = site.qualname.split(".<locals>.")[0]
    new_code = _code_named(code, outer)
    if new_code is None:
        raise LookupError(f"no function {outer} in the recompiled {site.path}")
    module = importlib.import_module(site.path[:-3].replace(os.sep, "."))
    target = module
    for part in outer.split("."):
        target = getattr(target, part)
    target.__code__ = new_code


def drop_wait_from_environment() -> WaitSite | None:
    spec = os.environ.get(DROP_ENV)
    if not spec:
        return None
    site = WaitSite.parse(spec)
    drop_wait(site)
    return site
