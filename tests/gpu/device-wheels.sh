#!/usr/bin/env bash
# Downloads, into .whl/, the wheels that a GPU machine without internet access
# needs to run the GPU tests (tests/gpu/run-gpu-tests.sh). That machine's
# Python 3.12 already holds CUDA torch, triton, transformers, tokenizers, numpy
# and tqdm, and the tests use those as they are; it lacks some of the other
# runtime pins of constraints.txt or holds them at other versions, so those
# travel as wheels (cp312, manylinux x86_64) at the versions pinned there.
#
#   tests/gpu/device-wheels.sh          (or `make gpu-wheels`)
#
# PYTHON picks the interpreter whose pip downloads (python3); WHEEL_DIR the
# folder (.whl). Its old wheels are removed first: two versions of one
# package would stop the install there.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PYTHON=${PYTHON:-python3}
WHEEL_DIR=${WHEEL_DIR:-.whl}

# grpcio-health-checking, grpcio-reflection and structlog are missing there;
# the generated code in shared/pagedkv/v1 needs protobuf 7 and grpcio 1.85;
# prometheus-client and xxhash are there at other versions; redis (the
# scheduler imports the cluster code) is missing.
PACKAGES=(
  grpcio
  grpcio-health-checking
  grpcio-reflection
  protobuf
  structlog
  prometheus-client
  xxhash
  redis
)

pins=()
for name in "${PACKAGES[@]}"; do
  version=$(awk -F'==' -v name="$name" \
    'tolower($1) == name { sub(/[[:space:]]*(#.*)?$/, "", $2); print $2 }' constraints.txt)
  if [[ -z "$version" ]]; then
    echo "device-wheels: no pin for $name in constraints.txt" >&2
    exit 1
  fi
  pins+=("$name==$version")
done

mkdir -p "$WHEEL_DIR"
rm -f "$WHEEL_DIR"/*.whl

echo "device-wheels: downloading ${pins[*]} into $WHEEL_DIR"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 \
  --dest "$WHEEL_DIR" "${pins[@]}"

# The gateway (FastAPI, uvicorn, Jinja2) and the HTTP client of `pagedkv bench
# serve --gateway` (aiohttp), with their dependencies (pydantic's compiled
# core, aiohttp's multidict, yarl and the like), resolved for that machine at
# the pins of constraints.txt and requirements-dev.txt where they have one.
HTTP_PACKAGES=(fastapi starlette pydantic uvicorn jinja2 aiohttp)
echo "device-wheels: downloading ${HTTP_PACKAGES[*]} with their dependencies into $WHEEL_DIR"
"$PYTHON" -m pip download --quiet --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 \
  -c constraints.txt -c requirements-dev.txt \
  --dest "$WHEEL_DIR" "${HTTP_PACKAGES[@]}"

ls -1 "$WHEEL_DIR"
