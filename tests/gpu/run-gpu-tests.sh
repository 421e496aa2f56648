#!/usr/bin/env bash
# Runs the GPU tests on a GPU machine without internet access whose Python
# (3.12, with CUDA torch, triton and transformers) lacks some of the project's
# pins. Bring the repository there with the wheels of
# tests/gpu/device-wheels.sh in .whl/, then, from anywhere:
#
#   bash tests/gpu/run-gpu-tests.sh
#   bash tests/gpu/run-gpu-tests.sh -x tests/executor/test_block_tags.py  # pytest's own
#                                             # arguments: these tests (still -m gpu) alone
#
# It installs those wheels into SITE (/tmp/site), puts the parts' sources on
# PYTHONPATH (nothing of pagedkv is installed; their `pagedkv` subcommands are
# registered beside the wheels), prints what it runs with, then runs
#   - the tests marked gpu in tests/executor and tests/kernels (more than
#     5 minutes on an H100, whose executor-process tests take about 15 s
#     each: give tests/kernels and tests/executor a step each), and, with
#     END_TO_END=1,
#   - the tests that drive executor servers end to end over gRPC
#     (tests/executor/test_executor_api.py, tests/service/test_hardening.py;
#     about 3 minutes more: their executors run on the CPU, so they check the
#     machine's stack of wheels, which a first run there should do once).
# The log goes to gpu-tests.log in OUT when OUT is set, else in TMPDIR (/tmp).
# Exits non-zero when either pytest run fails.
set -euo pipefail  # the status is main's, through tee

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
WHEEL_DIR=${WHEEL_DIR:-.whl}
LOG=${OUT:-${TMPDIR:-/tmp}}/gpu-tests.log
PARTS=(shared services/scheduler services/router services/client services/gateway services/executor kernels bench)

setup() {
  mkdir -p "$SITE"
  local wheels=("$WHEEL_DIR"/*.whl)
  if [[ -e "${wheels[0]}" ]]; then
    echo "run-gpu-tests: installing ${#wheels[@]} wheels from $WHEEL_DIR into $SITE"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" "${wheels[@]}"
  else
    echo "run-gpu-tests: no wheels in $WHEEL_DIR (tests/gpu/device-wheels.sh makes them)"
  fi

  # `pagedkv` finds its subcommands through entry points: give each part a
  # minimal .dist-info (name, version, entry points) read from its pyproject.
  "$PYTHON" - "$SITE" "${PARTS[@]}" <<'PY'
import sys
import tomllib
from pathlib import Path

site = Path(sys.argv[1])
for part in sys.argv[2:]:
    project = tomllib.loads((Path(part) / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    groups = dict(project.get("entry-points", {}))
    if "scripts" in project:
        groups["console_scripts"] = project["scripts"]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines = []
    for group, points in groups.items():
        lines += [f"[{group}]", *(f"{key} = {value}" for key, value in points.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
PY

  local path=$SITE part
  for part in "${PARTS[@]}"; do
    path+=":$ROOT/$part"
  done
  export PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}

report() {
  "$PYTHON" - <<'PY'
import importlib.metadata as metadata
import platform

import torch

print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "tokenizers", "numpy", "grpcio", "protobuf",
             "grpcio-health-checking", "grpcio-reflection", "structlog",
             "prometheus-client", "xxhash", "redis", "pytest", "pytest-timeout"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "MISSING")
# The generated code checks the protobuf and grpcio versions at import.
import pagedkv.v1.executor_pb2_grpc
import pagedkv.v1.scheduler_pb2_grpc
print("pagedkv.v1 imports")
PY
}

# `pagedkv bench serve` on the GPU in bf16 (on the CPU, dtype auto, with
# DEVICE=cpu: a dry run), for the scripts that source this one.
bench() {
  if [[ "${DEVICE:-cuda}" == cpu ]]; then
    "$PYTHON" -m pagedkv.common.cli bench serve --device cpu "$@"
  else
    "$PYTHON" -m pagedkv.common.cli bench serve --device cuda --dtype bfloat16 "$@"
  fi
}

main() {
  setup
  report
  local status=0
  local tests=("$@")
  if [[ ${#tests[@]} -eq 0 ]]; then
    tests=(tests/executor tests/kernels)
  fi
  echo "run-gpu-tests: pytest -m gpu ${tests[*]}"
  # A line a test as it ends (and the slowest ten): a run cut off at its
  # time limit still says which tests passed.
  "$PYTHON" -m pytest -m gpu -v --durations=10 "${tests[@]}" || status=1
  if [[ "${END_TO_END:-0}" == 1 ]]; then
    echo "run-gpu-tests: pytest tests/executor/test_executor_api.py tests/service/test_hardening.py"
    "$PYTHON" -m pytest tests/executor/test_executor_api.py tests/service/test_hardening.py -q \
      || status=1
  fi
  if [[ $status == 0 ]]; then echo "run-gpu-tests: passed"; else echo "run-gpu-tests: FAILED"; fi
  return "$status"
}

# Sourced (tests/gpu/run-serve-bench.sh), it only defines setup and report.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  mkdir -p "$(dirname "$LOG")"
  echo "run-gpu-tests: log in $LOG"
  main "$@" 2>&1 | tee "$LOG"
fi
