"""Prometheus metrics of the executor (``--metrics-port``), in a registry of
its own.

* histogram (seconds): ``pagedkv_executor_interpreter_lag_seconds``: how late
  a thread that asked to wake every 0.1 s got to run. The executor has no
  event loop: its gRPC handlers, its step stream's threads and its
  registration heartbeat share one interpreter, and a thread that holds the
  GIL long delays all the others, the heartbeat included. This is its
  counterpart of the scheduler's and the router's event-loop lag
  (``pagedkv.common.loop_lag``).
"""

from __future__ import annotations

from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server

from pagedkv.common.loop_lag import LAG_BUCKETS, ThreadLag
from pagedkv.common.ports import listening


class ExecutorMetrics:
    """The executor's metrics; ``serve`` exposes them and starts measuring,
    ``close`` stops both."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._interpreter_lag = Histogram(
            "pagedkv_executor_interpreter_lag_seconds",
            "How late a thread due every 0.1 s got to run.",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.lag = ThreadLag(self._interpreter_lag.observe)
        self._servers: list[tuple[WSGIServer, Thread]] = []

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves ``/metrics`` on ``host:port`` (0: any free port) in a daemon
        thread and starts measuring; returns the port bound. ListenError
        (``--metrics-port``) if the port cannot be had."""
        with listening("--metrics-port", host, port):
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._servers.append((server, thread))
        self.lag.start()
        return int(server.server_port)

    def close(self) -> None:
        self.lag.stop()
        while self._servers:
            server, thread = self._servers.pop()
            server.shutdown()
            server.server_close()
            thread.join()
