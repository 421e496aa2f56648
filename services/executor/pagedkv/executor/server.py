"""``pagedkv executor``: load, size, warm up, serve until SIGTERM or SIGINT.

With ``--redis-url``, the executor registers in the cluster registry once it
serves, heartbeats from a daemon thread (a Redis outage is logged, never
fatal: it serves anyway and registers again when Redis is back), and
unregisters on SIGTERM/SIGINT before the server stops.

SIGTERM (or SIGINT) drains first: health turns NOT_SERVING and every step's
response says the executor drains, so its owner admits nothing new there and
lets the running requests finish (moving the rest before the time is up); the
executor stops once no row is live, after ``--drain-timeout`` seconds, or on a
second signal."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    from pagedkv.cluster.registry import ExecutorRegistration
    from pagedkv.executor.engine import Executor

SWITCH_INTERVAL_S = 0.0002
"""The interpreter's thread switch interval in an executor process (Python's
default is 5 ms); on the H200, a 64-row decode stream took about 5% less
time a step with it."""


def serve(args: argparse.Namespace) -> int:
    """Runs an executor process; prints ``executor ready on HOST:PORT ...``
    on stdout once it serves."""
    if args.kernel_backend == "triton" and args.device == "cpu":
        # Triton runs on the CPU only through its interpreter, which must be
        # chosen before any kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from transformers.utils import logging as hf_logging

    from pagedkv.common.logging import get_logger
    from pagedkv.common.ports import ListenError, check_free
    from pagedkv.executor.block_store import HostTierTooSmall
    from pagedkv.executor.engine import Executor
    from pagedkv.executor.metrics import ExecutorMetrics
    from pagedkv.executor.model_runner import ModelRunner
    from pagedkv.executor.runner_config import RunnerConfig
    from pagedkv.executor.servicer import build_server

    hf_logging.set_verbosity_error()
    log = get_logger("pagedkv.executor")
    try:
        config = RunnerConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_rotation=args.kv_cache_rotation,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kernel_backend=args.kernel_backend,
            load_format=args.load_format,
            max_num_rows=args.max_num_rows,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_logprobs=args.max_logprobs,
            seed=args.seed,
            cuda_graphs=not args.enforce_eager,
            mixed_graphs=args.cuda_graphs == "all",
            fused_ops=args.fused_ops == "on",
            host_kv_gib=args.host_kv_gib,
        )
        # Refused before the model loads; the server's own bind still decides.
        check_free("--port", args.host, args.port)
        check_free("--health-port", args.host, getattr(args, "health_port", None))
        check_free("--metrics-port", args.host, args.metrics_port)
    except (ValueError, ListenError) as exc:
        print(f"pagedkv executor: {exc}", file=sys.stderr)
        return 2
    # No progress bars (ours or transformers') among JSON log lines, or under
    # pagedkv serve (--no-progress), which reports start-up itself.
    quiet = args.log_format == "json" or not args.progress
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        with tqdm(
            total=2, desc="executor: loading the model", file=sys.stderr, disable=quiet
        ) as bar:
            runner = ModelRunner(config)
            bar.set_description("executor: warming up")
            bar.update()
            runner.warm_up()  # logs what it ran and its time, before ready
            bar.update()
    except HostTierTooSmall as exc:  # known once the model's blocks are
        print(f"pagedkv executor: {exc}", file=sys.stderr)
        return 2
    executor = Executor(runner, args.model)
    # The step stream's threads (reader, waiter, launcher, gRPC's) hand the
    # interpreter to each other every step: a thread woken by a request or a
    # finished step should not wait the default 5 ms for a busy one to yield.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    security = getattr(args, "security", None)
    try:
        server, port = build_server(executor, f"{args.host}:{args.port}", security)
    except ListenError as exc:
        print(f"pagedkv executor: {exc}", file=sys.stderr)
        return 2
    metrics, extra = None, ""
    if args.metrics_port is not None:
        metrics = ExecutorMetrics()
        try:
            extra = f", metrics on :{metrics.serve(args.metrics_port, args.host)}"
        except ListenError as exc:
            print(f"pagedkv executor: {exc}", file=sys.stderr)
            server.stop(grace=0).wait()
            return 2
    kv_mib = runner.kv.num_bytes / 2**20
    num_host = runner.limits.num_host_blocks
    host = f", {num_host} host blocks" if num_host else ""
    print(
        f"executor ready on {args.host}:{port} ({runner.limits.num_blocks} blocks of "
        f"{config.block_size} tokens, {kv_mib:.1f} MiB KV{host}; {args.model} on {runner.device}, "
        f"{config.kernel_backend} kernels{', fused ops' if runner.fused else ''}{extra})",
        flush=True,
    )
    log.info(
        "executor serving", port=port, num_blocks=runner.limits.num_blocks, num_host_blocks=num_host
    )
    signals: list[int] = []
    stop = threading.Event()

    def on_signal(signum: int, _: object) -> None:
        signals.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    registration = None
    if args.redis_url is not None:
        address = args.advertise_address or f"{_advertised_host(args.host)}:{port}"
        registration = _register(executor, args.redis_url, address)
    stop.wait()
    _drain(executor, args.drain_timeout, signals, log)
    if registration is not None:
        registration.close()
    server.stop(grace=2).wait()
    if metrics is not None:
        metrics.close()
    return 0


def _drain(executor: Executor, timeout: float, signals: list[int], log: Any) -> None:
    """Lets the owner finish the executor's rows (its steps now say the
    executor drains; health is NOT_SERVING) until it has nothing left here
    (``Executor.drained``), ``timeout`` seconds pass, or a second signal comes."""
    executor.drain(timeout)
    log.info("executor draining", live_rows=executor.num_live_rows, timeout_s=timeout)
    deadline = time.monotonic() + timeout
    while not executor.drained() and len(signals) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    log.info("executor stopping", live_rows=executor.num_live_rows)


def _advertised_host(host: str) -> str:
    """``host``, or the machine's name when ``host`` listens on every address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]", "") else host


def _register(executor: Executor, redis_url: str, address: str) -> ExecutorRegistration:
    """Starts registering ``executor`` under ``address`` (in the background)."""
    from pagedkv.cluster.connection import connect_sync, redacted
    from pagedkv.cluster.registry import ExecutorRecord, ExecutorRegistration
    from pagedkv.common.logging import get_logger

    info = executor.get_info()
    record = ExecutorRecord(
        address=address,
        incarnation_id=info.incarnation_id,
        model_id=info.model_id,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        bytes_per_block=info.bytes_per_block,
        max_num_rows=info.max_num_rows,
        max_model_len=info.max_model_len,
        registered_at_ms=int(time.time() * 1000),
    )
    get_logger("pagedkv.executor").info(
        "executor registering", redis=redacted(redis_url), address=address
    )
    registration = ExecutorRegistration(connect_sync(redis_url), record)
    registration.start()
    return registration
