"""structlog setup: JSON lines on stderr when not on a terminal (a traceback as the `exception` field), readable lines
on a terminal."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def setup_logging(process: str, **bound: object) -> structlog.stdlib.BoundLogger:
    level = getattr(logging, os.environ.get("ELASTIC_LOG_LEVEL", "INFO").upper(), logging.INFO)
    renderers = (
        [structlog.dev.ConsoleRenderer(colors=False)]
        if sys.stderr.isatty()
        else [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(process=process, **bound)
