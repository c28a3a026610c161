"""The task row in SQL (both engines), derived from its one definition (app/task_row.py): the
column lists the ledgers read, and the one mapper from a row to a ``TaskRecord``, with the codecs
of the JSON columns and of the stored answer."""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any

import numpy as np
import orjson

from ..task_row import LISTED_COLUMNS, TaskRecord

ANSWER_CODEC = "zlib+json"
# An answer whose predictions are an integer array of class indices (< 256), stored compactly: the
# rest of the answer as zlib-compressed JSON with "predictions": null in its place, then the
# predictions as one byte each (a launch's answers are written this way: app/tasks/launches.py).
# Decoded, the predictions are a list again, at their place: the same document.
COMPACT_CODEC = "zlib+json;predictions=u8"

# what lists and summaries read, in the definition's order; a full read adds the answer and its codec
SUMMARY_COLUMNS = ", ".join(c.name for c in LISTED_COLUMNS)
ALL_COLUMNS = SUMMARY_COLUMNS + ", answer, answer_codec"
SUMMARY_WIDTH = len(LISTED_COLUMNS)  # (a statement that returns more after them finds them from here)
_JSON = frozenset(c.name for c in LISTED_COLUMNS if c.kind == "json")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def answer_columns(answer: dict | None) -> tuple[str | None, float | None, float | None]:
    """(predictions_sha256, run_ms, energy_j) of an answer, as the list columns keep them."""
    if answer is None:
        return None, None, None
    sha = answer.get("predictions_sha256") if isinstance(answer.get("predictions_sha256"), str) else None
    timing = answer.get("timing")
    energy = answer.get("energy")
    return (sha, _number(timing.get("run_ms")) if isinstance(timing, dict) else None,
            _number(energy.get("gross_j")) if isinstance(energy, dict) else None)


def columns_as(alias: str, with_answer: bool = False) -> str:
    """The column list with a table alias (``t.id, t.status, ...``)."""
    names = [c.name for c in LISTED_COLUMNS] + (["answer", "answer_codec"] if with_answer else [])
    return ", ".join(f"{alias}.{n}" for n in names)


def dumps(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces): equal values give equal text, which idempotency compares."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def encode_answer(answer: dict, text: bytes | None = None) -> tuple[bytes, int, str]:
    """(stored blob, length of the JSON text, codec) of an answer. ``text``: the answer's JSON as
    already encoded for the client (the service passes the bytes it sends, so they are not encoded
    twice): zlib-compressed. Otherwise an answer whose predictions are an integer array of class
    indices goes compact (``COMPACT_CODEC``); any other as canonical JSON, zlib-compressed."""
    if text is None:
        predictions = answer.get("predictions")
        if isinstance(predictions, np.ndarray) and predictions.ndim == 1 and predictions.dtype.kind in "iu":
            top = int(predictions.max()) if predictions.size else 0
            if top < 256 and (predictions.size == 0 or int(predictions.min()) >= 0):
                return _encode_compact(answer, predictions, top)
        if isinstance(predictions, np.ndarray):
            answer = {**answer, "predictions": predictions.tolist()}
        text = dumps(answer).encode("utf-8")
    return zlib.compress(text, 1), len(text), ANSWER_CODEC  # level 1: a seventh of level 6's time (docs/performance.md)


def _encode_compact(answer: dict, predictions: np.ndarray, top: int) -> tuple[bytes, int, str]:
    rest = orjson.dumps({**answer, "predictions": None}, option=orjson.OPT_SERIALIZE_NUMPY)
    packed = zlib.compress(rest, 1)
    n = int(predictions.size)
    # the JSON text it stands for: its rest, its list's digits, commas and brackets instead of "null"
    # (``top``, the largest prediction, spares counting two- and three-digit ones where none can be)
    text_bytes = len(rest) - 4 + 2 + max(n - 1, 0) + n + (int(np.count_nonzero(predictions >= 10)) if top >= 10 else 0) \
        + (int(np.count_nonzero(predictions >= 100)) if top >= 100 else 0)
    return struct.pack("<I", len(packed)) + packed + predictions.astype(np.uint8).tobytes(), text_bytes, COMPACT_CODEC


def decode_answer(blob: bytes | None, codec: str | None, predictions: bool = True) -> dict | None:
    """A stored answer. ``predictions=False``: a reader that needs none of them (a sweep's or an
    evaluation's rows) may get the answer without (its "predictions" None) where the codec allows."""
    if blob is None:
        return None
    if codec == COMPACT_CODEC:
        (size,) = struct.unpack_from("<I", blob)
        doc = orjson.loads(zlib.decompress(blob[4:4 + size]))
        if predictions:
            doc["predictions"] = np.frombuffer(blob, np.uint8, offset=4 + size).astype(np.int64).tolist()
        return doc
    if codec != ANSWER_CODEC:
        raise ValueError(f"stored answer has an unknown encoding {codec!r}")
    return orjson.loads(zlib.decompress(blob))


def record_from_row(row: Any, with_answer: bool, predictions: bool = True) -> TaskRecord:
    """A row of ``SUMMARY_COLUMNS`` (``ALL_COLUMNS`` when ``with_answer``), from either engine."""
    values = {c.name: (loads(v) if c.name in _JSON else v) for c, v in zip(LISTED_COLUMNS, row)}
    if with_answer:
        blob = row[SUMMARY_WIDTH]
        values["answer"] = decode_answer(bytes(blob) if blob is not None else None, row[SUMMARY_WIDTH + 1],
                                         predictions)
    return TaskRecord(**values)
