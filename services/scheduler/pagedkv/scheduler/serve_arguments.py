"""What ``pagedkv serve``'s arguments must be, checked before any child
starts; each problem said in one line naming the option."""

from __future__ import annotations

import argparse
import shutil

from pagedkv.cluster.connection import check_redis_url
from pagedkv.common.cli import ModelArgumentError, check_model_argument, installed
from pagedkv.common.ports import ListenError, check_free
from pagedkv.common.server_security import server_security_from_args


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line; None when nothing is.
    Takes a positional MODEL as ``args.model``; reads the TLS and token
    files (a bad one is named here, before any child starts)."""
    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            return f"MODEL {args.model_path} and --model {args.model}: give one"
        args.model = args.model_path
    if args.executors < 1:
        return f"--executors {args.executors}: at least 1"
    if args.num_blocks is not None and args.num_blocks < 1:
        return f"--num-blocks {args.num_blocks}: at least 1"
    if args.gpu_memory_utilization is not None:
        if args.num_blocks is not None:
            return "give --num-blocks or --gpu-memory-utilization, not both"
        if not 0 < args.gpu_memory_utilization <= 1:
            return f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]"
    if args.host_kv_gib is not None and args.host_kv_gib < 0:
        return f"--host-kv-gib {args.host_kv_gib}: at least 0"
    if args.max_model_len is not None and args.max_model_len < 1:
        return f"--max-model-len {args.max_model_len}: at least 1"
    if args.redis and args.redis_password_file:
        return "--redis makes its own password: --redis-password-file is for --redis-url"
    if (args.redis_password_file or args.redis_tls_ca) and not args.redis_url:
        return "--redis-password-file and --redis-tls-ca need --redis-url"
    if args.routers and args.tls_cert and not args.scheduler_tls_ca:
        return (
            "--routers with --tls-cert needs --scheduler-tls-ca (the CA the routers check "
            "the schedulers' certificate with)"
        )
    if args.routers and args.tls_ca and not (args.scheduler_tls_cert and args.scheduler_tls_key):
        return (
            "--routers with --tls-ca needs --scheduler-tls-cert and --scheduler-tls-key (the "
            "client certificate the routers present to the schedulers, which require one)"
        )
    problem = _http_problem(args)
    if problem is not None:
        return problem
    if args.model is not None:
        try:
            check_model_argument(args.model)
        except ModelArgumentError as exc:
            return f"--model {args.model}: {exc}"
    if args.redis and args.redis_url:
        return "give --redis (a private redis-server) or --redis-url URL, not both"
    if args.schedulers < 1:
        return f"--schedulers {args.schedulers}: at least 1"
    if args.routers < 0:
        return f"--routers {args.routers}: at least 0"
    if args.routers and not (args.redis or args.redis_url):
        return (
            f"--routers {args.routers} needs a cluster: give --redis-url URL "
            "or --redis (a private redis-server)"
        )
    if args.router_weights:
        try:
            weights = [float(w) for w in args.router_weights.split(",")]
        except ValueError:
            weights = []
        if (
            not 3 <= len(weights) <= 5
            or not all(w >= 0 for w in weights[:3] + weights[4:])
            or not all(b >= 1 for b in weights[3:4])
        ):
            return (
                f"--router-weights {args.router_weights}: three weights >= 0, then optionally "
                "a load bound >= 1 and a load slack >= 0, PREFIX,LOAD,KV[,BOUND[,SLACK]]"
            )
    if args.schedulers > 1 and not (args.redis or args.redis_url):
        return (
            f"--schedulers {args.schedulers} needs a cluster: give --redis-url URL "
            "or --redis (a private redis-server)"
        )
    if args.redis and shutil.which("redis-server") is None:
        return "--redis: redis-server is not installed (not on PATH; `make redis` installs it)"
    if args.redis_url:
        try:
            check_redis_url(args.redis_url)
        except ValueError as exc:
            return f"--redis-url: {exc}"
    try:
        server_security_from_args(args, require_ca=False)
    except ValueError as exc:
        return str(exc)
    return _port_in_use(args)


def _http_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--http-port`` (the gateway's options), or None."""
    http_port = getattr(args, "http_port", None)
    if http_port is None:
        if getattr(args, "served_model_name", None):
            return "--served-model-name needs --http-port (it names the model of the HTTP API)"
        return None
    if http_port < 0:
        return f"--http-port {http_port}: a port, or 0 for any free one"
    if not installed("pagedkv.gateway"):
        return "--http-port needs the gateway part (pagedkv-gateway) installed"
    if args.tls_cert and not args.scheduler_tls_ca:
        return (
            "--http-port with --tls-cert needs --scheduler-tls-ca (the CA the gateway checks "
            "the schedulers' and routers' certificates with)"
        )
    if args.tls_ca and not (args.scheduler_tls_cert and args.scheduler_tls_key):
        return (
            "--http-port with --tls-ca needs --scheduler-tls-cert and --scheduler-tls-key (the "
            "client certificate the gateway presents to the schedulers and routers)"
        )
    try:
        check_free("--http-port", args.host, http_port)
    except ListenError as exc:
        return str(exc)
    return None


def _port_in_use(args: argparse.Namespace) -> str | None:
    """The first port this command's servers would listen on that another
    process holds, in one line: ``--port``.. (the routers', then the
    schedulers'), the metrics and health ports likewise; None when none is."""
    num = args.routers + args.schedulers
    bases = {
        "--port": args.port,
        "--metrics-port": args.metrics_port,
        "--health-port": getattr(args, "health_port", None),
    }
    for flag, base in bases.items():
        for port in range(base, base + num) if base else ():
            try:
                check_free(flag, args.host, port)
            except ListenError as exc:
                return str(exc)
    return None
