"""``BulkHistogram`` exposes what prometheus_client's ``Histogram`` of the
same name and edges exposes for the same observations."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pagedkv.scheduler.histogram import BulkHistogram

EDGES = (0.01, 0.02, 0.05, 1.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_bulk_observations_expose_the_samples_of_one_by_one_observations() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("x_seconds", "x", EDGES, ours)
    single = Histogram("x_seconds", "x", buckets=EDGES, registry=theirs)
    # An edge is inclusive; past the last edge is +Inf.
    for value, count in ((0.01, 3), (0.015, 1), (0.05, 2), (3.0, 1), (0.0, 4)):
        bulk.observe(value, count)
        for _ in range(count):
            single.observe(value)
    assert _samples(ours) == pytest.approx(_samples(theirs))
    assert ours.get_sample_value("x_seconds_bucket", {"le": "0.01"}) == 7
    assert ours.get_sample_value("x_seconds_count") == 11
    assert ours.get_sample_value("x_seconds_created") is not None


def test_bucket_edges_must_ascend() -> None:
    with pytest.raises(ValueError, match="ascending"):
        BulkHistogram("y", "y", (0.1, 0.05), CollectorRegistry())
