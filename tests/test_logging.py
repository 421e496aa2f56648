"""structlog is configured in one place: JSON lines for services, console for the CLI."""

from __future__ import annotations

import json
import subprocess
import sys


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


def test_cli_logs_readable_lines() -> None:
    text = _log_with("console")
    assert "hello" in text and "request_id" in text
    assert not text.lstrip().startswith("{")
