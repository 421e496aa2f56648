"""A Prometheus histogram that takes many equal observations in one call.

prometheus_client's ``Histogram.observe`` costs about a microsecond and a
half and takes one value; the scheduler's inter-token latency gets one value
per generation per step (hundreds a step) and, from a decode window, k equal
gaps at once. ``BulkHistogram`` keeps its own bucket counts (one bisect and
two additions per call, whatever the count) and is exposed through the
library's collector interface, with the ``_bucket``, ``_count``, ``_sum``
and ``_created`` samples of a ``Histogram`` of the same name and edges.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BulkHistogram(Collector):
    """A label-less histogram over ``buckets`` (upper edges, ascending; +Inf
    is added), registered in ``registry``. Observed on any thread, collected
    on the scraping one."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        edges = [float(b) for b in buckets]
        if edges != sorted(edges) or len(set(edges)) != len(edges):
            raise ValueError(f"{name}: bucket edges must be strictly ascending")
        self.name = name
        self.documentation = documentation
        self._edges = edges if edges and math.isinf(edges[-1]) else [*edges, math.inf]
        self._counts = [0] * len(self._edges)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` (a bucket's edge is inclusive)."""
        i = bisect.bisect_left(self._edges, value)
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for edge, count in zip(self._edges, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(edge), cumulative))  # type: ignore[no-untyped-call]
        family = HistogramMetricFamily(
            self.name, self.documentation, buckets=buckets, sum_value=total
        )
        family.add_sample(f"{self.name}_created", {}, self._created)
        yield family
