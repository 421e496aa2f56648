#!/usr/bin/env bash
# Runs guidellm, one of the field's load generators, against `pagedkv serve
# --http-port` on a GPU machine set up as for the GPU tests
# (tests/gpu/run-gpu-tests.sh: the wheels of tests/gpu/device-wheels.sh in
# .whl/, guidellm's among them, installed into SITE; nothing of pagedkv is
# pip-installed):
#
#   bash tests/gpu/run-loadgen.sh
#
# The server is the serving benchmark's: the ~1.1B llama preset (dummy bf16
# weights, a tokenizer of its whole vocabulary), one executor, the scheduler
# settings of the committed serve-bench-NAME.json (WINDOW and DEPTH override
# them). guidellm (`python -m tests.gateway.loadgen`) runs its concurrent
# profile over /v1/completions, streamed: STREAMS (default 64,256) streams of
# 512 -> 256 tokens, WAVES (default 2) requests per stream, each benchmark
# ended after MAX_SECONDS (default 90; its unfinished requests count as
# incomplete); about four minutes with the server's start. Its JSON report, without the per-request records, and a summary
# beside `pagedkv bench serve`'s fixed batches go to OUT when set (the
# device's output folder), else tests/benchmarks/results, as
# loadgen-guidellm-NAME.{json,md}, NAME being DEVICE_NAME (default h200).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tests/gpu/run-gpu-tests.sh
source tests/gpu/run-gpu-tests.sh
RESULTS=${OUT:-tests/benchmarks/results}
NAME=${DEVICE_NAME:-h200}

setup
report
"$PYTHON" - <<'PY'
import importlib.metadata as metadata

for name in ("guidellm", "datasets", "pyarrow", "pandas", "click", "httpx", "fastapi", "pydantic"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "MISSING")
PY
mkdir -p "$RESULTS"

# The serving benchmark's scheduler settings, so that the two stand side by side.
read -r window depth < <("$PYTHON" - "tests/benchmarks/results/serve-bench-$NAME.json" <<'PY'
import json
import sys

try:
    with open(sys.argv[1]) as file:
        settings = json.load(file)["settings"]
    print(settings["decode_window"], settings["pipeline_depth"])
except FileNotFoundError:
    print(8, 2)
PY
)
echo "run-loadgen: --decode-window ${WINDOW:-$window} --pipeline-depth ${DEPTH:-$depth}"

"$PYTHON" -m tests.gateway.loadgen --streams "${STREAMS:-64,256}" --waves "${WAVES:-2}" \
  --max-seconds "${MAX_SECONDS:-90}" --prompt-tokens 512 --output-tokens 256 --device-name "$NAME" \
  --output "$RESULTS/loadgen-guidellm-$NAME.json" \
  --preset llama-1.1b --device cuda --dtype bfloat16 \
  --decode-window "${WINDOW:-$window}" --pipeline-depth "${DEPTH:-$depth}"
