"""A webhook message's body (issue #34): thin -- what happened, to what, when, and where to read
the rest; never the predictions.

    {"type": "task.succeeded", "timestamp": "2026-12-03T14:00:00.123Z",
     "data": {"id": ..., "status": ..., "predictions_sha256": ..., "timing": {...}, "links": {...}}}

Types: task.started, task.succeeded, task.failed, task.cancelled, sweep.completed,
evaluation.completed. ``timestamp`` is when the event happened (the task's start or end, the
moment a sweep or an evaluation was seen complete); the body is fixed then, so every retry sends
the same bytes. Links are paths on the service that sent it.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

from ..ledger.outbox import FINISHED, dumps_body


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def envelope(type_: str, when: float, data: dict[str, Any]) -> bytes:
    return dumps_body({"type": type_, "timestamp": iso(when), "data": data})


def _error_text(error: Any) -> str | None:
    if error is None:
        return None
    if isinstance(error, str):
        try:
            error = json.loads(error)
        except ValueError:
            return error
    return error.get("error") if isinstance(error, dict) else str(error)


def task_event(row: tuple) -> tuple[str, bytes, float] | str:
    """(type, body, when) of a due task message (a row of ``Outbox.due_tasks``), or the reason
    it is skipped."""
    (_, event, task_id, status, created_at, started_at, finished_at, sha, run_ms, energy_j, error, backend,
     device, mode) = row
    if status is None:
        return f"task {task_id} is no longer in the ledger (retention) and its event was not seen"
    if event == "started":
        if started_at is None:
            return f"task {task_id} ended {status} without starting"
        type_, when, shown = "task.started", float(started_at), "running"
    else:
        if status not in FINISHED:  # (the query returns only finished ones)
            return f"task {task_id} has not finished"
        type_, when, shown = f"task.{status}", float(finished_at or time.time()), status
    finished = event != "started"
    links = {"self": f"/tasks/{task_id}", "deliveries": f"/tasks/{task_id}/deliveries"}
    if finished and status == "succeeded":
        links["predictions"] = f"/tasks/{task_id}/predictions.npy"
    data = {"id": task_id, "status": shown, "mode": mode, "backend": backend, "device": device,
            "predictions_sha256": sha if finished else None,
            "error": _error_text(error) if finished else None,
            "timing": {"created_at": created_at, "started_at": started_at,
                       "finished_at": finished_at if finished else None, "run_ms": run_ms if finished else None},
            "energy_j": energy_j if finished else None, "links": links}
    return type_, envelope(type_, when, data), when


def sweep_event(doc: dict[str, Any]) -> tuple[str, bytes, float] | None:
    """A sweep's completion from its document (None: not complete yet)."""
    if doc["status"] not in ("completed", "cancelled"):
        return None
    now = time.time()
    sweep_id = doc["id"]
    data = {"id": sweep_id, "status": doc["status"], "predictions_sha256": None, "dataset": doc.get("dataset"),
            "counts": doc.get("counts"),
            "timing": {"created_at": doc.get("created_at"), "completed_at": now, "cancelled_at": doc.get("cancelled_at")},
            "links": {"self": f"/sweeps/{sweep_id}", "csv": f"/sweeps/{sweep_id}?format=csv",
                      "deliveries": f"/sweeps/{sweep_id}/deliveries"}}
    return "sweep.completed", envelope("sweep.completed", now, data), now


def evaluation_event(doc: dict[str, Any]) -> tuple[str, bytes, float] | None:
    """An evaluation's completion (graded) from its document (None: not complete yet)."""
    if doc["status"] in ("queued", "running"):
        return None
    when = doc.get("finished_at") or time.time()
    ev_id = doc["id"]
    totals = doc.get("totals") or {}
    data = {"id": ev_id, "status": doc["status"], "name": doc.get("name"), "predictions_sha256": None,
            "counts": doc.get("counts"), "correct": totals.get("correct"), "total": totals.get("total"),
            "mean_accuracy": totals.get("mean_accuracy"),
            "timing": {"created_at": doc.get("created_at"), "finished_at": doc.get("finished_at"),
                       "ms_per_task": (doc.get("time") or {}).get("ms_per_task")},
            "links": {"self": f"/evaluations/{ev_id}", "report": f"/evaluations/{ev_id}/report",
                      "deliveries": f"/evaluations/{ev_id}/deliveries"}}
    return "evaluation.completed", envelope("evaluation.completed", when, data), when
