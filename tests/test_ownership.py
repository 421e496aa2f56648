"""Who writes what, and who imports whom.

Each piece of the scheduler's state has one writer, and no module of the
services imports itself back through others (no import circle, even one
that only type checking follows): a module's dependencies read one way.

``ExecutorScheduler`` (executor_scheduler.py) alone changes its queues,
rows, windows and flags; every other module of the services calls its
methods (``start_draining``, ``take_unstarted``, ``give_up``, ``release``
...) instead of assigning its fields or changing its lists in place. The
check reads the source: an assignment (plain, augmented, annotated or by
index) to ``<name>.<field>`` where the name holds an ``ExecutorScheduler``
(``scheduler``, ``executor_scheduler``, ``self.schedulers[...]``), or a
call of a list or event mutator on such a field.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.structure import field_writes, imports

REPO = Path(__file__).resolve().parents[1]
SCHEDULER = REPO / "services" / "scheduler" / "pagedkv" / "scheduler"
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "sort", "set", "add"}
HOLDERS = {"scheduler", "executor_scheduler", "schedulers"}


def _fields() -> set[str]:
    """The attributes ``ExecutorScheduler.__init__`` sets."""
    tree = ast.parse((SCHEDULER / "executor_scheduler.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ExecutorScheduler"]
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    fields = set()
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and getattr(target.value, "id", "") == "self":
                fields.add(target.attr)
    return fields


def _holder(node: ast.expr) -> bool:
    """Whether ``node`` names an ExecutorScheduler (see the module docstring)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id in HOLDERS
    return isinstance(node, ast.Attribute) and node.attr in HOLDERS


def scheduler_state_writes(source: str, fields: set[str]) -> list[str]:
    """The writes of ``source`` to an ExecutorScheduler's ``fields``."""
    return field_writes(source, fields, _holder, MUTATORS.__contains__)


def test_only_the_executor_scheduler_writes_its_state() -> None:
    fields = _fields()
    assert {"waiting", "running", "free_rows", "draining", "released", "current"} <= fields
    services = REPO / "services"
    writes = {
        str(path.relative_to(services)): found
        for path in sorted(services.rglob("*.py"))
        if path != SCHEDULER / "executor_scheduler.py"
        and (found := scheduler_state_writes(path.read_text(), fields))
    }
    assert writes == {}


def test_the_check_sees_each_kind_of_write() -> None:
    fields = {"waiting", "draining", "stopped", "current"}
    source = (
        "scheduler.draining = True\n"
        "self.schedulers[a].waiting.remove(seq)\n"
        "scheduler.stopped.set()\n"
        "executor_scheduler.current: object = None\n"
        "stats.draining = scheduler.draining\n"  # a message's field, read from one: fine
        "scheduler.start_draining()\n"
    )
    assert scheduler_state_writes(source, fields) == [
        "line 1: .draining",
        "line 2: .waiting",
        "line 3: .stopped",
        "line 4: .current",
    ]


PARTS = {
    "scheduler": REPO / "services" / "scheduler" / "pagedkv" / "scheduler",
    "executor": REPO / "services" / "executor" / "pagedkv" / "executor",
    "router": REPO / "services" / "router" / "pagedkv" / "router",
    "client": REPO / "services" / "client" / "pagedkv" / "client",
    "gateway": REPO / "services" / "gateway" / "pagedkv" / "gateway",
    "common": REPO / "shared" / "pagedkv" / "common",
    "cluster": REPO / "shared" / "pagedkv" / "cluster",
}


def import_graph() -> dict[str, set[str]]:
    """Each module of the parts -> the modules of the parts it imports,
    wherever the import is (module level, inside a function, under
    ``TYPE_CHECKING``): every edge a reader has to follow."""
    modules = {}
    for part, root in PARTS.items():
        for path in root.rglob("*.py"):
            names = path.relative_to(root).with_suffix("").parts
            module = [p for p in names if p != "__init__"]
            modules[".".join(["pagedkv", part, *module])] = (
                path,
                ".".join(["pagedkv", part, *names]),
            )
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, source_name) in modules.items():
        for imported in imports(path.read_text(), source_name):
            # ``from a.b import c``: the module ``a.b.c``, else ``c`` is a name of ``a.b``
            module = imported.name if imported.name in modules else imported.module
            if module in modules and module != name:
                graph[name].add(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_in_the_services() -> None:
    assert circles(import_graph()) == []


def test_a_circle_is_found_through_a_type_checking_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
