"""Prometheus metrics of the gateway, in a registry of its own, served on
``GET /metrics`` of the gateway's own port (plaintext text format, no token).

Names (``_total`` on counters as exposed):

* ``pagedkv_gateway_requests_total{endpoint, status}``: answered requests by
  endpoint ("completions", "chat", "models", ...) and HTTP status (a stream
  counts as 200 once its headers went out, whatever ended it);
* ``pagedkv_gateway_stream_errors_total{endpoint}``: streams that ended with
  an error event after they started;
* ``pagedkv_gateway_disconnects_total{endpoint}``: requests whose client
  went away before the end (their gRPC calls were cancelled);
* ``pagedkv_gateway_output_tokens_total{endpoint}``: tokens generated;
* ``pagedkv_gateway_time_to_first_token_seconds{endpoint}``: from the
  request's arrival to its first text (streams and whole responses alike);
* ``pagedkv_gateway_request_seconds{endpoint}``: from arrival to the end;
* ``pagedkv_gateway_open_streams``: requests running now.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayMetrics:
    """The gateway's metrics; one per app (its own registry, so several
    apps in one process, as in tests, do not clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pagedkv_gateway_requests",
            "Requests answered, by endpoint and HTTP status.",
            ("endpoint", "status"),
            registry=r,
        )
        self.stream_errors = Counter(
            "pagedkv_gateway_stream_errors",
            "Streams that ended with an error event after they started.",
            ("endpoint",),
            registry=r,
        )
        self.disconnects = Counter(
            "pagedkv_gateway_disconnects",
            "Requests whose client went away before the end.",
            ("endpoint",),
            registry=r,
        )
        self.output_tokens = Counter(
            "pagedkv_gateway_output_tokens", "Tokens generated.", ("endpoint",), registry=r
        )
        self.ttft = Histogram(
            "pagedkv_gateway_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first text.",
            ("endpoint",),
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "pagedkv_gateway_request_seconds",
            "Seconds from a request's arrival to its end.",
            ("endpoint",),
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.open_streams = Gauge(
            "pagedkv_gateway_open_streams", "Generation requests running now.", registry=r
        )

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
