"""Scheduler load reports in a real Redis: written when they change, read
back whole, gone with their member."""

from __future__ import annotations

from pagedkv.cluster.connection import connect
from pagedkv.cluster.keys import Keys
from pagedkv.cluster.load import ExecutorLoad, LoadPublisher, LoadReport, read_loads
from tests.cluster.conftest import run


def test_reports_are_written_on_change_and_read_back(redis_url: str) -> None:
    async def scenario() -> None:
        client = connect(redis_url)
        loads = [ExecutorLoad("e:1", "inc", 3, 1, 90, 127)]
        publisher = LoadPublisher(client, "s1", lambda: loads, refresh_s=60.0, ttl_ms=5000)
        assert await publisher.publish()
        assert not await publisher.publish()  # unchanged: nothing written
        loads = [ExecutorLoad("e:1", "inc", 4, 0, 80, 127, draining=True)]
        assert await publisher.publish()
        reports = await read_loads(client, ["s1", "s2"])
        assert list(reports) == ["s1"]
        report = reports["s1"]
        assert report.executors == tuple(loads) and report.executors[0].num_queued == 4
        assert 0 < await client.pttl(Keys().load("s1")) <= 5000
        await client.set(Keys().load("s2"), "not json")
        assert list(await read_loads(client, ["s1", "s2"])) == ["s1"]  # unreadable: left out
        await publisher.close()
        assert await read_loads(client, ["s1"]) == {}
        await client.aclose()

    run(scenario())


def test_a_report_round_trips_through_json() -> None:
    report = LoadReport("s", 12, (ExecutorLoad("a:1", "i", 1, 2, 3, 4),))
    assert LoadReport.from_json(report.to_json()) == report
