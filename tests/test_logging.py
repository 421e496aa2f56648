"""structlog is configured in one place: JSON lines for services, console for the CLI."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from pagedkv.common.logging import configure_logging, get_logger


def _log_with(fmt: str) -> str:
    code = (
        "from pagedkv.common.logging import configure_logging, get_logger\n"
        f"configure_logging({fmt!r})\n"
        "get_logger('test').info('hello', request_id='r-1')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stderr


def test_services_log_one_json_object_per_line() -> None:
    (line,) = _log_with("json").splitlines()
    record = json.loads(line)
    assert record["event"] == "hello"
    assert record["request_id"] == "r-1"
    assert record["component"] == "test"
    assert record["level"] == "info"
    assert "timestamp" in record


def test_json_logs_turn_library_records_and_warnings_into_json_lines() -> None:
    code = (
        "import logging, warnings\n"
        "from pagedkv.common.logging import configure_logging\n"
        "configure_logging('json')\n"
        "logging.getLogger('some.library').warning('careful %s', 'now')\n"
        "warnings.warn('old API')\n"
        "try:\n"
        "    1 / 0\n"
        "except ZeroDivisionError:\n"
        "    logging.getLogger('some.library').exception('failed')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    library, warning, failure = (json.loads(line) for line in out.stderr.splitlines())
    assert library["event"] == "careful now"
    assert library["component"] == "some.library" and library["level"] == "warning"
    assert "timestamp" in library
    assert warning["component"] == "py.warnings" and "old API" in warning["event"]
    assert failure["level"] == "error" and "ZeroDivisionError" in failure["exception"]


def test_cli_logs_readable_lines() -> None:
    text = _log_with("console")
    assert "hello" in text and "request_id" in text
    assert not text.lstrip().startswith("{")


def test_log_lines_go_to_the_stderr_of_the_moment_not_of_the_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("json")
    try:
        first.close()  # e.g. the capture of a test that has ended
        monkeypatch.setattr(sys, "stderr", second)
        get_logger("test").info("after the switch")
        logging.getLogger("library").warning("a library line")
    finally:
        configure_logging("console")
    lines = [json.loads(line) for line in second.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["after the switch", "a library line"]
