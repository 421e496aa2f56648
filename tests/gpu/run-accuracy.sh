#!/usr/bin/env bash
# What fp8 KV blocks cost a model that has learned something, on the GPU
# machine (docs/benchmarks.md, "A model that has learned something"): trains
# the small llama on the text Python ships for MINUTES (default 5), then
# evaluates fp8 KV (e4m3 and e5m2, scales per tensor and per KV head, centered
# or not; int8 with a scale per token) on it against bf16 KV, emulated in
# transformers' attention, then int8 and e4m3 blocks through the executor's
# own runners (served.py). About MINUTES + 4 minutes.
#
#   bash tests/gpu/run-accuracy.sh
#
# The model stays in MODEL_DIR (/tmp/accuracy-model: about 380 MB, too big
# to bring back); the reports go to OUT when set, else
# tests/benchmarks/results: accuracy-model-NAME.json (the training),
# kv-fp8-accuracy-NAME.json (the emulation) and kv-served-accuracy-NAME.json
# (through the executor), NAME being DEVICE_NAME (h200).
# A dry run on a machine without a GPU (about two minutes): DEVICE=cpu
# SHAPE=tiny MINUTES=0.2 PYTHON=.venv/bin/python WHEEL_DIR=none.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tests/gpu/run-gpu-tests.sh
source tests/gpu/run-gpu-tests.sh
RESULTS=${OUT:-tests/benchmarks/results}
NAME=${DEVICE_NAME:-h200}
MODEL_DIR=${MODEL_DIR:-/tmp/accuracy-model}

setup
report
mkdir -p "$RESULTS"
device=(--device "${DEVICE:-cuda}")
"$PYTHON" -m pagedkv.bench.accuracy.train --out "$MODEL_DIR" --shape "${SHAPE:-small}" \
  --minutes "${MINUTES:-5}" "${device[@]}" --report "$RESULTS/accuracy-model-$NAME.json"
"$PYTHON" -m pagedkv.bench.accuracy.evaluate --model "$MODEL_DIR" "${device[@]}" \
  --output "$RESULTS/kv-fp8-accuracy-$NAME.json"
"$PYTHON" -m pagedkv.bench.accuracy.served --model "$MODEL_DIR" "${device[@]}" \
  --window-len 1024 --continue-tokens 256 --output "$RESULTS/kv-served-accuracy-$NAME.json"
