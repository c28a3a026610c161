"""POST /tasks from arrival to answer: gates, upload, parse (worker thread), queue, answer.

Cheap checks come first (draining, content type, query options, a full queue),
so a request that cannot succeed is refused before its body is read.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

from learner.budget import check_budget, estimate
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from learner.cancel import CancelToken
from learner.taskio import load_task

from . import uploads
from .errors import QueueFull, Unavailable
from .tasks import (
    DeviceOutcome,
    TaskOptions,
    measure_on_device,
    measure_timeout_s,
    outcome_of,
    parse_options,
    run_on_device,
    run_timing,
    task_answer,
    task_npz,
    wants_npz,
)

if TYPE_CHECKING:
    from .service import Service

log = logging.getLogger("rev88.app.tasks")


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected. The body has been read by now, so the only
    message left for the app to receive is the disconnect (uvicorn sends it when the
    connection closes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _gate(service: Service) -> None:
    if service.draining:
        raise Unavailable("the service is draining for shutdown; not accepting new tasks",
                          retry_after=service.executor.retry_after())
    if service.state == "failed":
        raise Unavailable(f"the service failed its startup checks and takes no tasks: {service.failure}")


async def handle(request: Request, service: Service) -> Response:
    try:
        response = await _handle(request, service)
    except Exception as exc:
        service.metrics.outcome(outcome_of(exc))
        raise
    service.metrics.outcome("ok")
    return response


async def _handle(request: Request, service: Service) -> Response:
    t0 = getattr(request.state, "t0", time.perf_counter())
    request_id = getattr(request.state, "request_id", None)
    _gate(service)
    kind = uploads.check_content_type(request.headers.get("content-type"))
    options = parse_options(list(request.query_params.multi_items()), service.backend)
    service.executor.check_capacity()
    if not service.admit_upload():
        raise QueueFull(
            f"too many uploads in progress (limit {service.queue_size + 1}: REV88_QUEUE_SIZE + 1); retry later",
            retry_after=service.executor.retry_after(),
        )
    try:
        t_recv = time.perf_counter()
        body = await uploads.read_body(request, service.settings.max_body_bytes)
        t_parse = time.perf_counter()
        form_config = None
        if kind == uploads.MULTIPART:
            body, form_config = await uploads.split_multipart(request.headers, body)
        config = options.config(form_config)
        task = await asyncio.to_thread(load_task, body)
        del body
        parse_s = time.perf_counter() - t_parse
    finally:
        service.release_upload()
    service.metrics.parse_seconds.observe(parse_s)
    _gate(service)  # a drain may have begun while the body streamed in
    # The budget, before the task is queued: its estimated work and memory (learner.budget).
    check_budget(estimate(task.train_count, task.test_count, config),
                 service.settings.max_task_work, service.settings.max_task_bytes)

    task_id = uuid.uuid4().hex
    if options.measure is not None:
        return await _measure(request, service, task, config, options, task_id, request_id, t0, t_recv, t_parse, parse_s)

    token = CancelToken()
    job = service.executor.submit(
        lambda: run_on_device(task, config, options.backend, service.energy, service.engines, cancel=token),
        kind="task", label=task_id, batch=service.task_batch(task, config, options.backend, token), cancel=token,
    )
    outcome: DeviceOutcome = await service.executor.wait(job, service.settings.task_timeout_s, client_gone(request))
    run_ms, clock = run_timing(outcome.result)
    service.metrics.queue_wait_seconds.observe(job.queue_wait_s or 0.0)
    service.metrics.run_seconds.observe(run_ms / 1000.0)
    if outcome.energy is not None and service.metrics.task_energy is not None and outcome.energy.get("gross_j"):
        service.metrics.task_energy.inc(outcome.energy["gross_j"])
    timing = {
        "receive_ms": _ms(t_parse - t_recv),
        "parse_ms": _ms(parse_s),
        "queue_wait_ms": _ms(job.queue_wait_s or 0.0),
        "run_ms": round(run_ms, 3),
        "run_clock": clock,
        "device_ms": _ms(job.device_s or 0.0),
        "tasks_in_launch": job.launch_size,
        "total_ms": _ms(time.perf_counter() - t0),
    }
    log.info(
        "task answered",
        extra={"task_id": task_id, "train_count": task.train_count, "test_count": task.test_count,
               "backend": outcome.result.metadata["backend"], "timing": timing},
    )
    if wants_npz(request.headers.get("accept")):
        result = outcome.result
        return Response(
            task_npz(result),
            media_type="application/x-npz",
            headers={
                "Content-Disposition": f'attachment; filename="rev88-{task_id}.npz"',
                "X-Task-ID": task_id,
                "X-Predictions-SHA256": result.predictions_sha256,
                "X-Scores-SHA256": result.scores_sha256,
                "X-Run-Ms": f"{run_ms:.3f}",
                "X-Total-Ms": f"{timing['total_ms']:.3f}",
            },
        )
    return JSONResponse(task_answer(task_id, request_id, outcome, timing, options.include_scores))


async def _measure(request, service, task, config, options: TaskOptions, task_id, request_id, t0, t_recv, t_parse, parse_s):
    arguments = options.measure
    job = service.executor.submit(
        lambda: measure_on_device(task, config, options.backend, arguments, service.energy, service.engines),
        kind="measure", label=task_id,
    )
    timeout = measure_timeout_s(arguments, service.settings.task_timeout_s)
    doc = await service.executor.wait(job, timeout, client_gone(request))
    service.metrics.queue_wait_seconds.observe(job.queue_wait_s or 0.0)
    timing = {
        "receive_ms": _ms(t_parse - t_recv),
        "parse_ms": _ms(parse_s),
        "queue_wait_ms": _ms(job.queue_wait_s or 0.0),
        "device_ms": _ms(job.device_s or 0.0),
        "total_ms": _ms(time.perf_counter() - t0),
    }
    answer = {
        "id": task_id,
        "request_id": request_id,
        "measure": "energy",
        "protocol": arguments,
        "predictions_sha256": doc.get("predictions_sha256"),
        "scores_sha256": doc.get("scores_sha256"),
        "energy": doc.get("energy"),
    }
    if doc.get("energy") is None:
        answer["energy_reason"] = doc.get("energy_reason")
    answer.update({"measurement": doc, "timing": timing, "device": doc.get("device"), "versions": service.versions()})
    log.info("measurement answered", extra={"task_id": task_id, "timing": timing})
    return JSONResponse(answer)
