"""The resume rules of pagedkv.common.resume: which failures break a stream,
how targets are given, and which targets a stream passes over. The SDK's
resuming itself, over scripted and real schedulers: tests/client/test_resume.py."""

from __future__ import annotations

import grpc
import pytest

from pagedkv.common.resume import TargetHealth, is_stream_break, parse_targets


def test_breaks_are_unavailable_or_lost_transport_only() -> None:
    code = grpc.StatusCode
    assert is_stream_break(code.UNAVAILABLE, "no executor is available")
    assert is_stream_break(code.UNKNOWN, "Stream removed")
    assert is_stream_break(code.UNKNOWN, "Received RST_STREAM with error code 2")
    assert not is_stream_break(code.UNKNOWN, "Exception iterating responses: boom")
    for other in (code.INTERNAL, code.CANCELLED, code.DEADLINE_EXCEEDED, code.INVALID_ARGUMENT):
        assert not is_stream_break(other, "Socket closed")


def test_targets_are_a_list_or_comma_separated() -> None:
    assert parse_targets("a,b:7") == ("a:50051", "b:7")
    assert parse_targets(["a", " b:7 "]) == ("a:50051", "b:7")
    assert parse_targets("ipv4:1.2.3.4:5,1.2.3.5:5") == ("ipv4:1.2.3.4:5,1.2.3.5:5",)
    with pytest.raises(ValueError, match="target"):
        parse_targets(" , ")


def test_targets_that_broke_a_stream_are_passed_over_until_they_answer() -> None:
    health = TargetHealth(3, cooldown_s=60.0)
    assert [health.pick() for _ in range(3)] == [0, 1, 2]
    health.broke(1)
    assert [health.pick() for _ in range(3)] == [0, 2, 2]  # 1's turn goes to 2
    assert health.next_after(0) == 2
    health.broke(0)
    health.broke(2)
    assert health.next_after(2) == 0  # all cooling down: plain round robin
    health.answered(1)
    assert health.next_after(0) == 1
