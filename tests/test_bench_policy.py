"""One scheduling policy: the benchmarks and the simulation drive the real one.

The block benchmark and the router's cluster simulation schedule their
steps with the service's ``ExecutorScheduler`` (against a simulated
executor's answers), so what they time and simulate is what the service
runs. No module keeps a copy of the policy: no ``plan_step``, no
``preempt_newest`` (the block benchmark's former copy was compared with the
scheduler once, docs/benchmarks.md, and removed).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("shared", "services", "kernels", "bench")
DRIVERS = ("pagedkv.bench.scheduler.blocks", "pagedkv.bench.cluster_sim.executor")
POLICY_COPIES = {"plan_step", "preempt_newest", "_preempt_newest"}


def _path(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


def _uses_executor_scheduler(tree: ast.Module) -> bool:
    return _calls(tree, "pagedkv.scheduler.executor_scheduler", "ExecutorScheduler")


def _calls(tree: ast.Module, module: str, name: str) -> bool:
    """Whether ``tree`` imports ``name`` from ``module`` and calls it."""
    imported = any(
        isinstance(node, ast.ImportFrom)
        and node.module == module
        and any(alias.name == name for alias in node.names)
        for node in ast.walk(tree)
    )
    called = any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
        for node in ast.walk(tree)
    )
    return imported and called


SIMULATED = "pagedkv.bench.scheduler.executor_sim"


def test_the_block_benchmark_and_the_simulation_run_the_executor_scheduler() -> None:
    """Each builds an ``ExecutorScheduler``, itself or through the simulated
    executor's ``simulated_scheduler``, which builds one."""
    assert _uses_executor_scheduler(ast.parse(_path(SIMULATED).read_text()))
    for module in DRIVERS:
        tree = ast.parse(_path(module).read_text())
        assert _uses_executor_scheduler(tree) or _calls(tree, SIMULATED, "simulated_scheduler"), (
            f"{module} does not build an ExecutorScheduler"
        )


def test_no_module_keeps_a_copy_of_the_policy() -> None:
    copies = []
    for root in SOURCES:
        for path in sorted((REPO / root).rglob("*.py")):
            if "/build/" in path.as_posix():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name in POLICY_COPIES:
                    copies.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert copies == []
