"""structlog loggers for hearthlm. They go through the application's structlog config
(processors, output) but filter by our own level, HEARTHLM_LOG_LEVEL (default WARNING),
so an embedding app does not get per-step debug events unless it asks."""
from __future__ import annotations

import logging
import os

import structlog


def get_logger(name: str):
    level = getattr(logging, os.environ.get("HEARTHLM_LOG_LEVEL", "WARNING").upper(), logging.WARNING)
    return structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(level),
                                 logger_name=name)
