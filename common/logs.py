"""One logging set-up for every pdserve process (router, workers; ``pdserve serve`` / ``launch`` pass their
``--log-level`` and ``--log-format`` on to them). Stdlib only.

``text``: ``TIME LEVEL LOGGER: message``. ``json``: one object per line, ``{"ts", "level", "logger", "msg"}``
plus the fields a record carries in ``extra={"fields": {...}}`` (the router's access log puts the request's
figures there, so a log pipeline need not parse the message).
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass

from common import flags

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


@dataclass(frozen=True, slots=True)
class LogConfig:
    """A process's logging flags (``add_log_args``)."""

    log_level: str = "INFO"
    """DEBUG, INFO, WARNING or ERROR"""
    log_format: str = "text"
    """text lines, or one JSON object per line"""


def add_log_args(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` (the fields of ``LogConfig``)."""
    flags.add_config_args(p, LogConfig, choices={"log_format": LOG_FORMATS})


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def log_args(level: str, fmt: str) -> list[str]:
    """The flags that hand a launcher's logging choice to a child process."""
    return ["--log-level", level, "--log-format", fmt]
