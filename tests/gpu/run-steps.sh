#!/usr/bin/env bash
# Runs GPU recipe steps one after another in a single call to the GPU
# machine, and packs what they wrote after each step (and every PACK_EVERY
# seconds while one runs: 15) into one archive, so that a call cut off at
# its time limit still brings back every step that finished and the logs of
# the one that did not:
#
#   bash tests/gpu/run-steps.sh "fp8 ncu" "serve RUN=a host-ttft" "accuracy MINUTES=5"
#
# Each argument is one step: a recipe (fp8: run-fp8-bench.sh, serve:
# run-serve-bench.sh, accuracy: run-accuracy.sh, tests: run-gpu-tests.sh),
# then the step's VAR=VALUE settings, then its mode. DEVICE_NAME (which names
# the result files) is read from the GPU when unset: h200, h100, else the
# GPU's name in lower case ("cpu" without nvidia-smi). The steps write into
# WORK (/tmp/gpu-steps), each step's output in log-N.txt beside the results,
# its status and seconds in steps.txt; the archive is ARCHIVE (OUT's
# gpu-steps.tgz when OUT is set, else TMPDIR's). Unpack it into
# tests/benchmarks/results and keep the files worth keeping. Exits with the
# first failed step's status, after the rest have run. STEP_LIMIT (seconds;
# 0, the default: none) stops a step that runs longer, with status 124, and
# goes on to the next: a kernel that never returns costs one step.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
WORK=${WORK:-/tmp/gpu-steps}
ARCHIVE=${ARCHIVE:-${OUT:-${TMPDIR:-/tmp}}/gpu-steps.tgz}
PACK_EVERY=${PACK_EVERY:-15}
STEP_LIMIT=${STEP_LIMIT:-0}
mkdir -p "$WORK"

if [[ -z ${DEVICE_NAME:-} ]]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$gpu" in
    *H200*) DEVICE_NAME=h200 ;;
    *H100*) DEVICE_NAME=h100 ;;
    "") DEVICE_NAME=cpu ;;
    *) DEVICE_NAME=$(echo "$gpu" | tr 'A-Z ' 'a-z-') ;;
  esac
fi
export DEVICE_NAME PYTHONUNBUFFERED=1
echo "run-steps: ${#@} steps on $DEVICE_NAME; results in $ARCHIVE"

# Written beside WORK, then moved: the archive is never half written, and
# a log growing while it is read (tar's status 1) still goes in.
pack() {
  tar --warning=no-file-changed -czf "$WORK.tgz.part" -C "$WORK" .
  if (($? <= 1)); then
    mv -f "$WORK.tgz.part" "$ARCHIVE"
  fi
}

status=0
n=0
for step in "$@"; do
  n=$((n + 1))
  read -r -a words <<< "$step"
  case "${words[0]}" in
    fp8) script=tests/gpu/run-fp8-bench.sh ;;
    serve) script=tests/gpu/run-serve-bench.sh ;;
    accuracy) script=tests/gpu/run-accuracy.sh ;;
    tests) script=tests/gpu/run-gpu-tests.sh ;;
    *)
      echo "step $n ($step): unknown recipe ${words[0]} (fp8, serve, accuracy or tests)" |
        tee -a "$WORK/steps.txt" >&2
      [[ $status -eq 0 ]] && status=2
      continue
      ;;
  esac
  settings=()
  args=()
  for word in "${words[@]:1}"; do
    if [[ ${#args[@]} -eq 0 && $word == [A-Z_]*=* ]]; then
      settings+=("$word")
    else
      args+=("$word")
    fi
  done
  SECONDS=0
  env "${settings[@]}" OUT="$WORK" timeout "$STEP_LIMIT" bash "$script" "${args[@]}" \
    > "$WORK/log-$n.txt" 2>&1 &
  pid=$!
  waited=0
  while kill -0 "$pid" 2> /dev/null; do
    sleep 1
    waited=$((waited + 1))
    if ((waited % PACK_EVERY == 0)); then
      pack
    fi
  done
  wait "$pid"
  rc=$?
  echo "step $n ($step): status $rc, $SECONDS s" | tee -a "$WORK/steps.txt"
  pack
  if [[ $rc -ne 0 && $status -eq 0 ]]; then
    status=$rc
  fi
done
pack
exit "$status"
