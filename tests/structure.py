"""Reading the source for the structure tests (test_ownership.py,
test_layout.py): which fields a module writes (``field_writes``) and what it
imports (``imports``). Both read the syntax tree only; nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection
from typing import NamedTuple


def field_writes(
    source: str,
    fields: Collection[str],
    holder: Callable[[ast.expr], bool],
    mutator: Callable[[str], bool],
) -> list[str]:
    """``line N: .field``, in line order, for each write in ``source`` to one
    of ``fields`` of an object that ``holder`` says holds them (it gets the
    expression before ``.field``): an assignment to ``<holder>.<field>``
    (plain, augmented or annotated, or to an index of it: ``x.f[i] = v``),
    or a call of a method that ``mutator`` says changes its object in place
    (``x.f.append(v)``, ``x.f[i].zero_()``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and mutator(node.func.attr)
        ):
            targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and target.attr in fields and holder(target.value):
                found.append((node.lineno, f"line {node.lineno}: .{target.attr}"))
    return [text for _, text in sorted(found)]


class Import(NamedTuple):
    line: int
    name: str  # dotted; ``from a.b import c`` gives ``a.b.c`` (``c`` may be a module)
    module: str  # the module the statement names: ``a.b`` (``import a.b``, ``from a.b ...``)


def imports(source: str, module: str) -> list[Import]:
    """Every import in ``source`` (the code of ``module``; a package's
    ``__init__`` named with it, ``a.b.__init__``), wherever it is (module
    level, in a function, under ``TYPE_CHECKING``); relative imports are
    resolved against ``module``'s package."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            parent = ".".join([*base, *([node.module] if node.module else [])])
            found += [Import(node.lineno, f"{parent}.{alias.name}", parent) for alias in node.names]
    return found
