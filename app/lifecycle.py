"""A task from acceptance to its recorded answer, whoever waits for it.

``accept``  records the task in the ledger (an asynchronous one together with its npz, durable
            before the 202) and queues it on the workers.
``settle``  waits for its job (timeout; client disconnect for a synchronous request), builds
            the answer or the error, records it in the ledger and returns it. The synchronous
            route awaits it; an asynchronous task has it run in the background.
``recover`` at start: every asynchronous task the ledger still has queued or running (the
            service stopped before it finished, say by ``kill -9``) is queued again from its
            stored npz -- runs are deterministic, so its answer is the one the first run would
            have given; a synchronous one (its client's connection is gone) is recorded failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson

from learner.backends import BackendUnavailable
from learner.cancel import CancelToken
from learner.config import Config, make_config
from learner.errors import TaskError
from learner.taskio import TaskArrays, load_task

from .errors import ServiceError, TaskStopped, Unavailable
from .ledger import AlreadyFinished, TaskRecord
from .tasks import (
    DeviceOutcome,
    measure_on_device,
    measure_timeout_s,
    outcome_of,
    run_on_device,
    run_timing,
    task_answer,
)

if TYPE_CHECKING:
    from .executor import Job
    from .service import Service

log = logging.getLogger("rev88.app.lifecycle")


def new_task_id() -> str:
    return uuid.uuid4().hex


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclasses.dataclass
class Accepted:
    """Everything a task's job needs, now or after a restart (``options`` is what the ledger keeps)."""

    task_id: str
    task: TaskArrays
    config: Config
    backend: str
    include_scores: bool = False
    measure: dict[str, Any] | None = None
    mode: str = "sync"
    request_id: str | None = None
    t0: float = dataclasses.field(default_factory=time.perf_counter)  # arrival (perf_counter)
    receive_s: float = 0.0
    parse_s: float = 0.0
    cancel: CancelToken = dataclasses.field(default_factory=CancelToken)
    job: Job | None = None

    @property
    def kind(self) -> str:
        return "measure" if self.measure is not None else "task"

    def options(self) -> dict[str, Any]:
        return {"include_scores": self.include_scores, "measure": self.measure}


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
    """A JSON answer's bytes (orjson: 0.06 ms for a 10k-query answer against 0.9 ms for json.dumps;
    non-finite floats become null, as JSON has no NaN). What orjson cannot encode (an integer
    over 64 bits in an error's details, say) goes through the standard encoder instead."""
    try:
        return orjson.dumps(doc)
    except TypeError:
        return json.dumps(doc, default=str, separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------- accept


def record(service: Service, acc: Accepted, body_sha256: str | None, body_bytes: int, body: bytes | None,
           idempotency_key: str | None) -> tuple[TaskRecord, bool]:
    """Write the task to the ledger (blocking: call it in a thread). ``body`` makes it durable.
    A synchronous task's input hashes are still being computed beside it: they are recorded
    when it finishes (``settle``)."""
    return service.ledger.create(
        task_id=acc.task_id, kind=acc.kind, mode=acc.mode, backend=acc.backend, config=acc.config.as_dict(),
        options=acc.options(), train_count=acc.task.train_count, test_count=acc.task.test_count,
        body_sha256=body_sha256, body_bytes=body_bytes,
        input_hashes=input_hashes(acc.task) if acc.mode == "async" else None,
        body=body, idempotency_key=idempotency_key,
    )


def input_hashes(task: TaskArrays) -> dict[str, str]:
    """The task's input hashes (computed once per task where TaskArrays caches them)."""
    cached = getattr(task, "input_hashes", None)
    if callable(cached):
        return cached()
    from learner.hashing import array_sha256

    return {name: array_sha256(arr) for name, arr in task.as_dict().items()}


def submit(service: Service, acc: Accepted, reserved: bool = False) -> Job:
    """Queue the task's job on the workers (``reserved``: recovered work skips the capacity check)."""
    service.pending[acc.task_id] = acc

    def started(job) -> None:  # on the device worker: hands the write over, does not wait for it
        service.ledger_writer.started(acc.task_id, job.worker, time.time())

    if acc.measure is not None:
        arguments = acc.measure
        job = service.executor.submit(
            lambda: measure_on_device(acc.task, acc.config, acc.backend, arguments, service.energy, service.engines),
            kind="measure", label=acc.task_id, reserved=reserved, cancel=acc.cancel, on_start=started,
        )
    else:
        job = service.executor.submit(
            lambda: run_on_device(acc.task, acc.config, acc.backend, service.energy, service.engines, cancel=acc.cancel),
            kind="task", label=acc.task_id, batch=service.task_batch(acc.task, acc.config, acc.backend, acc.cancel),
            reserved=reserved, cancel=acc.cancel, on_start=started,
        )
    acc.job = job
    return job


def timeout_for(service: Service, acc: Accepted) -> float:
    if acc.measure is not None:
        return measure_timeout_s(acc.measure, service.settings.task_timeout_s)
    return service.settings.task_timeout_s


# --------------------------------------------------------------------------- settle


async def settle(service: Service, acc: Accepted, gone=None) -> Settled:
    """Wait for the task's job, build its answer (or error), record it, return it."""
    job = acc.job
    try:
        value = await service.executor.wait(job, timeout_for(service, acc), gone)
    except BaseException as exc:  # noqa: BLE001 - every failure is answered and recorded
        settled = error_settled(exc, acc.request_id)
        await _record_failure(service, acc, exc, settled)
        service.metrics.outcome(outcome_of(exc) if isinstance(exc, Exception) else "error")
        return settled
    finally:
        service.pending.pop(acc.task_id, None)
    if acc.measure is not None:
        body = measure_answer(service, acc, job, value)
        settled = Settled(200, body)
    else:
        settled = Settled(200, answer_for(service, acc, job, value), outcome=value)
    try:
        content = settled.json()
        await service.ledger_writer.run(  # the hashes there, not here: never waited for on the event loop
            lambda: service.ledger.finish(acc.task_id, "succeeded", settled.body, None, content, False,
                                          input_hashes(acc.task)))
    except AlreadyFinished:  # cancelled in the ledger meanwhile (a restart's leftovers): keep the answer
        log.warning("task finished after the ledger recorded it finished", extra={"task_id": acc.task_id})
    except Exception as exc:  # noqa: BLE001 - the answer stands; the ledger could not keep it
        log.error("could not record the answer in the ledger", extra={"task_id": acc.task_id, "error": str(exc)})
        settled.headers["X-Ledger-Error"] = str(exc)[:200]
    service.metrics.outcome("ok")
    return settled


def answer_for(service: Service, acc: Accepted, job: Job, outcome: DeviceOutcome) -> dict[str, Any]:
    run_ms, clock = run_timing(outcome.result)
    service.metrics.queue_wait_seconds.observe(job.queue_wait_s or 0.0)
    service.metrics.run_seconds.observe(run_ms / 1000.0)
    if outcome.energy is not None and service.metrics.task_energy is not None and outcome.energy.get("gross_j"):
        service.metrics.task_energy.inc(outcome.energy["gross_j"])
    timing = {
        "receive_ms": _ms(acc.receive_s),
        "parse_ms": _ms(acc.parse_s),
        "queue_wait_ms": _ms(job.queue_wait_s or 0.0),
        "run_ms": round(run_ms, 3),
        "run_clock": clock,
        "device_ms": _ms(job.device_s or 0.0),
        "tasks_in_launch": job.launch_size,
        "total_ms": _ms(time.perf_counter() - acc.t0),
    }
    log.info(
        "task answered",
        extra={"task_id": acc.task_id, "train_count": acc.task.train_count, "test_count": acc.task.test_count,
               "backend": outcome.result.metadata["backend"], "device": job.worker, "mode": acc.mode,
               "timing": timing},
    )
    return task_answer(acc.task_id, acc.request_id, outcome, timing, acc.include_scores)


def measure_answer(service: Service, acc: Accepted, job: Job, doc: dict) -> dict[str, Any]:
    service.metrics.queue_wait_seconds.observe(job.queue_wait_s or 0.0)
    timing = {
        "receive_ms": _ms(acc.receive_s),
        "parse_ms": _ms(acc.parse_s),
        "queue_wait_ms": _ms(job.queue_wait_s or 0.0),
        "device_ms": _ms(job.device_s or 0.0),
        "total_ms": _ms(time.perf_counter() - acc.t0),
    }
    answer = {
        "id": acc.task_id,
        "request_id": acc.request_id,
        "measure": "energy",
        "protocol": acc.measure,
        "predictions_sha256": doc.get("predictions_sha256"),
        "scores_sha256": doc.get("scores_sha256"),
        "energy": doc.get("energy"),
    }
    if doc.get("energy") is None:
        answer["energy_reason"] = doc.get("energy_reason")
    answer.update({"measurement": doc, "timing": timing, "device": doc.get("device"), "versions": service.versions()})
    log.info("measurement answered", extra={"task_id": acc.task_id, "timing": timing})
    return answer


def error_settled(exc: BaseException, request_id: str | None) -> Settled:
    """The JSON error answer of a failed task (the same the exception handlers give)."""
    if isinstance(exc, ServiceError):
        return Settled(exc.status, {"error": exc.message, **_plain(exc.details), "request_id": request_id},
                       headers=exc.headers())
    if isinstance(exc, TaskError):
        return Settled(exc.status, {"error": exc.message, "type": type(exc).__name__, **_plain(exc.details),
                                    "request_id": request_id})
    if isinstance(exc, BackendUnavailable):
        return Settled(422, {"error": str(exc), "type": "BackendUnavailable", "request_id": request_id})
    log.error("task failed with an unexpected error", exc_info=exc)
    return Settled(500, {"error": f"internal error: {type(exc).__name__}: {exc}", "request_id": request_id})


def _plain(details: dict) -> dict:
    return json.loads(json.dumps(details, default=str))


async def _record_failure(service: Service, acc: Accepted, exc: BaseException, settled: Settled) -> None:
    if isinstance(exc, Unavailable) and acc.mode == "async":
        # the drain deadline: an accepted asynchronous task stays queued in the ledger and the
        # next start runs it again; nothing accepted is lost
        log.warning("asynchronous task left for the next start", extra={"task_id": acc.task_id})
        return
    status = "cancelled" if isinstance(exc, TaskStopped) else "failed"
    error = {"status": settled.status, **settled.body}
    error.pop("request_id", None)
    try:
        await service.ledger_writer.run(lambda: service.ledger.finish(acc.task_id, status, None, error,
                                                                     input_hashes=input_hashes(acc.task)))
    except AlreadyFinished:
        pass
    except Exception as exc2:  # noqa: BLE001
        log.error("could not record the failure in the ledger", extra={"task_id": acc.task_id, "error": str(exc2)})


def run_in_background(service: Service, acc: Accepted) -> None:
    """An asynchronous task: settle it without a waiting client."""
    task = asyncio.get_running_loop().create_task(settle(service, acc))
    service.background.add(task)
    task.add_done_callback(service.background.discard)


# --------------------------------------------------------------------------- cancel


async def cancel(service: Service, task_id: str) -> TaskRecord | None:
    """Stop a task: a queued one never runs, a running one is stopped at its next safe point.
    Returns its record once the ledger says it has finished (None for an unknown id)."""
    record = await asyncio.to_thread(service.ledger.get, task_id)
    if record is None or record.finished:
        return record
    acc = service.pending.get(task_id)
    if acc is not None and acc.job is not None:
        service.executor.withdraw(acc.job, "cancel", f"was cancelled (POST /tasks/{task_id}/cancel)")
        try:  # the settling coroutine records the outcome; wait for it, within reason
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(acc.job.future)), 15.0)
        except BaseException:  # noqa: BLE001 - the job's own outcome is recorded by settle
            pass
        for _ in range(100):  # settle runs on this loop: let it record
            record = await asyncio.to_thread(service.ledger.get, task_id)
            if record is None or record.finished:
                return record
            await asyncio.sleep(0.02)
        return record
    # in the ledger but not in this process's queue (e.g. a restart's leftover not yet re-queued)
    try:
        return await asyncio.to_thread(service.ledger.finish, task_id, "cancelled", None,
                                       {"status": 409, "error": "cancelled before it ran"})
    except AlreadyFinished as exc:
        return exc.record


# --------------------------------------------------------------------------- recover


async def recover(service: Service) -> dict[str, int]:
    """Queue again every asynchronous task the ledger left unfinished; fail the synchronous ones."""
    counts = {"requeued": 0, "failed": 0}
    for rec in await asyncio.to_thread(service.ledger.unfinished):
        if rec.mode != "async":
            await asyncio.to_thread(service.ledger.finish, rec.id, "failed", None, {
                "status": 503, "error": "the service stopped while this synchronous task was queued or running; "
                "its client's connection was lost with it; submit the task again"})
            counts["failed"] += 1
            continue
        try:
            body = await asyncio.to_thread(service.ledger.load_upload, rec.id)
            task = await asyncio.to_thread(load_task, body)
            config = make_config(rec.config)
        except Exception as exc:  # noqa: BLE001 - a record that cannot be re-run is failed, loudly
            log.error("cannot re-run a recovered task", extra={"task_id": rec.id, "error": str(exc)})
            await asyncio.to_thread(service.ledger.finish, rec.id, "failed", None, {
                "status": 500, "error": f"could not re-run the task after a restart: {exc}"})
            counts["failed"] += 1
            continue
        acc = Accepted(task_id=rec.id, task=task, config=config, backend=rec.backend,
                       include_scores=bool(rec.options.get("include_scores")), measure=rec.options.get("measure"),
                       mode="async")
        submit(service, acc, reserved=True)
        run_in_background(service, acc)
        counts["requeued"] += 1
    if counts["requeued"] or counts["failed"]:
        log.info("recovered the ledger's unfinished tasks", extra=counts)
    return counts
