"""Process logging: text or JSON lines, every record tagged with the current request id."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

#: Set by the request-id interceptor for the duration of one RPC.
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


_base_factory = logging.getLogRecordFactory()


def _record_with_request_id(*args, **kwargs) -> logging.LogRecord:
    record = _base_factory(*args, **kwargs)
    record.request_id = request_id_var.get()
    return record


def install_request_id_records() -> None:
    """Make every log record carry ``request_id`` (idempotent)."""
    logging.setLogRecordFactory(_record_with_request_id)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str = "text", level: str = "INFO", service: str = "") -> None:
    """Send logs to stderr in ``fmt`` ("text" or "json"); replaces earlier handlers."""
    install_request_id_records()
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        tag = f"{service} " if service else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s [%(request_id)s] %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
