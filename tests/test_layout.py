"""The repository layout: one `pagedkv` namespace, a light scheduler side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "transformers", "pagedkv.kernels", "pagedkv.executor")


def _modules_after_import(*modules: str) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout))


def test_scheduler_side_imports_no_torch_triton_or_transformers() -> None:
    loaded = _modules_after_import(
        "pagedkv.common",
        "pagedkv.common.cli",
        "pagedkv.common.logging",
        "pagedkv.v1.scheduler_pb2_grpc",
        "pagedkv.v1.executor_pb2_grpc",
        "pagedkv.scheduler",
        "pagedkv.scheduler.kv_cache_manager",
        "pagedkv.scheduler.bench.blocks",
        "pagedkv.router",
        "pagedkv.router.scoring",
        "pagedkv.router.index",
        "pagedkv.client",
        "pagedkv.gateway.server",
    )
    assert not {m for m in loaded if m.split(".")[0] in HEAVY or m.startswith(HEAVY)}


def test_heavy_packages_are_installed_so_the_import_check_means_something() -> None:
    loaded = _modules_after_import("torch")
    assert "torch" in loaded


def test_pagedkv_is_one_namespace_across_the_part_folders() -> None:
    import pagedkv

    assert not hasattr(pagedkv, "__file__") or pagedkv.__file__ is None
    roots = {Path(p).resolve().parent for p in pagedkv.__path__}
    expected = {
        REPO / "shared",
        REPO / "services" / "scheduler",
        REPO / "services" / "router",
        REPO / "services" / "client",
        REPO / "services" / "executor",
        REPO / "kernels",
    }
    assert expected <= roots
    assert not (REPO / "shared" / "pagedkv" / "__init__.py").exists()


def test_pagedkv_cli_lists_the_installed_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.common.cli", "bench", "--help"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "blocks" in out.stdout


ROW_STATE = {
    "live",
    "num_tokens",
    "num_blocks",
    "pending_sample",
    "block_tables",
    "token_ids",
    "last_sampled",
    "sampling",
    "request_ids",
    "row_of_request",
    "sampling_version",
}


def _row_state_writes(source: str) -> list[str]:
    """Assignments (plain, augmented or by index) to a ``rows.X`` of the
    executor's row state, and in-place tensor calls on one."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr.endswith("_")
        ):
            targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if (
                isinstance(target, ast.Attribute)
                and target.attr in ROW_STATE
                and isinstance(target.value, ast.Attribute | ast.Name)
                and (getattr(target.value, "attr", None) or getattr(target.value, "id", ""))
                == "rows"
            ):
                found.append(f"line {node.lineno}: rows.{target.attr}")
    return found


def test_only_rows_py_writes_the_executors_row_state() -> None:
    executor = REPO / "services" / "executor" / "pagedkv" / "executor"
    writes = {
        path.name: found
        for path in sorted(executor.glob("*.py"))
        if path.name != "rows.py" and (found := _row_state_writes(path.read_text()))
    }
    assert writes == {}
    assert _row_state_writes("runner.rows.pending_sample[r] = True\nrows.block_tables.zero_()\n")
