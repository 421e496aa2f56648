#!/usr/bin/env bash
# Runs `pagedkv bench serve` on a GPU machine set up as for the GPU tests
# (tests/gpu/run-gpu-tests.sh: the wheels of tests/gpu/device-wheels.sh in
# .whl/, installed into SITE; nothing of pagedkv is pip-installed):
#
#   bash tests/gpu/run-serve-bench.sh 1b     # ~1.1B llama: rates, 64 x (512 -> 256)
#                                            # against HF generate, GPU timeline
#   bash tests/gpu/run-serve-bench.sh 8b     # Llama-3-8B's shape: rates, the same batch
#   bash tests/gpu/run-serve-bench.sh 256    # ~1.1B: 256 x (512 -> 256), no HF
#   bash tests/gpu/run-serve-bench.sh executor   # python -m pagedkv.bench.executor.bench,
#                                            # decode batch 64 and 256
#   bash tests/gpu/run-serve-bench.sh sweep      # ~1.1B: 64 and 256 x (512 -> 256) under
#                                            # each scheduler setting WINDOW:DEPTH of
#                                            # SWEEP, on one executor (bench serve --sweep)
#   bash tests/gpu/run-serve-bench.sh timeline   # ~1.1B: the GPU timeline of 64 x (512 -> 256)
#                                            # alone (no rates, no HF; a minute)
#   bash tests/gpu/run-serve-bench.sh gemm       # python -m pagedkv.bench.kernels.bench_gemm
#   bash tests/gpu/run-serve-bench.sh host-tier  # python -m pagedkv.bench.executor.host_tier:
#                                            # first tokens from each tier, 8B shape
#   bash tests/gpu/run-serve-bench.sh host-ttft  # pagedkv.bench.scheduler.host_ttft: a 4,096-
#                                            # token prompt's first token from each tier
#                                            # through pagedkv serve, 8B shape
#   bash tests/gpu/run-serve-bench.sh host-ttft-idle  # the same without, then with,
#                                            # offloads ahead of eviction while idle
#   bash tests/gpu/run-serve-bench.sh host-tier-serve  # ~1.1B: long shared prompts, 4x
#                                            # the GPU pool, without and with a host tier
#   bash tests/gpu/run-serve-bench.sh steps      # the live scheduler's CPU per running
#                                            # request per decode step (no executor;
#                                            # single steps and windows of 8), and for
#                                            # the step admitting a 4,096-token prompt
#                                            # from each tier (tier_steps)
#   bash tests/gpu/run-serve-bench.sh cold       # ~1.1B: cold paths, 160 requests at 4/s
#                                            # on a fresh server, windows of 8 then single
#                                            # steps (TTFT p99 against p50; three minutes)
#   bash tests/gpu/run-serve-bench.sh fixed      # ~1.1B: 64 and 256 x (512 -> 256), each twice,
#                                            # over gRPC only (no rates, no HF; a minute):
#                                            # a quick check of the serving path after a change
#   bash tests/gpu/run-serve-bench.sh gateway    # ~1.1B: 64 and 256 x (512 -> 256), each
#                                            # twice, over gRPC then through one pagedkv
#                                            # gateway process (HTTP) on the same stack
#                                            # (bench serve --gateway; a minute or two)
#   bash tests/gpu/run-serve-bench.sh swap       # ~1.1B: swap versus recompute (bench swap)
#
# WINDOW and DEPTH (default 8 and the scheduler's default for the window:
# 2, or 4 with single steps) are the --decode-window and
# --pipeline-depth of the 1b, 8b and 256 runs (WINDOW=best: the sweep's
# best, read from its results); SWEEP (default 1:2,4:2,8:2,8:3,16:2,16:3)
# the settings of the sweep. Within ten minutes:
#   bash tests/gpu/run-serve-bench.sh sweep && WINDOW=best bash tests/gpu/run-serve-bench.sh 256
#   WINDOW=best bash tests/gpu/run-serve-bench.sh 1b  (with the sweep's file in OUT or results)
#
# All use dummy (random) bf16 weights. Results go to OUT when set (the
# device's output folder), else tests/benchmarks/results, as
# serve-bench-NAME.{json,md,png}, NAME being h200 (1b), 8b-h200 (8b) or
# 256-h200 (256), serve-sweep-h200.{json,md} (sweep), serve-timeline-h200
# (timeline), executor-fused-h200 / executor-256-h200 (executor),
# gemm-h200.{json,md} (gemm), scheduler-steps-h200.txt and
# scheduler-tier-steps-h200.txt (steps) and
# serve-cold-h200 / serve-cold-single-h200 (cold), serve-fixed-h200 (fixed; with
# WINDOW=1 serve-fixed-single-h200) and serve-gateway-h200
# (gateway; serve-gateway-text-h200 with GRPC_TEXT=1, the gRPC runs then
# asking for text as the gateway does); set DEVICE_NAME for another GPU.
#
# A dry run of a mode's commands on a machine without a GPU: DEVICE=cpu runs
# them on the CPU (dtype auto); for the gateway mode PRESET (default
# llama-1.1b) and BATCHES (default 64x512x256,256x512x256,64x512x256,
# 256x512x256) shrink it, e.g.
#   DEVICE=cpu PRESET=tiny BATCHES=4x16x8,8x16x8 DEVICE_NAME=cpu-dry-run \
#     OUT=/some/dir bash tests/gpu/run-serve-bench.sh gateway
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tests/gpu/run-gpu-tests.sh
source tests/gpu/run-gpu-tests.sh
RESULTS=${OUT:-tests/benchmarks/results}
NAME=${DEVICE_NAME:-h200}

setup
report
mkdir -p "$RESULTS"
# The scheduler settings of the 1b, 8b and 256 runs; WINDOW=best takes
# those of the sweep that come closest to the targets of both
# batches (64 x: 25,000 output tok/s, 256 x: 40,000), from RESULTS or, when
# not there (a device's output folder starts empty), the committed results.
if [[ "${WINDOW:-1}" == best ]]; then
  swept=$RESULTS/serve-sweep-$NAME.json
  [[ -e "$swept" ]] || swept=tests/benchmarks/results/serve-sweep-$NAME.json
  best=$("$PYTHON" -m pagedkv.bench.scheduler.serving.sweep "$swept" 64=25000 256=40000)
  read -r WINDOW DEPTH <<<"$best"
  echo "run-serve-bench: the sweep's best setting: --decode-window $WINDOW --pipeline-depth $DEPTH"
fi
tuned=(--decode-window "${WINDOW:-8}")
# Without DEPTH, the scheduler's default for the window (2; 4 with WINDOW=1).
if [[ -n "${DEPTH:-}" ]]; then
  tuned+=(--pipeline-depth "$DEPTH")
fi
case "${1:-1b}" in
  1b)
    bench --preset llama-1.1b --rates 4,16,64,inf --num-requests 160 \
      --fixed-batch 64x512x256 --timeline-steps 50 "${tuned[@]}" \
      --output "$RESULTS/serve-bench-$NAME.json"
    ;;
  8b)
    bench --preset llama-8b --rates 2,8,32,inf --num-requests 96 \
      --fixed-batch 64x512x256 "${tuned[@]}" --output "$RESULTS/serve-bench-8b-$NAME.json"
    ;;
  256)
    bench --preset llama-1.1b --rates inf --num-requests 64 \
      --fixed-batch 256x512x256 --no-hf "${tuned[@]}" \
      --output "$RESULTS/serve-bench-256-$NAME.json"
    ;;
  sweep)
    bench --preset llama-1.1b --sweep "${SWEEP:-1:2,4:2,8:2,8:3,16:2,16:3}" \
      --fixed-batch 64x512x256,256x512x256 --output "$RESULTS/serve-sweep-$NAME.json"
    ;;
  timeline)
    bench --preset llama-1.1b --rates inf --num-requests 16 --fixed-batch 64x512x256 --no-hf \
      --timeline-steps 48 --timeline-skip 24 "${tuned[@]}" \
      --output "$RESULTS/serve-timeline-$NAME.json"
    ;;
  gemm)
    "$PYTHON" -m pagedkv.bench.kernels.bench_gemm --output "$RESULTS/gemm-$NAME.json"
    ;;
  host-tier-serve)
    # PRESET (default llama-1.1b): 512 requests, each one of NUM_PROMPTS
    # (default 64) system prompts of SYSTEM_LEN (default 1,024) tokens and a
    # short question, all at once: the prompts' distinct blocks are 4x the
    # 1,024 blocks of the GPU pool at the defaults (and with 32 prompts of
    # 2,048). With the GPU pool alone and then with a host tier of HOST_GIB
    # (default 4; 16 for llama-8b's 2 MiB blocks) GiB (a few minutes), each
    # step traced (the report splits the device time by kind of step).
    # NUM_BLOCKS (default 1,025) sizes the GPU pool and REQUESTS (default
    # 512) the trace: NUM_BLOCKS=2305 REQUESTS=1024 NUM_PROMPTS=144 HOST_GIB=24
    # PRESET=llama-8b TAG=batch32 gives a pool that holds 32 running
    # sequences of 1,024-token prompts (the default pool holds 14) and 4x
    # its blocks in distinct prompts.
    # Files: serve-host-tier-{off,on}[-8b][-SYSTEM_LEN unless 1024]-NAME.
    preset=${PRESET:-llama-1.1b}
    system_len=${SYSTEM_LEN:-1024}
    suffix=''
    [[ $preset == llama-8b ]] && suffix=-8b
    [[ $system_len == 1024 ]] || suffix=$suffix-$system_len
    # TAG, when set, ends the files' names (runs of another setting, e.g.
    # GRAPHS=decode: CUDA graphs for decode steps only, --cuda-graphs).
    [[ -n ${TAG:-} ]] && suffix=$suffix-$TAG
    # TIERS (default "off on"): "on-eviction" adds a run whose tier takes a
    # cached block only when the GPU pool evicts it (--host-offload eviction).
    for tier in ${TIERS:-off on}; do
      host=()
      [[ $tier != off ]] && host=(--host-kv-gib "${HOST_GIB:-4}")
      [[ $tier == on-eviction ]] && host+=(--host-offload eviction)
      bench --preset "$preset" --rates inf --num-requests "${REQUESTS:-512}" --warmup-requests 16 \
        --fixed-batch '' --no-hf --system-prompt-fraction 1 \
        --num-system-prompts "${NUM_PROMPTS:-64}" --system-prompt-len "$system_len" \
        --mean-prompt-len 64 --mean-output-len 64 \
        --num-blocks "${NUM_BLOCKS:-1025}" --max-num-seqs 32 --step-trace "${tuned[@]}" "${host[@]}" \
        --cuda-graphs "${GRAPHS:-all}" --output "$RESULTS/serve-host-tier-$tier$suffix-$NAME.json"
    done
    ;;
  host-ttft)
    # Llama-3-8B's shape: a 4,096-token prompt's TTFT end to end, recomputed,
    # from a GPU hit and from a host hit (five rounds after a warm-up; a
    # minute or two). RUN numbers the file; GRAPHS=decode: CUDA graphs for
    # decode steps only (--cuda-graphs); IDLE: the scheduler's
    # --host-idle-offload-blocks (default 0, off: the host hit's step
    # offloads the blocks it evicts).
    idle=()
    [[ -n ${IDLE:-} ]] && idle=(--host-idle-offload-blocks "$IDLE")
    "$PYTHON" -m pagedkv.bench.scheduler.host_ttft --preset llama-8b --device cuda \
      --dtype bfloat16 --prompt-len 4096 --host-kv-gib 4 --cuda-graphs "${GRAPHS:-all}" \
      "${idle[@]}" --output "$RESULTS/host-ttft-8b-${RUN:-1}-$NAME.json"
    ;;
  host-ttft-idle)
    # host-ttft twice in one call: without offloads ahead of eviction while
    # idle (the host hit's step offloads the blocks it evicts), then with
    # them 512 blocks deep (two prompts' blocks). Files:
    # host-ttft-8b-idle{0,512}-NAME.
    for idle in 0 512; do
      "$PYTHON" -m pagedkv.bench.scheduler.host_ttft --preset llama-8b --device cuda \
        --dtype bfloat16 --prompt-len 4096 --host-kv-gib 4 --cuda-graphs "${GRAPHS:-all}" \
        --host-idle-offload-blocks "$idle" --output "$RESULTS/host-ttft-8b-idle$idle-$NAME.json"
    done
    ;;
  host-tier)
    # The executor's host tier, Llama-3-8B's shape: a 4,096-token prompt's
    # first token recomputed, from a GPU hit and from a host hit; decode
    # steps carrying offloads (under a minute). RUN numbers the file;
    # GRAPHS (all, decode or none: --cuda-graphs), CHUNKS (the host pool's
    # chunks of layers: --load-chunks) and PROFILE (a folder for the
    # profiler's traces of one GPU hit and one host hit: --profile).
    args=(--cuda-graphs "${GRAPHS:-all}")
    [[ -n ${CHUNKS:-} ]] && args+=(--load-chunks "$CHUNKS")
    [[ -n ${PROFILE:-} ]] && args+=(--profile "$PROFILE")
    "$PYTHON" -m pagedkv.bench.executor.host_tier --preset llama-8b "${args[@]}" \
      --output "$RESULTS/host-tier-executor-8b-${RUN:-1}-$NAME.json"
    ;;
  executor)
    "$PYTHON" -m pagedkv.bench.executor.bench --output "$RESULTS/executor-fused-$NAME.json"
    "$PYTHON" -m pagedkv.bench.executor.bench --batch 256 --output "$RESULTS/executor-256-$NAME.json"
    ;;
  steps)
    { "$PYTHON" -m pagedkv.bench.scheduler.steps --requests 64 256 &&
      "$PYTHON" -m pagedkv.bench.scheduler.steps --requests 64 256 --decode-window 8 |
      tail -n +2; } >"$RESULTS/scheduler-steps-$NAME.txt"
    "$PYTHON" -m pagedkv.bench.scheduler.tier_steps >"$RESULTS/scheduler-tier-steps-$NAME.txt"
    cat "$RESULTS/scheduler-steps-$NAME.txt" "$RESULTS/scheduler-tier-steps-$NAME.txt"
    ;;
  cold)
    # Each on a server started for it, so its first requests meet what the
    # warm-up left cold; the executor's log says "kernel compiled while
    # serving" for each kernel built after ready.
    bench --preset llama-1.1b --rates 4 --num-requests 160 --fixed-batch '' --no-hf \
      --decode-window 8 --output "$RESULTS/serve-cold-$NAME.json"
    bench --preset llama-1.1b --rates 4 --num-requests 160 --fixed-batch '' --no-hf \
      --decode-window 1 --output "$RESULTS/serve-cold-single-$NAME.json"
    ;;
  fixed)
    # Single steps (WINDOW=1) to serve-fixed-single-NAME, beside the windows'.
    single=''
    [[ "${WINDOW:-8}" == 1 ]] && single=single-
    bench --preset llama-1.1b --rates '' --no-hf \
      --fixed-batch 64x512x256,256x512x256,64x512x256,256x512x256 "${tuned[@]}" \
      --output "$RESULTS/serve-fixed-$single$NAME.json"
    ;;
  gateway)
    # Each shape twice, alternating, on prompts of their own: every row is a
    # gRPC run and, right after, the same shape through the gateway.
    # GRPC_TEXT=1: the gRPC runs ask for text too (serve-gateway-text-NAME).
    # The HTTP load comes from HTTP_CLIENTS processes (default 2), so that
    # reading 45,000 tokens/s of JSON events keeps each well under a core.
    # First PROBE requests (default 200) each way one at a time, alternating:
    # the latency the gateway adds with nothing else in flight.
    text=() suffix=''
    [[ "${GRPC_TEXT:-0}" == 1 ]] && text=(--grpc-text) suffix=-text
    bench --preset "${PRESET:-llama-1.1b}" --rates '' --gateway --no-hf "${text[@]}" \
      --http-clients "${HTTP_CLIENTS:-2}" --gateway-probe "${PROBE:-200}" \
      --fixed-batch "${BATCHES:-64x512x256,256x512x256,64x512x256,256x512x256}" "${tuned[@]}" \
      --output "$RESULTS/serve-gateway$suffix-$NAME.json"
    ;;
  swap)
    # The memory benchmark's chat, REQUESTS (default 128) at once on half the
    # GPU blocks they need: no host tier, then --host-loads never, always and
    # auto, each on a fresh server, REPEAT (default 1) times each (about two
    # minutes). OUTPUT_FRACTION (default the chat's 0.125): each request's
    # share of its length generated; more preempts more. TAG, when set,
    # ends the file's name. File: swap[-TAG]-NAME.{json,md}.
    fraction=()
    [[ -n ${OUTPUT_FRACTION:-} ]] && fraction=(--output-fraction "$OUTPUT_FRACTION")
    "$PYTHON" -m pagedkv.common.cli bench swap --preset llama-1.1b --device "${DEVICE:-cuda}" \
      --dtype bfloat16 --num-requests "${REQUESTS:-128}" --repeat "${REPEAT:-1}" "${fraction[@]}" \
      --output "$RESULTS/swap${TAG:+-$TAG}-$NAME.json"
    ;;
  *)
    echo "run-serve-bench: 1b, 8b, 256, sweep, timeline, gemm, executor, steps, cold," \
      "fixed, gateway, host-tier, host-ttft, host-ttft-idle, host-tier-serve or swap, not $1" >&2
    exit 2
    ;;
esac
