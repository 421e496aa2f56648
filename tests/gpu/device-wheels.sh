#!/usr/bin/env bash
# Downloads, into .whl/, the wheels that a GPU machine without internet access
# needs to run the GPU tests (tests/gpu/run-gpu-tests.sh), the gateway
# (`pagedkv serve --http-port`, `pagedkv gateway`) and guidellm
# (tests/gpu/run-loadgen.sh). That machine's Python 3.12 already holds CUDA
# torch, triton, transformers, tokenizers, numpy, tqdm, pandas, pyarrow and
# aiohttp, and the tests use those as they are; it lacks some of the other
# runtime pins of constraints.txt or holds them at other versions, so those
# travel as wheels (cp312, manylinux x86_64) at the versions pinned there
# (guidellm's in requirements-dev.txt), and so do the packages those need that
# it lacks, at the versions the dev environment VENV (.venv, `make setup`)
# holds: the ones CI tests with.
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
VENV=${VENV:-.venv}

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

pinned() {  # pinned NAME FILE: NAME's version pinned in FILE ("name==version  # ...")
  awk -F'==' -v name="$1" \
    'tolower($1) == name { sub(/[[:space:]]*(#.*)?$/, "", $2); print $2 }' "$2"
}

download() {  # download [PIP OPTIONS] REQUIREMENTS...: wheels for that machine into WHEEL_DIR
  "$PYTHON" -m pip download --quiet --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    --dest "$WHEEL_DIR" "$@"
}

pins=()
for name in "${PACKAGES[@]}"; do
  version=$(pinned "$name" constraints.txt)
  if [[ -z "$version" ]]; then
    echo "device-wheels: no pin for $name in constraints.txt" >&2
    exit 1
  fi
  pins+=("$name==$version")
done

mkdir -p "$WHEEL_DIR"
rm -f "$WHEEL_DIR"/*.whl

echo "device-wheels: downloading ${pins[*]} into $WHEEL_DIR"
download --no-deps "${pins[@]}"

# The gateway (FastAPI, uvicorn with httptools, Jinja2) and the HTTP client of
# `pagedkv bench serve --gateway` (aiohttp), with their dependencies
# (pydantic's compiled core, aiohttp's multidict, yarl and the like), resolved
# for that machine at the pins of constraints.txt and requirements-dev.txt
# where they have one.
HTTP_PACKAGES=(fastapi starlette pydantic uvicorn httptools jinja2 aiohttp)
echo "device-wheels: downloading ${HTTP_PACKAGES[*]} with their dependencies into $WHEEL_DIR"
download -c constraints.txt -c requirements-dev.txt "${HTTP_PACKAGES[@]}"

# guidellm (pinned in requirements-dev.txt) and what it needs that the machine
# lacks (or holds too old: click), at the dev environment's versions (datasets,
# its HTTP/2 client, sanic for its mock server, ...): a wheel of one of them
# that the gateway's brought at another version (click) gives way to it, since
# two versions of one package stop the install.
LOADGEN_PACKAGES=(
  click datasets dill multiprocess faker ftfy wcwidth loguru culsans aiologic
  eval-type-backport more-itertools pydantic-settings python-dotenv h2 hpack hyperframe
  sanic sanic-routing html5tagger tracerite httptools ujson websockets
  sniffio httpx2 httpcore2 truststore tzdata
)
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "device-wheels: no dev environment in $VENV (make setup makes it)" >&2
  exit 1
fi
version=$(pinned guidellm requirements-dev.txt)
if [[ -z "$version" ]]; then
  echo "device-wheels: no pin for guidellm in requirements-dev.txt" >&2
  exit 1
fi
needed=$("$VENV/bin/python" - "$WHEEL_DIR" "${LOADGEN_PACKAGES[@]}" <<'PY'
import importlib.metadata as metadata
import re
import sys
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


wheels = {}  # canonical name -> (version, path) of the wheels already there
for wheel in Path(sys.argv[1]).glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    wheels[canonical(name)] = (version, wheel)
pins = []
for name in sys.argv[2:]:
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(f"device-wheels: {name} is not installed in the dev environment")
    there = wheels.get(canonical(name))
    if there is not None and there[0] == version:
        continue
    if there is not None:
        there[1].unlink()
    pins.append(f"{name}=={version}")
print(" ".join(pins))
PY
)
read -ra loadgen <<<"guidellm==$version $needed"
echo "device-wheels: downloading ${loadgen[*]} into $WHEEL_DIR"
download --no-deps "${loadgen[@]}"

ls -1 "$WHEEL_DIR"
