"""JSON logs, one object per line, carrying the request id of the request being served."""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("rev88_request_id", default=None)

# LogRecord attributes that are not "extra" fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            doc["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


_HANDLER_MARK = "_rev88_json"


def configure_logging(level: str, loggers: tuple[str, ...] = ("rev88",)) -> None:
    """JSON to stderr for ``loggers`` (idempotent: one handler each, whatever the call count)."""
    for name in loggers:
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        if not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
            if name != "rev88":  # uvicorn's own handlers would print the same line twice
                logger.handlers.clear()
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(JsonFormatter())
            setattr(handler, _HANDLER_MARK, True)
            logger.addHandler(handler)
        logger.propagate = False
