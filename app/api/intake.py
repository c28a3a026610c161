"""POST /tasks from arrival to answer: gates, upload, parse, the runner's one entry, answer.

Cheap checks come first (draining, the query's options and the body's content type, the
webhook, a full queue), so a request that cannot succeed is refused before its body is read.
Then the body is parsed and validated and its budget checked where app/tasks/submit.py decides (by
its own job on the device worker, on the loop when small, else on the io pool) -- or, with
``?dataset=``, the stored dataset's arrays are taken instead (no body) -- and from there every
task takes one path: through the runner's one entry, ``TaskRunner.submit`` (the same as a sweep's
cells and the feeder's claims): recorded now or once it has finished, offered to the feeder or
queued here.

``Prefer: respond-async`` answers ``202 Work`` with ``Location: /tasks/{id}`` once the task
and its npz are durable in the ledger; without it the request waits for the answer (and a
client that disconnects stops its task). ``Idempotency-Key``: the same key and body return the
task already recorded instead of training again; another body is a 409.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from learner.config import Config

from ..errors import Conflict, InvalidRequest, Unavailable, outcome_of
from ..http import uploads
from ..http.protocol import GONE
from ..ledger import IdempotencyConflict, TaskRecord
from ..tasks.answers import Settled, status_answer, task_npz
from ..tasks.options import TaskOptions, parse_options
from ..tasks.runner import new_task_id
from ..tasks.submit import Parsed, parse_upload, stored_task
from ..tasks.work import Work
from ..webhooks.delivery import SubscriptionError
from .deps import tenant_of

if TYPE_CHECKING:
    from ..service import Service

log = logging.getLogger("rev88." + __name__)

_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")  # visible ASCII, 1-200 characters


def gate(service: Service) -> None:
    if service.draining:
        raise Unavailable("the service is draining for shutdown; not accepting new tasks",
                          retry_after=service.executor.retry_after())
    if service.state == "failed":
        raise Unavailable(f"the service failed its startup checks and takes no tasks: {service.failure}")


def wants_async(prefer: str | None) -> bool:
    """RFC 7240: ``Prefer: respond-async`` (among other preferences, any case)."""
    return any(p.split(";")[0].strip().lower() == "respond-async" for p in (prefer or "").split(","))


def idempotency_key(request: Request) -> str | None:
    """The request's Idempotency-Key, scoped to its tenant (two tenants' equal keys are two keys)."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not _KEY.match(key):
        raise InvalidRequest("Idempotency-Key must be 1-200 visible ASCII characters (no spaces)")
    owner = tenant_of(request).owner
    return key if owner is None else f"{owner}/{key}"


def client_gone(request: Request) -> Awaitable[None]:
    """Completes once the client has disconnected: the connection's own future where the protocol
    gives one (app/http/protocol.py, ``GONE``), else a coroutine that waits for uvicorn's
    disconnect message (the body has been read by now, so it is the only message left)."""
    gone = request.scope.get(GONE)
    return gone if gone is not None else _disconnect_message(request)


async def _disconnect_message(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def handle(request: Request, service: Service) -> Response:
    t0 = getattr(request.state, "t0", time.perf_counter())
    request_id = getattr(request.state, "request_id", None)
    try:
        return await _handle(request, service, t0, request_id)
    except Exception as exc:  # refused before the task was accepted
        service.metrics.outcome(outcome_of(exc))
        raise


async def _handle(request: Request, service: Service, t0: float, request_id: str | None) -> Response:
    gate(service)
    # the query and what the headers say of the body and the answer (a bad content type: 415)
    options = parse_options(list(request.query_params.multi_items()), service.backend, request.headers)
    webhook = await webhook_of(service, options.webhook, options.webhook_events, ("started", "completed"))
    asynchronous, key = _admitted(request, service, upload=options.dataset is None)
    tenant = tenant_of(request)
    await service.runner.check_queued(tenant, 1)  # the key's max_queued (before the body)
    recorded_now = asynchronous or key is not None or webhook is not None
    settings = service.settings
    if options.dataset is None:
        body, config, parsed, receive_s = await _upload(request, service, options, recorded_now, asynchronous)
    else:  # POST /tasks?dataset=: the stored dataset's arrays (issue #31), no body; from here the same path
        body, config, receive_s = None, options.config(), 0.0
        parsed = await asyncio.to_thread(stored_task, service.datasets, options.dataset, tenant.owner, config,
                                         settings.max_task_work, settings.max_task_bytes)
    gate(service)  # a drain may have begun while the body streamed in
    acc = Work(
        task_id=new_task_id(), task=parsed.task, config=config, backend=options.backend,
        include_scores=options.include_scores, measure=options.measure, mode="async" if asynchronous else "sync",
        request_id=request_id, t0=t0, receive_s=receive_s, parse_s=parsed.parse_s,
        body_bytes=parsed.body_bytes, deferred=not recorded_now,  # synchronous, no Idempotency-Key: recorded once, when finished
        late=parsed.late, dataset=options.dataset, labels=parsed.labels, owner=tenant.owner, webhook=webhook,
        precision=options.precision,
    )
    return await _accepted(request, service, acc, body, parsed.body_sha256, key, asynchronous, options.npz)


async def _upload(request: Request, service: Service, options: TaskOptions, recorded_now: bool,
                  asynchronous: bool) -> tuple[bytes | memoryview, Config, Parsed, float]:
    """An uploaded body, read within the upload budget and parsed where app/tasks/submit.py decides (by
    its own job on the device worker, on the loop when small, else on the io pool): (the body, the
    task's config, the parse, the seconds its bytes took to arrive)."""
    settings = service.settings
    reservation = service.uploads.reservation()  # the body's bytes, as they arrive, until it is parsed
    try:
        t_recv = time.perf_counter()
        body = await uploads.read_body(request, settings.max_body_bytes, timeout_s=settings.upload_timeout_s,
                                       min_rate=settings.upload_min_rate, reservation=reservation)
        receive_s = time.perf_counter() - t_recv
        form_config = None
        if options.kind == uploads.MULTIPART:
            body, form_config = await uploads.split_multipart(request.headers, bytes(body))
        config = options.config(form_config)
        parsed = await parse_upload(body, config, recorded_now=recorded_now, asynchronous=asynchronous,
                                    measure=options.measure is not None, batching=service.runner.batch_max > 1,
                                    max_work=settings.max_task_work, max_bytes=settings.max_task_bytes,
                                    pool=service.io_pool)
    finally:
        reservation.release()
    if parsed.late is None:
        service.metrics.parse_seconds.observe(parsed.parse_s)
    return body, config, parsed, receive_s


async def webhook_of(service: Service, url: str | None, events, allowed: tuple[str, ...]) -> dict | None:
    """A request's webhook, checked now (its URL, and every address the host resolves to): a
    422 naming ``webhook`` or ``webhook_events`` when refused."""
    if url is None and events is None:
        return None
    try:
        return await service.webhooks.subscription(url, events, allowed)
    except SubscriptionError as exc:
        raise InvalidRequest(str(exc), field=exc.field) from None


def _admitted(request: Request, service: Service, upload: bool = True) -> tuple[bool, str | None]:
    """(asynchronous, Idempotency-Key) of a task request that there is room for, refused before
    its body otherwise: an asynchronous task waits in the ledger (its backlog's limits); a
    synchronous one needs a place in the device queue within its tenant's share."""
    asynchronous = wants_async(request.headers.get("prefer"))
    key = idempotency_key(request)
    if asynchronous:
        service.runner.feeder.check_capacity(1, uploads=upload)
    else:
        service.runner.check_sync_capacity(tenant_of(request).owner)
    return asynchronous, key


async def _accepted(request: Request, service: Service, acc: Work, body: bytes | memoryview | None,
                    body_sha256: str | None, key: str | None, asynchronous: bool, npz: bool) -> Response:
    """An accepted task, from the runner's one entry (app/tasks/submit.py) to its response."""
    try:
        submitted = await service.runner.submit(acc, body=body, body_sha256=body_sha256, key=key,
                                                gone=lambda: client_gone(request))
    except IdempotencyConflict as exc:
        raise Conflict(f"{exc}; use a new key for a new task", task_id=exc.task_id) from None
    del body
    if not submitted.created:
        return await _existing(request, service, submitted.record, asynchronous)
    if asynchronous:
        return accepted_response(submitted.record)
    settled = submitted.settled
    if settled.status == 200 and settled.outcome is not None and npz:
        return npz_response(acc.task_id, settled)
    return Response(settled.json(), status_code=settled.status, headers=settled.headers, media_type="application/json")


def accepted_response(record: TaskRecord, replayed: bool = False) -> JSONResponse:
    """202 with the task's summary (``replayed``: an Idempotency-Key's earlier task, said so)."""
    headers = {"Location": f"/tasks/{record.id}", "Retry-After": "1"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(record.summary(), status_code=202, headers=headers)


async def _existing(request: Request, service: Service, record: TaskRecord, asynchronous: bool) -> Response:
    """An Idempotency-Key seen before with the same body: that task, not a second training."""
    if not asynchronous and not record.finished and record.id in service.runner.pending:
        # the first request's task is still in this process: wait for it too
        record = await service.runner.finished_record(record.id, service.settings.task_timeout_s) or record
    elif not asynchronous and not record.finished and service.runner.shared is not None:
        # ... or on another replica sharing the ledger: wait for its record there
        record = await service.runner.shared.wait_finished(record.id, service.settings.task_timeout_s) or record
    if asynchronous or not record.finished:
        return accepted_response(record, replayed=True)
    return JSONResponse(*status_answer(record), headers={"Idempotent-Replayed": "true"})


def npz_response(task_id: str, settled: Settled) -> Response:
    result = settled.outcome.result
    timing = settled.body["timing"]
    return Response(
        task_npz(result),
        media_type="application/x-npz",
        headers={
            "Content-Disposition": f'attachment; filename="rev88-{task_id}.npz"',
            "X-Task-ID": task_id,
            "X-Predictions-SHA256": result.predictions_sha256,
            "X-Scores-SHA256": result.scores_sha256,
            "X-Run-Ms": f"{timing['run_ms']:.3f}",
            "X-Total-Ms": f"{timing['total_ms']:.3f}",
        },
    )
