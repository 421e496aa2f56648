"""structlog configured in one place: JSON lines for services, console for the CLI."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["json", "console"]


def configure_logging(fmt: LogFormat = "console", level: str = "INFO") -> None:
    """Sets up structlog (and the stdlib root logger) for this process.

    Services call it with ``"json"`` (one JSON object per line on stderr, for
    log collectors); the CLI with ``"console"``. Calling it again replaces the
    previous configuration.
    """
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(message)s", force=True)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to a component name."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(component=name)
    return logger
