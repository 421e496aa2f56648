"""One local cluster per policy: a ``pagedkv serve --redis`` child process.

``LocalCluster`` starts ``pagedkv serve`` with a private Redis, the
executors, the schedulers and one router, waits for the router's ready line
and then until the router follows every executor's KV events (so the first
requests of a trace are routed on a complete, if empty, index). ``stop``
sends SIGTERM: serve stops its children and Redis itself.
"""

from __future__ import annotations

import asyncio
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc

from pagedkv.v1 import scheduler_pb2, scheduler_pb2_grpc

START_TIMEOUT_S = 600.0
ROUTER_READY = re.compile(r"pagedkv serve router 1/1 ready on ([\w.\-]+:\d+)")
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """What ``pagedkv serve`` starts (the same for every policy)."""

    model: str
    num_executors: int = 4
    num_schedulers: int = 2
    num_blocks: int = 1024  # per executor, the null block included
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    router_weights: str = ""  # PREFIX,LOAD,KV for the kv policy; empty: the router's defaults


def free_port_run(length: int) -> int:
    """A port p with p .. p + length - 1 free on 127.0.0.1 now (serve gives
    the router p and its schedulers the next ones for their metrics)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if base + length > 65535:
            continue
        try:
            for port in range(base + 1, base + length):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {length} consecutive free ports")


class LocalCluster:
    """A running ``pagedkv serve`` for one policy; ``router`` is its address
    and ``metrics_port`` its router's Prometheus port."""

    def __init__(self, shape: ClusterShape, policy: str) -> None:
        self.policy = policy
        self.metrics_port = free_port_run(1 + shape.num_schedulers)
        command = [sys.executable, "-m", "pagedkv.common.cli", "--log-level", "warning", "serve"]
        command += ["--redis", "--model", shape.model, "--port", "0"]
        command += ["--executors", str(shape.num_executors)]
        command += ["--schedulers", str(shape.num_schedulers), "--routers", "1"]
        command += ["--router-policy", policy, "--num-blocks", str(shape.num_blocks)]
        command += ["--max-num-seqs", str(shape.max_num_seqs)]
        command += ["--max-num-batched-tokens", str(shape.max_num_batched_tokens)]
        command += ["--metrics-port", str(self.metrics_port)]
        if shape.router_weights:
            command += ["--router-weights", shape.router_weights]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.router = self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"pagedkv serve ({self.policy}) not ready in time") from None
            if line is None:
                status = self.process.wait()
                raise RuntimeError(f"pagedkv serve ({self.policy}) exited with status {status}")
            match = ROUTER_READY.search(line)
            if match:
                return match.group(1)

    async def wait_following(self, num_executors: int, timeout: float = 60.0) -> None:
        """Returns once the router lists ``num_executors`` healthy executors
        and follows the KV events of as many; RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(self.router) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while True:
                stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
                healthy = sum(1 for e in stats.executors if e.healthy)
                following = stats.router.num_followed_executors
                if healthy == num_executors and following == num_executors:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"router sees {healthy} healthy executors and follows {following}, "
                        f"not {num_executors}"
                    )
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM to serve (it stops every child and its Redis); SIGKILL
        after ``STOP_TIMEOUT_S``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def router_metrics(port: int) -> dict[str, float]:
    """The router's counters, ``name{label value}`` -> value, ``name`` without
    its ``pagedkv_router_`` prefix (e.g. ``decisions{cache_hit}``,
    ``placement_hints{honoured}``, ``retries``)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter" or not family.name.startswith("pagedkv_router_"):
            continue
        name = family.name.removeprefix("pagedkv_router_")
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            label = ",".join(sample.labels.values())
            values[f"{name}{{{label}}}" if label else name] = sample.value
    return values
