"""Process logging: text lines for a terminal, or JSON lines for a log pipeline, with the request id of the
request being served where there is one. Prompts and completions are never logged, in either format.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging

# The request the current task serves (the gateway sets it when it builds the wire request); JSON lines carry it.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("switchyard_request_id", default=None)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Paths probed or scraped every few seconds: their access lines drown everything else.
QUIET_PATHS = ("/healthz", "/readyz", "/metrics")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, request_id (when known), exception."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class QuietHealthChecks(logging.Filter):
    """Drops uvicorn access lines of ``QUIET_PATHS``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = args[2] if len(args) >= 3 else ""
        return not (isinstance(path, str) and path.split("?", 1)[0] in QUIET_PATHS)


def configure_logging(level: str, fmt: str = "text", health_checks: bool = False) -> None:
    """Set up the root logger once per process; uvicorn's loggers go through it too."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polling is not news
    if not health_checks:
        logging.getLogger("uvicorn.access").addFilter(QuietHealthChecks())

