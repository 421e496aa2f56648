#!/usr/bin/env bash
# fp8 KV blocks on a GPU machine set up as for the GPU tests
# (tests/gpu/run-gpu-tests.sh: the wheels of tests/gpu/device-wheels.sh in
# .whl/, installed into SITE), each mode well within one ten-minute call:
#
#   bash tests/gpu/run-fp8-bench.sh tests     # the fp8 and int8 kernel tests and the paged-
#                                             # attention ones on the GPU (a few
#                                             # minutes)
#   bash tests/gpu/run-fp8-bench.sh kernels   # bench kernels over fp8_e4m3 blocks (KV: other
#                                             # caches): decode and prefill attention (a
#                                             # minute each)
#   bash tests/gpu/run-fp8-bench.sh tune      # the decode kernel's DECODE_FP8_* constants swept
#                                             # over fp8_e4m3 blocks: head size 128 (32 x 8k,
#                                             # 128 x 1k, 8 x 32k) and 64 (64 and 256 x 768)
#   bash tests/gpu/run-fp8-bench.sh executor  # bench executor (~1.1B) with bf16 blocks, then
#                                             # fp8_e4m3: blocks at the same
#                                             # --gpu-memory-utilization, decode step at
#                                             # 64 x 768 (three minutes)
#   bash tests/gpu/run-fp8-bench.sh prefetch  # the decode kernel reading each tile's block table
#                                             # a step ahead (DECODE_PREFETCH for bf16 blocks,
#                                             # DECODE_FP8_PREFETCH for fp8): its GPU tests, the
#                                             # kernel off and on (head size 64: 64 and 256 x 768;
#                                             # 128: 32 x 8k, 128 x 1k; bf16 and fp8_e4m3 blocks),
#                                             # the executor bench's step off and on (fp8 at 64
#                                             # and 256 rows, bf16 at 64)
#   bash tests/gpu/run-fp8-bench.sh serve-1b  # ~1.1B: 64 and 256 x (512 -> 256), bf16 then
#                                             # fp8_e4m3 blocks (a few minutes)
#   bash tests/gpu/run-fp8-bench.sh serve-8b  # 8B shape: 16 x (7,680 -> 256) and the long-
#                                             # prompt Poisson mix (mean prompt 3,000, 60%
#                                             # sharing one of two 2,048-token system
#                                             # prompts), bf16 then fp8_e4m3 blocks
#   bash tests/gpu/run-fp8-bench.sh int8-tests  # the int8 kernel tests alone, and the pool's
#                                             # sizing against the captured graphs' logits
#   bash tests/gpu/run-fp8-bench.sh int8-tiles  # DECODE_INT8_SCALE_TILES off and on at head
#                                             # size 64: the kernel, and the executor bench's
#                                             # decode step over int8 blocks
#   bash tests/gpu/run-fp8-bench.sh int8      # int8 blocks (a scale per token): the kernel
#                                             # bench over them, DECODE_INT8_SCALE_TILES off
#                                             # and on (head size 64 and 128), then the
#                                             # executor bench (~1.1B) with bf16, fp8_e4m3
#                                             # and int8 blocks (six minutes); serving them:
#                                             # KV="auto int8" with serve-1b or serve-8b
#   bash tests/gpu/run-fp8-bench.sh int8-ptx  # int8 tiles widened in inline PTX, off and on:
#                                             # the int8 kernel tests, the decode kernel
#                                             # (head size 64 and 128), the kernel bench's
#                                             # decode and prefill, the executor bench's
#                                             # step (five minutes)
#   bash tests/gpu/run-fp8-bench.sh words     # V tiles read as 32-bit words (DECODE_FP8_WORDS):
#                                             # their tests, the decode kernel off and on at
#                                             # 3-8 programs a multiprocessor (fp8_e4m3 and
#                                             # int8, head sizes 128 and 64; a few minutes)
#   bash tests/gpu/run-fp8-bench.sh words-executor  # the executor bench's step, the same
#                                             # off and on (KV: fp8_e4m3 int8)
#   bash tests/gpu/run-fp8-bench.sh ncu       # Nsight Compute's sections for the decode kernel
#                                             # over bf16, fp8_e4m3 and int8 blocks (a minute
#                                             # or two); CASES with a fourth field (new
#                                             # tokens) profile the prefill kernel
#   bash tests/gpu/run-fp8-bench.sh gluon     # the Gluon prefill's tests (sm_90), and the
#                                             # prefill kernels' tests beside them
#   bash tests/gpu/run-fp8-bench.sh prefill   # the prefill kernel's tiles, its read-ahead and
#                                             # fused scale off and on, bf16 and fp8_e4m3
#                                             # blocks (a few minutes)
#   bash tests/gpu/run-fp8-bench.sh mixed     # a chunk beside decodes of long contexts over
#                                             # quantized blocks (KV: fp8_e4m3 unless set),
#                                             # widened, not widened and split in two
#                                             # launches, against bf16 blocks, and as a
#                                             # CUDA graph's step over SLOTS decode slots
#                                             # (256 unless set; a minute or two)
#   bash tests/gpu/run-fp8-bench.sh int8-ptx-bench  # the same without the tests and the
#                                             # decode kernel's sweep: the benches alone
#
# Results go to OUT when set, else tests/benchmarks/results:
# kernels-fp8-e4m3-NAME, kernels-tune-fp8-{128,64}-NAME.json, executor-kv-{auto,fp8_e4m3}-NAME,
# kernels-int8-NAME, kernels-int8-scale-tiles-{64,128}-NAME.json, executor-kv-int8-NAME,
# serve-kv-{auto,fp8_e4m3}-{1b,8b,8b-mix}-NAME (.json and .md), NAME being
# DEVICE_NAME (h200). The accuracy side: tests/gpu/run-accuracy.sh.
# A dry run of the serve modes on a machine without a GPU: DEVICE=cpu
# PRESET=tiny FIXED=4x16x8 (the batches) MIX=8 MIX_PROMPT=48 MIX_OUTPUT=8
# MIX_SYSTEM=32 (the mix's requests and lengths).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tests/gpu/run-gpu-tests.sh
source tests/gpu/run-gpu-tests.sh
RESULTS=${OUT:-tests/benchmarks/results}
NAME=${DEVICE_NAME:-h200}
# KV picks the cache dtypes the executor and serve modes run, in order.
read -r -a KV_DTYPES <<< "${KV:-auto fp8_e4m3}"

setup
report
mkdir -p "$RESULTS"

# tune --switch CONSTANT over int8 blocks at head sizes 64 and 128, into
# kernels-int8-TAG-{64,128}-NAME.json.
switch_int8() {
  "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --switch "$1" \
    --kv-cache-dtype int8 --decode-shapes 64x768,256x768 --head-size 64 \
    --output "$RESULTS/kernels-int8-$2-64-$NAME.json"
  "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --switch "$1" \
    --kv-cache-dtype int8 --decode-shapes 32x8192,128x1024 --head-size 128 \
    --output "$RESULTS/kernels-int8-$2-128-$NAME.json"
}
case "${1:-tests}" in
  tests)
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_cache_kernels.py \
      tests/kernels/test_int8_cache_kernels.py tests/kernels/test_rotary_decode.py \
      tests/kernels/test_word_reads.py tests/kernels/test_gpu.py \
      tests/kernels/test_triton_kernels.py \
      -k "fp8 or int8 or cache or rotate or word or paged_attention or prefill or decode"
    ;;
  gluon)
    # The Gluon prefill's tests, and the prefill kernels' tests beside them;
    # K (names' parts, commas between them) picks some of them.
    default="gluon,paged_attention,prefill,tile"
    picked=${K:-$default}
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_prefill.py \
      tests/kernels/test_triton_kernels.py -k "${picked//,/ or }"
    ;;
  int8-tests)
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_int8_cache_kernels.py
    "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/executor/test_gpu.py \
      -k measures_its_pool
    ;;
  int8-tiles)
    "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --switch DECODE_INT8_SCALE_TILES \
      --kv-cache-dtype int8 --decode-shapes 64x768,256x768 --head-size 64 \
      --output "$RESULTS/kernels-int8-scale-tiles-64-$NAME.json"
    for tiles in False True; do
      "$PYTHON" -c 'import sys
from pagedkv.kernels import decode_attention
decode_attention.DECODE_INT8_SCALE_TILES = sys.argv[1] == "True"
from pagedkv.bench.executor.bench import main
sys.exit(main(sys.argv[2:]))' "$tiles" --kv-cache-dtype int8 \
        --output "$RESULTS/executor-kv-int8-scale-tiles-$tiles-$NAME.json"
    done
    ;;
  int8)
    "$PYTHON" -m pagedkv.bench.kernels.bench --kv-cache-dtype int8 \
      --output "$RESULTS/kernels-int8-$NAME.json"
    switch_int8 DECODE_INT8_SCALE_TILES scale-tiles
    for kv in ${KV:-auto fp8_e4m3 int8}; do
      "$PYTHON" -m pagedkv.bench.executor.bench --kv-cache-dtype "$kv" \
        --output "$RESULTS/executor-kv-$kv-$NAME.json"
    done
    ;;
  int8-ptx | int8-ptx-bench)
    if [[ $1 == int8-ptx ]]; then
      "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_int8_cache_kernels.py
      switch_int8 DECODE_INT8_PTX ptx
    fi
    for ptx in False True; do
      for module in kernels.bench executor.bench; do
        "$PYTHON" -c 'import sys
from pagedkv.kernels import decode_attention, paged_attention
decode_attention.DECODE_INT8_PTX = paged_attention.PREFILL_INT8_PTX = sys.argv[1] == "True"
import importlib
sys.exit(importlib.import_module("pagedkv.bench." + sys.argv[2]).main(sys.argv[3:]))' \
          "$ptx" "$module" --kv-cache-dtype int8 \
          --output "$RESULTS/${module%.bench}-int8-ptx-$ptx-$NAME.json"
      done
    done
    ;;
  words)
    # Quantized V tiles read as 32-bit words (DECODE_FP8_WORDS): their tests,
    # then the decode kernel off and on at 3-8 programs a multiprocessor,
    # over fp8_e4m3 and int8 blocks, head sizes 128 and 64.
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_word_reads.py
    for kv in fp8_e4m3 int8; do
      "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --switch DECODE_FP8_WORDS \
        --per-sm 3,4,6,8 --kv-cache-dtype "$kv" --decode-shapes 32x8192,128x1024,8x32768 \
        --output "$RESULTS/kernels-$kv-words-128-$NAME.json"
      "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --switch DECODE_FP8_WORDS \
        --per-sm 3,4,6,8 --kv-cache-dtype "$kv" --decode-shapes 64x768,256x768 --head-size 64 \
        --output "$RESULTS/kernels-$kv-words-64-$NAME.json"
    done
    ;;
  words-executor)
    # The executor bench's decode step (~1.1B) with the word reads off and on.
    for words in False True; do
      for kv in ${KV:-fp8_e4m3 int8}; do
        "$PYTHON" -c 'import sys
from pagedkv.kernels import decode_attention
decode_attention.DECODE_FP8_WORDS = sys.argv[1] == "True"
from pagedkv.bench.executor.bench import main
sys.exit(main(sys.argv[2:]))' "$words" --kv-cache-dtype "$kv" \
          --output "$RESULTS/executor-kv-$kv-words-$words-$NAME.json"
      done
    done
    ;;
  ncu)
    # Nsight Compute on the attention kernels, one profile a case (the
    # second call of pagedkv.bench.kernels.profile_decode): speed of light,
    # occupancy, launch, scheduler, warp stalls, memory, the pipes' use,
    # the instruction mix and the SASS lines warps stall at most. CASES (apart
    # by spaces or commas): each
    # KV_DTYPE:BATCHxCONTEXT:HEAD_SIZE[:NEW_TOKENS] (one new token: the
    # decode kernel; more: the prefill kernel, the Gluon one with GLUON set: 1 for
    # its default tiling, else KEYSxBUFFERSxSCHEDULExROWS). Files:
    # ncu-KIND-CASE-NAME.txt, the report (.ncu-rep) and its SASS lines with
    # their stalls (-sass.csv), and their summary, ncu-KIND-NAME.md
    # (pagedkv.bench.kernels.ncu_summary), KIND decode or prefill; TAG, when
    # set, follows NAME in each.
    ncu_bin=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)}
    cases=${CASES:-bfloat16:32x8192:128 fp8_e4m3:32x8192:128 int8:32x8192:128 \
      bfloat16:64x768:64 fp8_e4m3:64x768:64}
    for spec in ${cases//,/ }; do
      IFS=: read -r kv shape size new <<< "$spec"
      new=${new:-1} kind=decode kernel=_decode_split_kernel gluon=()
      if ((new > 1)); then
        kind=prefill kernel=_paged_attention_kernel
        if [[ -n ${GLUON:-} ]]; then  # the Gluon prefill (sm_90); a tiling: that one's
          kind=prefill-gluon
          kernel='regex:^(_prefill_kernel|prefill_specialized_kernel|prefill_persistent_kernel)$'
          gluon=(--gluon)
          if [[ $GLUON == *x* ]]; then
            gluon=(--gluon-tiling "$GLUON")
          fi
        fi
      fi
      report="$RESULTS/ncu-$kind-$kv-$shape-$size-$NAME${TAG:+-$TAG}"
      "$ncu_bin" --clock-control none --kernel-name "$kernel" --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
        --export "$report" --force-overwrite \
        "$PYTHON" -m pagedkv.bench.kernels.profile_decode "$kv" "$shape" --head-size "$size" \
        --new-tokens "$new" "${gluon[@]}"
      "$ncu_bin" --import "$report.ncu-rep" > "$report.txt"
      # Each SASS instruction with its samples of stalled warps (ncu's
      # source page); an ncu without that page leaves the file empty.
      "$ncu_bin" --import "$report.ncu-rep" --page source --print-source sass --csv \
        > "$report-sass.csv" || true
    done
    for kind in decode prefill prefill-gluon; do
      # [bfi]: a cache dtype's first letter (bfloat16, fp8_*, int8), not gluon's.
      pages=("$RESULTS"/ncu-"$kind"-[bfi]*-"$NAME${TAG:+-$TAG}"-sass.csv)
      if [[ -e ${pages[0]} ]]; then
        "$PYTHON" -m pagedkv.bench.kernels.ncu_summary \
          --output "$RESULTS/ncu-$kind-$NAME${TAG:+-$TAG}.md" "${pages[@]}"
      fi
    done
    ;;
  prefill)
    # The prefill kernel's tiles (TILES: MxNxWARPSxSTAGES[xREGISTERS],...;
    # unset, tune's PREFILL_TILES) with the
    # block table read a tile ahead (PREFILL_PREFETCH) and the scale inside
    # exp2 (PREFILL_FUSED_SCALE) each off and on, against the best SDPA
    # backend, at b = 8: 2,048 new tokens, and 512 over 4,096 cached; bf16
    # and fp8_e4m3 blocks (KV). Files: kernels-prefill-tune-KV-NAME.json.
    # SWITCHES: the constants timed off and on, commas or spaces between
    # them (set empty: none, each tile as the defaults set the rest); TAG:
    # a name's part after the dtype; HEAD: the head size (128).
    switches=()
    switch_names=${SWITCHES-PREFILL_PREFETCH PREFILL_FUSED_SCALE}
    for name in ${switch_names//,/ }; do
      switches+=(--prefill-switch "$name")
    done
    tiles=()
    if [[ -n ${TILES:-} ]]; then
      tiles=(--prefill-tiles "$TILES")
    fi
    if [[ -n ${GLUON:-} ]]; then  # the Gluon prefill's tilings (NxSTAGESxSCHEDULExROWS,...), sm_90
      tiles+=(--gluon-tilings "$GLUON")
    fi
    for kv in ${KV:-bfloat16 fp8_e4m3}; do
      "$PYTHON" -m pagedkv.bench.kernels.tune --only prefill --kv-cache-dtype "$kv" \
        --head-size "${HEAD:-128}" "${tiles[@]}" "${switches[@]}" \
        --output "$RESULTS/kernels-prefill-tune-$kv${TAG:+-$TAG}-$NAME.json"
    done
    ;;
  kernels)
    # KV: the caches' dtypes, fp8_e4m3 unless set; bfloat16 writes
    # kernels-NAME.json, the others kernels-KV-NAME.json (fp8-e4m3).
    for kv in ${KV:-fp8_e4m3}; do
      name=kernels-${kv//_/-}-$NAME
      [[ $kv != bfloat16 ]] || name=kernels-$NAME
      "$PYTHON" -m pagedkv.bench.kernels.bench --kv-cache-dtype "$kv" \
        --output "$RESULTS/$name.json"
    done
    ;;
  mixed)
    # SLOTS: a graph's decode slots (the bench's --slots), in the name when set.
    for kv in ${KV:-fp8_e4m3}; do
      "$PYTHON" -m pagedkv.bench.kernels.mixed --kv-cache-dtype "$kv" --slots "${SLOTS:-256}" \
        --output "$RESULTS/kernels-mixed-${kv//_/-}${SLOTS:+-slots$SLOTS}-$NAME.json"
    done
    ;;
  tune)
    "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --kv-cache-dtype fp8_e4m3 \
      --decode-shapes 32x8192,128x1024,8x32768 --output "$RESULTS/kernels-tune-fp8-128-$NAME.json"
    "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --kv-cache-dtype fp8_e4m3 \
      --decode-shapes 64x768,256x768 --head-size 64 \
      --output "$RESULTS/kernels-tune-fp8-64-$NAME.json"
    for size in 128 64; do
      echo "run-fp8-bench: head size $size, closest to each shape's best:" \
        "$("$PYTHON" -m pagedkv.bench.kernels.tune --best "$RESULTS/kernels-tune-fp8-$size-$NAME.json")"
    done
    ;;
  executor)
    for kv in "${KV_DTYPES[@]}"; do
      "$PYTHON" -m pagedkv.bench.executor.bench --kv-cache-dtype "$kv" \
        --output "$RESULTS/executor-kv-$kv-$NAME.json"
    done
    ;;
  prefetch)
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py \
      tests/kernels/test_fp8_cache_kernels.py tests/kernels/test_rotary_decode.py \
      -k "prefetch or read_ahead"
    for kv in bfloat16 fp8_e4m3; do
      switch=DECODE_PREFETCH
      [[ $kv == bfloat16 ]] || switch=DECODE_FP8_PREFETCH
      "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --switch "$switch" \
        --kv-cache-dtype "$kv" --decode-shapes 64x768,256x768 --head-size 64 \
        --output "$RESULTS/kernels-prefetch-64-$kv-$NAME.json"
      "$PYTHON" -m pagedkv.bench.kernels.tune --only decode --switch "$switch" \
        --kv-cache-dtype "$kv" --decode-shapes 32x8192,128x1024 --head-size 128 \
        --output "$RESULTS/kernels-prefetch-128-$kv-$NAME.json"
    done
    for run in "fp8_e4m3 64" "fp8_e4m3 256" "auto 64"; do
      read -r kv batch <<<"$run"
      for prefetch in False True; do
        "$PYTHON" -c 'import sys
from pagedkv.kernels import decode_attention
decode_attention.DECODE_PREFETCH = decode_attention.DECODE_FP8_PREFETCH = sys.argv[1] == "True"
from pagedkv.bench.executor.bench import main
sys.exit(main(sys.argv[2:]))' "$prefetch" --kv-cache-dtype "$kv" --batch "$batch" \
          --output "$RESULTS/executor-kv-$kv-$batch-prefetch-$prefetch-$NAME.json"
      done
    done
    ;;
  serve-1b)
    for kv in "${KV_DTYPES[@]}"; do
      bench --preset "${PRESET:-llama-1.1b}" --rates "" --no-hf \
        --fixed-batch "${FIXED:-64x512x256,256x512x256}" --kv-cache-dtype "$kv" \
        --output "$RESULTS/serve-kv-$kv-1b-$NAME.json"
    done
    ;;
  serve-8b)
    for kv in "${KV_DTYPES[@]}"; do
      bench --preset "${PRESET:-llama-8b}" --rates "" --no-hf \
        --fixed-batch "${FIXED:-16x7680x256}" --kv-cache-dtype "$kv" \
        --output "$RESULTS/serve-kv-$kv-8b-$NAME.json"
      bench --preset "${PRESET:-llama-8b}" --rates 1,4 --num-requests "${MIX:-64}" --no-hf \
        --mean-prompt-len "${MIX_PROMPT:-3000}" --mean-output-len "${MIX_OUTPUT:-256}" \
        --system-prompt-fraction 0.6 --num-system-prompts 2 \
        --system-prompt-len "${MIX_SYSTEM:-2048}" --fixed-batch "" --kv-cache-dtype "$kv" \
        --output "$RESULTS/serve-kv-$kv-8b-mix-$NAME.json"
    done
    ;;
  *)
    echo "run-fp8-bench: unknown mode ${1}" >&2
    exit 2
    ;;
esac
