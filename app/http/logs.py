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
        return json.dumps(doc, default=str)  # the lines' format ("key": value) is what operators grep


_HANDLER_MARK = "_rev88_json"


def _json_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    setattr(handler, _HANDLER_MARK, True)
    return handler


def configure_logging(level: str) -> None:
    """JSON lines on stderr for the service ("rev88.*") and for uvicorn's own messages.

    uvicorn's access log is switched off: the service logs every request itself, with
    its request id (app/http/middleware.py). Idempotent: one JSON handler per logger.
    """
    ours = logging.getLogger("rev88")
    ours.setLevel(level.upper())
    ours.propagate = False
    if not any(getattr(h, _HANDLER_MARK, False) for h in ours.handlers):
        ours.addHandler(_json_handler())
    server = logging.getLogger("uvicorn")  # "uvicorn.error" propagates here; its level stays uvicorn's
    if not any(getattr(h, _HANDLER_MARK, False) for h in server.handlers):
        server.handlers = [_json_handler()]
    server.propagate = False
    logging.getLogger("uvicorn.access").disabled = True
