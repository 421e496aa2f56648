"""The command lines of ``pagedkv serve``'s children (and of the benchmarks
that start the same stack): executors, child schedulers, routers and the
gateway, each made from ``pagedkv serve``'s arguments. Pure: nothing here
starts a process (children.py does); the ports of the children follow the
order that serve.py documents (routers first, then the schedulers).
"""

from __future__ import annotations

import argparse
import sys


def executor_commands(args: argparse.Namespace, model: str) -> list[list[str]]:
    backend = args.kernel_backend or ("torch" if args.device == "cpu" else "triton")
    commands = []
    for i in range(args.executors):
        device = args.device
        if device == "cuda" and args.executors > 1:
            device = f"cuda:{i}"
        command = [sys.executable, "-m", "pagedkv.executor", "--model", model, "--port", "0"]
        command += ["--log-format", args.log_format, "--log-level", args.log_level]
        command += ["--device", device, "--kernel-backend", backend, "--dtype", args.dtype]
        command += ["--load-format", args.load_format, "--no-progress"]
        command += ["--max-num-rows", str(args.max_num_seqs)]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.num_blocks is not None:
            command += ["--num-blocks", str(args.num_blocks)]
        for flag, value in (
            ("--gpu-memory-utilization", getattr(args, "gpu_memory_utilization", None)),
            ("--max-model-len", getattr(args, "max_model_len", None)),
            ("--host-kv-gib", getattr(args, "host_kv_gib", None)),
            ("--kv-cache-dtype", getattr(args, "kv_cache_dtype", None)),
            ("--kv-cache-rotation", getattr(args, "kv_cache_rotation", None)),
        ):
            if value is not None:
                command += [flag, str(value)]
        if args.enforce_eager:
            command.append("--enforce-eager")
        if getattr(args, "cuda_graphs", "all") != "all":
            command += ["--cuda-graphs", args.cuda_graphs]
        if getattr(args, "redis_url", None):
            command += ["--redis-url", args.redis_url, *_redis_secrets(args)]
        commands.append(command)
    return commands


def _redis_secrets(args: argparse.Namespace) -> list[str]:
    """``--redis-password-file`` and ``--redis-tls-ca``, as given (or, for
    ``--redis``, the private Redis' password file)."""
    options = []
    for flag in ("--redis-password-file", "--redis-tls-ca"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            options += [flag, value]
    return options


def _server_security(args: argparse.Namespace, health_port: int | None) -> list[str]:
    """The TLS and token options of a child serving the client-facing API,
    as ``pagedkv serve`` has them; ``--health-port`` ``health_port``."""
    options = []
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--auth-token-file"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            options += [flag, value]
    if health_port is not None:
        options += ["--health-port", str(health_port)]
    return options


def scheduler_commands(args: argparse.Namespace, model: str, redis_url: str) -> list[list[str]]:
    """The ``--schedulers N`` - 1 child schedulers: this command's scheduler
    options, ports after this one's (any free port when ``--port`` is 0),
    metrics ports likewise."""
    commands = []
    base = args.port + args.routers if args.port else 0
    for i in range(1, args.schedulers):
        command = [sys.executable, "-m", "pagedkv.common.cli"]
        command += ["--log-format", args.log_format, "--log-level", args.log_level, "scheduler"]
        command += ["--redis-url", redis_url, "--lease-ttl", str(args.lease_ttl), "--model", model]
        command += ["--host", args.host, "--port", str(base + i if base else 0)]
        command += ["--max-num-seqs", str(args.max_num_seqs)]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        command += ["--decode-window", str(args.decode_window)]
        if args.pipeline_depth is not None:  # else the window's default, there too
            command += ["--pipeline-depth", str(args.pipeline_depth)]
        command += ["--stream-pace-us", str(args.stream_pace_us)]
        command += ["--host-loads", args.host_loads, "--host-offload", args.host_offload]
        command += ["--host-idle-offload-blocks", str(args.host_idle_offload_blocks)]
        command += ["--executor-timeout", str(args.executor_timeout)]
        command += ["--drain-timeout", str(args.drain_timeout)]
        if args.metrics_port is not None:
            port = args.metrics_port + args.routers + i if args.metrics_port else 0
            command += ["--metrics-port", str(port)]
        command += _redis_secrets(args)
        health_port = getattr(args, "health_port", None)
        command += _server_security(args, health_port and health_port + args.routers + i)
        commands.append(command)
    return commands


def router_commands(args: argparse.Namespace, model: str, redis_url: str) -> list[list[str]]:
    """The ``--routers R`` routers: ports ``--port``.. (the schedulers' come
    after), metrics ports likewise."""
    commands = []
    for i in range(args.routers):
        command = [sys.executable, "-m", "pagedkv.common.cli"]
        command += ["--log-format", args.log_format, "--log-level", args.log_level, "router"]
        command += ["--redis-url", redis_url, "--model", model, "--policy", args.router_policy]
        command += ["--host", args.host, "--port", str(args.port + i if args.port else 0)]
        command += ["--drain-timeout", str(args.drain_timeout)]
        if args.router_weights:
            values = args.router_weights.split(",")
            flags = (
                "--weight-prefix",
                "--weight-load",
                "--weight-kv",
                "--load-bound",
                "--load-slack",
            )
            for flag, value in zip(flags, values, strict=False):
                command += [flag, value]
        if args.metrics_port is not None:
            port = args.metrics_port + i if args.metrics_port else 0
            command += ["--metrics-port", str(port)]
        command += _redis_secrets(args)
        health_port = getattr(args, "health_port", None)
        command += _server_security(args, health_port and health_port + i)
        for flag in ("--scheduler-tls-ca", "--scheduler-tls-cert", "--scheduler-tls-key"):
            value = getattr(args, flag[2:].replace("-", "_"), None)
            if value is not None:
                command += [flag, value]
        if getattr(args, "scheduler_tls_server_name", None):
            command += ["--scheduler-tls-server-name", args.scheduler_tls_server_name]
        if getattr(args, "auth_token_file", None):  # its first token opens the schedulers
            command += ["--scheduler-token-file", args.auth_token_file]
        commands.append(command)
    return commands


def gateway_command(args: argparse.Namespace, model: str, targets: list[str]) -> list[str]:
    """``--http-port``'s gateway in front of ``targets`` (the routers, or
    every scheduler): on ``--host``, with the stack's tokens (the file's
    first token opens the targets too) and, towards a TLS stack, the
    ``--scheduler-tls-*`` material the routers use."""
    command = [sys.executable, "-m", "pagedkv.common.cli"]
    command += ["--log-format", args.log_format, "--log-level", args.log_level, "gateway"]
    command += ["--target", ",".join(targets), "--model", model]
    command += ["--host", args.host, "--port", str(args.http_port)]
    command += ["--drain-timeout", str(args.drain_timeout)]
    if getattr(args, "served_model_name", None):
        command += ["--served-model-name", args.served_model_name]
    if getattr(args, "auth_token_file", None):
        command += ["--auth-token-file", args.auth_token_file, "--token-file", args.auth_token_file]
    for flag in ("tls-ca", "tls-cert", "tls-key", "tls-server-name"):
        value = getattr(args, f"scheduler_{flag.replace('-', '_')}", None)
        if value is not None:
            command += [f"--{flag}", value]
    return command
