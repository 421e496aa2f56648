"""The v1 gRPC contract: committed generated code is fresh, and the services have
the methods and streaming kinds the design promises."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor, ServiceDescriptor

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTOS_DIR = REPO_ROOT / "protos"
GENERATED_DIR = REPO_ROOT / "shared" / "pagedkv" / "v1"
PACKAGE_PATH = Path("pagedkv") / "v1"


def _files_under(root: Path) -> dict[str, bytes]:
    """Maps each file's path relative to root to its bytes, skipping bytecode caches."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_committed_generated_code_matches_the_protos(tmp_path: Path) -> None:
    # The same invocation as `make proto`, into a scratch directory.
    proto_files = sorted(str(p) for p in (PROTOS_DIR / PACKAGE_PATH).glob("*.proto"))
    assert proto_files, f"no .proto files under {PROTOS_DIR / PACKAGE_PATH}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTOS_DIR}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *proto_files,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"

    expected = _files_under(tmp_path / PACKAGE_PATH)
    committed = _files_under(GENERATED_DIR) if GENERATED_DIR.is_dir() else {}
    missing = sorted(expected.keys() - committed.keys())
    extra = sorted(committed.keys() - expected.keys())
    stale = sorted(
        name for name in expected.keys() & committed.keys() if expected[name] != committed[name]
    )
    assert not (missing or extra or stale), (
        f"shared/pagedkv/v1 is out of date (missing {missing}, extra {extra}, "
        f"stale {stale}): run `make proto`"
    )


# (method name, client streams, server streams)
SCHEDULER_METHODS = {
    ("Generate", False, True),
    ("Abort", False, False),
    ("GetStats", False, False),
}
EXECUTOR_METHODS = {
    ("GetInfo", False, False),
    ("Allocate", False, False),
    ("Free", False, False),
    ("Step", False, False),
    ("StepStream", True, True),
    ("CopyBlocks", False, False),
    ("Reset", False, False),
    ("ListCachedBlocks", False, True),
}
# ListCachedBlocks changes nothing, but carries the owner so that only the
# session a Reset just started reads the tags.
FENCED_EXECUTOR_METHODS = {
    "Allocate",
    "Free",
    "Step",
    "StepStream",
    "CopyBlocks",
    "Reset",
    "ListCachedBlocks",
}


def _service(module_name: str, service_name: str) -> ServiceDescriptor:
    """The descriptor of a service, after checking its gRPC stub and servicer exist."""
    grpc_module = importlib.import_module(f"pagedkv.v1.{module_name}_pb2_grpc")
    assert hasattr(grpc_module, f"{service_name}Stub")
    assert hasattr(grpc_module, f"{service_name}Servicer")
    pb2 = importlib.import_module(f"pagedkv.v1.{module_name}_pb2")
    service: ServiceDescriptor = pb2.DESCRIPTOR.services_by_name[service_name]
    return service


def _method_kinds(service: ServiceDescriptor) -> set[tuple[str, bool, bool]]:
    return {(m.name, m.client_streaming, m.server_streaming) for m in service.methods}


def test_scheduler_generate_streams_responses_and_other_methods_are_unary() -> None:
    assert _method_kinds(_service("scheduler", "Scheduler")) == SCHEDULER_METHODS


def test_executor_step_stream_is_bidirectional_and_other_methods_are_unary() -> None:
    assert _method_kinds(_service("executor", "Executor")) == EXECUTOR_METHODS


def test_every_mutating_executor_request_carries_an_owner_for_fencing() -> None:
    service = _service("executor", "Executor")
    for method in service.methods:
        owner = method.input_type.fields_by_name.get("owner")
        if method.name in FENCED_EXECUTOR_METHODS:
            assert owner is not None, f"{method.input_type.name} has no owner"
            assert owner.message_type.full_name == "pagedkv.v1.Owner"
        else:
            assert owner is None, f"read-only {method.input_type.name} carries an owner"


def test_requests_are_named_by_scheduler_chosen_rows_with_replaceable_table_entries() -> None:
    pb2 = importlib.import_module("pagedkv.v1.executor_pb2")
    messages = pb2.DESCRIPTOR.message_types_by_name
    # The scheduler picks each request's block-table row; the executor returns none.
    assert messages["NewRequest"].fields_by_name["row"].type == FieldDescriptor.TYPE_UINT32
    assert "max_num_rows" in messages["GetInfoResponse"].fields_by_name
    assert not messages["AllocateResponse"].fields
    for message in messages.values():
        slot_fields = [f.name for f in message.fields if "slot" in f.name]
        assert not slot_fields, f"{message.name} still has {slot_fields}"
    # Block-table updates carry a start per entry and group, next to the counts.
    for name in ("StepRequest", "AllocateRequest"):
        fields = messages[name].fields_by_name
        for column in ("rows", "block_table_starts", "new_block_counts", "new_block_ids"):
            assert fields[column].is_repeated, f"{name}.{column}"
