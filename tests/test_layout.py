"""The repository layout: one `pagedkv` namespace, a light scheduler side."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.structure import field_writes, imports

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
        "pagedkv.common.block_hash",
        "pagedkv.common.text",
        "pagedkv.common.text_prompts",
        "pagedkv.common.resume",
        "pagedkv.v1.scheduler_pb2_grpc",
        "pagedkv.v1.executor_pb2_grpc",
        "pagedkv.scheduler",
        "pagedkv.scheduler.kv_cache_manager",
        "pagedkv.bench.scheduler.blocks",
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
        REPO / "bench",
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
    "seq_ids",
    "row_of_seq",
    "sampling_version",
}


def _rows(node: ast.expr) -> bool:
    """Whether ``node`` names the executor's rows (``rows``, ``runner.rows``)."""
    return (node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")) == "rows"


def _row_state_writes(source: str) -> list[str]:
    """Assignments (plain, augmented or by index) to a ``rows.X`` of the
    executor's row state, and in-place tensor calls (``zero_()``) on one."""
    return field_writes(source, ROW_STATE, _rows, lambda method: method.endswith("_"))


def test_only_rows_py_writes_the_executors_row_state() -> None:
    executor = REPO / "services" / "executor" / "pagedkv" / "executor"
    writes = {
        path.name: found
        for path in sorted(executor.glob("*.py"))
        if path.name != "rows.py" and (found := _row_state_writes(path.read_text()))
    }
    assert writes == {}
    assert _row_state_writes("runner.rows.pending_sample[r] = True\nrows.block_tables.zero_()\n")


def _imports(source: str, module: str) -> list[str]:
    """``line N: name`` of every import in ``source`` (``structure.imports``)."""
    return [f"line {i.line}: {i.name}" for i in imports(source, module)]


def _forbidden_imports(
    root: Path, forbidden: tuple[str, ...], skip: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """``{file: [imports]}`` of the modules under ``root`` (a package folder
    whose name is its last dotted part, under ``pagedkv``), except the
    folders ``skip``, that import a module of ``forbidden`` or one inside it."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in skip:
            continue
        module = ".".join(["pagedkv", root.name, *relative.with_suffix("").parts])
        bad = [
            line
            for line in _imports(path.read_text(), module)
            if any(
                (name := line.split(": ", 1)[1]) == f or name.startswith(f + ".") for f in forbidden
            )
        ]
        if bad:
            found[str(relative)] = bad
    return found


SERVICES = REPO / "services"


def test_router_sdk_and_gateway_import_nothing_of_the_scheduler_or_the_sdks_old_resume() -> None:
    """Code that two services share lives in ``pagedkv.common`` (block
    hashes, text, the resume rules), so the router, the client SDK and the
    gateway import nothing of ``pagedkv.scheduler`` (nor of the SDK's old
    ``pagedkv.client.resume``), and the router nothing of the SDK (its part
    does not list it; it lists the scheduler's only for what follows).

    The router's ``bench/`` and ``sim/`` are left out: the cluster simulation
    runs the scheduler's own block core (``KVCacheManager``, ``Request``,
    its cache events) and the routing benchmark starts the scheduler's stack,
    so they import the scheduler by design (the router's part lists
    ``pagedkv-scheduler`` for them)."""
    forbidden = ("pagedkv.scheduler", "pagedkv.client.resume")
    assert (
        _forbidden_imports(
            SERVICES / "router" / "pagedkv" / "router",
            (*forbidden, "pagedkv.client"),
            skip=("bench", "sim"),
        )
        == {}
    )
    assert _forbidden_imports(SERVICES / "client" / "pagedkv" / "client", forbidden) == {}
    assert _forbidden_imports(SERVICES / "gateway" / "pagedkv" / "gateway", forbidden) == {}


def test_shared_code_imports_no_service() -> None:
    """``pagedkv.common`` and ``pagedkv.cluster`` are below every service:
    they import none of them (nor the kernels)."""
    services = tuple(
        f"pagedkv.{name}"
        for name in ("scheduler", "router", "client", "gateway", "executor", "kernels")
    )
    for package in ("common", "cluster"):
        assert _forbidden_imports(REPO / "shared" / "pagedkv" / package, services) == {}


def test_the_import_check_sees_each_form_of_import() -> None:
    source = (
        "import pagedkv.scheduler.text\n"
        "from pagedkv.scheduler import block_hash\n"
        "from pagedkv import scheduler\n"
        "def f():\n"
        "    from pagedkv.client.resume import parse_targets\n"
        "from . import index\n"
        "from ..client import resume\n"
    )
    assert set(_imports(source, "pagedkv.router.service")) == {
        "line 1: pagedkv.scheduler.text",
        "line 2: pagedkv.scheduler.block_hash",
        "line 3: pagedkv.scheduler",
        "line 5: pagedkv.client.resume.parse_targets",
        "line 6: pagedkv.router.index",
        "line 7: pagedkv.client.resume",
    }
