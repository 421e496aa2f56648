"""The scheduler service is composed of owned parts, not split over base
classes: ``SchedulerService`` inherits nothing, no class of its parts
inherits another class of the scheduler package, and the parts meet
through Protocols (``ExecutorsHost``, ``ClusterHost``, ``Registry``) and
public methods. The check reads the source: the composed modules never
touch a private (``_x``) attribute or method of another object, only of
``self`` or ``cls``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEDULER = REPO / "services" / "scheduler" / "pagedkv" / "scheduler"
COMPOSED = (
    "service.py",
    "executors.py",
    "drain_and_probe.py",
    "generations.py",
    "step_loop.py",
    "internal_errors.py",
    "takeover.py",
    "cluster.py",
    "cluster_policy.py",
    "cluster_feeds.py",
    "cluster_leases.py",
)
PLAIN_BASES = {"object", "Protocol", "NamedTuple", "Exception"}


def _project_classes() -> set[str]:
    """The names of the classes defined in the scheduler package."""
    names = set()
    for path in SCHEDULER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
    return names


def _base_names(cls: ast.ClassDef) -> list[str]:
    names = []
    for base in cls.bases:
        while isinstance(base, ast.Subscript):
            base = base.value
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def private_reaches(source: str) -> list[str]:
    """Each ``<expr>._name`` in ``source`` where ``<expr>`` is not ``self``
    or ``cls`` (dunders such as ``__name__`` are public)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}:
            continue
        found.append(f"line {node.lineno}: .{name}")
    return found


def test_the_service_inherits_nothing() -> None:
    tree = ast.parse((SCHEDULER / "service.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SchedulerService"]
    assert _base_names(cls) == []


def test_no_composed_part_inherits_a_project_class() -> None:
    project = _project_classes()
    inheriting = {
        f"{name}: {node.name}({base})"
        for name in COMPOSED
        for node in ast.walk(ast.parse((SCHEDULER / name).read_text()))
        if isinstance(node, ast.ClassDef)
        for base in _base_names(node)
        if base in project and base not in PLAIN_BASES
    }
    assert inheriting == set()


def test_the_composed_parts_reach_no_private_member_of_another_object() -> None:
    reaches = {
        name: found
        for name in COMPOSED
        if (found := private_reaches((SCHEDULER / name).read_text()))
    }
    assert reaches == {}


def test_the_check_sees_a_private_reach() -> None:
    source = (
        "self._tasks.add(task)\n"  # its own: fine
        "service._spawn(coroutine)\n"
        "self.executors._resync.add(address)\n"
        "type(x).__name__\n"  # a dunder: fine
    )
    assert private_reaches(source) == ["line 2: ._spawn", "line 3: ._resync"]
