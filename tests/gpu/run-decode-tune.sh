#!/usr/bin/env bash
# Tunes the decode attention's launch constants at the executor bench's
# shapes (the ~1.1B llama: 32 query heads, 8 KV heads of 64 dims; 64 and 256
# rows at a context of 768) on a GPU machine set up as for the GPU tests
# (tests/gpu/run-gpu-tests.sh), then runs the executor bench at both batch
# sizes under the constants closest to each shape's best:
#
#   bash tests/gpu/run-decode-tune.sh
#
# Results go to OUT when set, else tests/benchmarks/results:
# kernels-tune-64-NAME.json (every measurement of the sweep) and
# executor-tuned-NAME / executor-tuned-256-NAME (.json, .md), NAME being
# DEVICE_NAME (default h200).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tests/gpu/run-gpu-tests.sh
source tests/gpu/run-gpu-tests.sh
RESULTS=${OUT:-tests/benchmarks/results}
NAME=${DEVICE_NAME:-h200}

setup
report
mkdir -p "$RESULTS"
sweep=$RESULTS/kernels-tune-64-$NAME.json
"$PYTHON" -m pagedkv.bench.kernels.tune --only decode --decode-shapes 64x768,256x768 \
  --head-size 64 --output "$sweep"
best=$("$PYTHON" -m pagedkv.bench.kernels.tune --best "$sweep")
echo "run-decode-tune: closest to each shape's best: $best"
"$PYTHON" -m pagedkv.bench.executor.bench --decode-constants "$best" \
  --output "$RESULTS/executor-tuned-$NAME.json"
"$PYTHON" -m pagedkv.bench.executor.bench --decode-constants "$best" --batch 256 \
  --output "$RESULTS/executor-tuned-256-$NAME.json"
