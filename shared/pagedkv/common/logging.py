"""structlog configured in one place: JSON lines for services, console for the CLI."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["json", "console"]


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is written, not when
    logging was configured (a replaced stderr, e.g. a test's capture that has
    since been closed, never receives lines meant for its successor)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(fmt: LogFormat = "console", level: str = "INFO") -> None:
    """Sets up structlog (and the stdlib root logger) for this process.

    Services call it with ``"json"`` (one JSON object per line on stderr, for
    log collectors); the CLI with ``"console"``. With ``"json"``, records of
    the standard library's loggers (libraries such as transformers and grpc)
    and Python warnings are JSON lines too, their ``component`` the logger's
    name. Calling it again replaces the previous configuration.
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
        # One write per line (message and newline together), so the lines of
        # processes sharing a stderr file never interleave.
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(_CurrentStderr())
    if fmt == "json":
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[
                    structlog.stdlib.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    _component_from_record,
                ],
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    renderer,
                ],
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=numeric_level, handlers=[handler], force=True)
    logging.captureWarnings(fmt == "json")


def _component_from_record(
    logger: object, method_name: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """A standard-library record's logger name as its ``component``."""
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("component", record.name)
    return event_dict


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to a component name."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(component=name)
    return logger
