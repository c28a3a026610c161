"""A task's answer as it leaves the service: the JSON document, encoded once, the npz/npy files,
and the log's line of what a run answered."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from typing import Any

import numpy as np
import orjson

from learner.result import TaskResult

from .datasets import score
from .device import DeviceOutcome
from .options import NPZ_TYPE  # noqa: F401 - the answers' media type, named beside them

log = logging.getLogger("rev88.app.tasks.finisher")  # (the finisher's lines, as they always were)


@dataclasses.dataclass
class Settled:
    """A task's outcome as HTTP sees it: status code and JSON body (and the device outcome on success)."""

    status: int
    body: dict[str, Any]
    outcome: DeviceOutcome | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    content: bytes | None = None  # ``body`` as JSON, encoded once (orjson): what is sent and what the ledger keeps

    def json(self) -> bytes:
        if self.content is None:
            self.content = encode_json(self.body)
        return self.content


def encode_json(doc: dict[str, Any]) -> bytes:
    """A JSON answer's bytes (orjson, a fraction of json.dumps's cost: docs/performance.md;
    non-finite floats become null, as JSON has no NaN). An answer's predictions are the numpy
    array itself, written by orjson without a Python int per query (the same text as a list's).
    What orjson cannot encode (an integer over 64 bits in an error's details, say) goes through
    the standard encoder instead."""
    try:
        return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return json.dumps(doc, default=_plain, separators=(",", ":")).encode("utf-8")


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else str(value)


def input_hashes(task) -> dict[str, str]:
    """The task's input hashes (computed once per task where TaskArrays caches them)."""
    cached = getattr(task, "input_hashes", None)
    if callable(cached):
        return cached()
    from learner.hashing import array_sha256

    return {name: array_sha256(arr) for name, arr in task.as_dict().items()}


@dataclasses.dataclass(frozen=True)
class Measured:
    """A measurement's document, as its job made it on the device worker."""

    doc: dict


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def task_timing(work: Any, run_ms: float, clock: str, device_s: float, launch_size: int) -> dict[str, Any]:
    """A task's answer's ``timing``: from its receipt to now (``work``: its ``Work``)."""
    return {"receive_ms": ms(work.receive_s), "parse_ms": ms(work.parse_s), "queue_wait_ms": ms(work.queue_wait_s),
            "run_ms": round(run_ms, 3), "run_clock": clock, "device_ms": ms(device_s),
            "tasks_in_launch": launch_size, "total_ms": ms(time.perf_counter() - work.t0)}


def measure_answer(work: Any, doc: dict, device_s: float, versions: dict[str, Any]) -> dict[str, Any]:
    """A measurement's answer: its document, and the timing of its request."""
    timing = {"receive_ms": ms(work.receive_s), "parse_ms": ms(work.parse_s),
              "queue_wait_ms": ms(work.queue_wait_s), "device_ms": ms(device_s),
              "total_ms": ms(time.perf_counter() - work.t0)}
    answer = {"id": work.task_id, "request_id": work.request_id, "measure": "energy", "protocol": work.measure,
              "predictions_sha256": doc.get("predictions_sha256"), "scores_sha256": doc.get("scores_sha256"),
              "energy": doc.get("energy")}
    if doc.get("energy") is None:
        answer["energy_reason"] = doc.get("energy_reason")
    answer.update({"measurement": doc, "timing": timing, "device": doc.get("device"), "versions": versions})
    return answer


def device_answer(work: Any, outcome: DeviceOutcome, run: tuple[float, str], device_s: float, launch_size: int) -> dict:
    """A run's answer: its timing (``run``: its run_ms and clock; ``device_s``: its launch's time on the
    device, less its parse where its job parsed its body first), its result and, for a task on a
    stored dataset, the dataset's digest and, with its labels, the count of correct predictions."""
    if work.late is not None:
        device_s = max(0.0, device_s - work.parse_s)
    timing = task_timing(work, *run, device_s, launch_size)
    body = task_answer(work.task_id, work.request_id, outcome, timing, work.include_scores)
    if work.dataset is not None:
        body["dataset"] = work.dataset
        if work.labels is not None:
            body.update(score(outcome.result.predictions, work.labels))
    return body


def task_answer(task_id: str, request_id: str | None, outcome: DeviceOutcome, timing: dict, include_scores: bool) -> dict:
    result = outcome.result
    answer: dict[str, Any] = {
        "id": task_id,
        "request_id": request_id,
        # an int64 array, encoded as a JSON list by encode_json; anything else as a list already
        "predictions": _predictions(result.predictions),
        "predictions_sha256": result.predictions_sha256,
        "scores_sha256": result.scores_sha256,
    }
    if include_scores:
        answer["scores"] = result.scores.tolist()  # float32 -> float is exact; float32(x) recovers the bits
    answer.update(
        {
            "metadata": result.metadata,
            "timing": timing,
            "energy": outcome.energy,
        }
    )
    if outcome.energy is None:
        answer["energy_reason"] = outcome.energy_reason
    answer["device"] = result.metadata["device"]
    answer["versions"] = result.metadata["versions"]
    return answer


def _predictions(predictions: np.ndarray) -> np.ndarray | list:
    if predictions.dtype == np.int64 and predictions.ndim == 1 and predictions.flags.c_contiguous:
        return predictions
    return predictions.tolist()


def task_npz(result: TaskResult) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, predictions=result.predictions.astype(np.int64), scores=result.scores.astype(np.float32))
    return buf.getvalue()


def run_timing(result: TaskResult) -> tuple[float, str]:
    """(ms, clock) of the learner's own run: CUDA events where present, else the host clock."""
    meta = result.metadata
    if meta.get("cuda_ms") is not None:
        return float(meta["cuda_ms"]), "cuda_events"
    return float(meta["training_prediction_seconds"]) * 1000.0, "perf_counter"


def answer_npz(answer: dict) -> bytes:
    """A stored answer as npz: predictions (int64), and scores (float32) when the task kept them."""
    buf = io.BytesIO()
    arrays = {"predictions": np.asarray(answer["predictions"], dtype=np.int64)}
    if answer.get("scores") is not None:
        arrays["scores"] = np.asarray(answer["scores"], dtype=np.float32)
    np.savez(buf, **arrays)
    return buf.getvalue()


def predictions_npy(predictions: list[int]) -> bytes:
    """The .npy bytes ``np.save`` writes for the predictions (int64): its SHA-256 of the array
    equals the answer's predictions_sha256."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(predictions, dtype=np.int64))
    return buf.getvalue()


def status_answer(record) -> tuple[dict, int]:
    """GET /tasks/{id}'s JSON: a finished task's answer (the same JSON as the synchronous one,
    plus its ``status``) or its error; otherwise its status document."""
    if record.status == "succeeded" and record.answer is not None:
        return {**record.answer, "status": "succeeded"}, 200
    doc = record.document()
    doc.pop("answer", None)
    return doc, 200


def say_answered(answered: list[tuple[Any, dict, str]], launch_size: int) -> None:
    """The log's line of what a run answered: a task run alone has its own ("task answered"); a
    launch of several, one line for all of them ("launch answered": its tasks' ids and facts as
    lists, in the same order), so that a 1,320-cell sweep writes ten lines, not 1,320 (a line a
    cell cost the finisher and the log thread more than its answer's JSON: docs/performance.md)."""
    if not answered or not log.isEnabledFor(logging.INFO):
        return
    if launch_size == 1 and len(answered) == 1:
        work, body, backend = answered[0]
        extra = {"task_id": work.task_id, "train_count": work.task.train_count, "test_count": work.task.test_count,
                 "backend": backend, "device": work.device, "mode": work.mode, "timing": body["timing"]}
        if work.request_id is not None:  # (this thread is not in the request's context)
            extra["request_id"] = work.request_id
        log.info("task answered", extra=extra)
        return
    works = [work for work, _, _ in answered]
    timings = [body["timing"] for _, body, _ in answered]
    extra = {"tasks": len(answered), "tasks_in_launch": launch_size, "backend": answered[0][2],
             "device": works[0].device, "device_ms": timings[0]["device_ms"],
             "task_ids": [w.task_id for w in works], "modes": [w.mode for w in works],
             "train_count": [w.task.train_count for w in works], "test_count": [w.task.test_count for w in works],
             **{key: [t[key] for t in timings] for key in ("queue_wait_ms", "run_ms", "total_ms")}}
    if any(w.request_id is not None for w in works):
        extra["request_ids"] = [w.request_id for w in works]
    log.info("launch answered", extra=extra)
