"""structlog loggers for hearthlm. They go through the application's structlog config
(processors, output) but filter by our own level, HEARTHLM_LOG_LEVEL (default WARNING),
so an embedding app does not get per-step debug events unless it asks. structlog itself is
imported by the first event that passes the level (~40 ms that `import hearthlm` and a
quiet start need not pay)."""
from __future__ import annotations

import logging
import os

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "exception": logging.ERROR, "critical": logging.CRITICAL}


def _drop(*args, **kwargs) -> None:
    return None


class _Logger:
    """Filters by level without structlog; makes the structlog logger on the first event it lets by."""

    def __init__(self, name: str, level: int) -> None:
        self._name, self._level, self._real = name, level, None

    def __getattr__(self, attr: str):
        if _LEVELS.get(attr, logging.CRITICAL + 1) < self._level:
            return _drop
        if self._real is None:
            import structlog
            self._real = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(self._level),
                                               logger_name=self._name)
        return getattr(self._real, attr)


def get_logger(name: str):
    level = getattr(logging, os.environ.get("HEARTHLM_LOG_LEVEL", "WARNING").upper(), logging.WARNING)
    return _Logger(name, level)
