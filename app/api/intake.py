"""POST /tasks from arrival to answer: gates, upload, parse (worker thread), ledger, queue, answer.

Cheap checks come first (draining, content type, query options, a full queue),
so a request that cannot succeed is refused before its body is read. Then the
body is parsed and validated (on the loop when small, else in a thread), the budget checked,
and the task recorded in the ledger by the task runner (app/tasks/runner.py) before it is
queued. A synchronous task without an Idempotency-Key on a backend that does not batch is
recorded only once it has finished, and its own job parses it and checks its budget, on the
device worker: the event loop only reads its body (bench/bench_shell.py, docs/performance.md).

``Prefer: respond-async`` answers ``202 Accepted`` with ``Location: /tasks/{id}`` once the task
and its npz are durable in the ledger; without it the request waits for the answer (and a
client that disconnects stops its task). ``Idempotency-Key``: the same key and body return the
task already recorded instead of training again; another body is a 409.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from learner.budget import check_budget, estimate
from learner.hashing import bytes_sha256
from learner.taskio import TaskArrays, load_task

from ..errors import Conflict, InvalidRequest, QueueFull, Unavailable, outcome_of
from ..http import uploads
from ..http.protocol import GONE
from ..ledger import IdempotencyConflict, TaskRecord
from ..tasks.answers import Settled, status_answer, task_npz
from ..tasks.options import parse_options, wants_npz
from ..tasks.runner import Accepted, new_task_id
from ..webhooks.delivery import SubscriptionError
from .deps import tenant_of

if TYPE_CHECKING:
    from ..service import Service

log = logging.getLogger("rev88." + __name__)

# Bodies up to this size are parsed (and their inputs hashed) on the event loop: for them the
# hop to a thread and back costs more than the work (bench/bench_shell.py, docs/performance.md).
PARSE_ON_LOOP_BYTES = 256 * 1024
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


def _hash_aside(task: TaskArrays, pool) -> None:
    """A large synchronous task's input hashes (4.6 ms for draw 0), computed in the io pool while
    it runs: only its answer needs them, where the run's result takes them (TaskArrays.input_hashes
    waits for this thread if it has not finished). Handed to the pool directly: nobody awaits it,
    so its end need not wake the event loop."""
    if task.train_images.nbytes + task.test_images.nbytes > PARSE_ON_LOOP_BYTES:
        pool.submit(task.input_hashes)


def late_task(body: bytes | memoryview, config, max_work: float, max_bytes: float, pool) -> TaskArrays:
    """A synchronous task's body, parsed and budget-checked by its job on the device worker."""
    task = load_task(body, hash_inputs=False)
    check_budget(estimate(task.train_count, task.test_count, config), max_work, max_bytes)
    _hash_aside(task, pool)
    return task


def _parse(body: bytes, hash_body: bool, hash_inputs: bool) -> tuple:
    """In a worker thread: the task (validated; its input hashes computed when ``hash_inputs``)
    and, when asked, the body's SHA-256 (None otherwise: 4.6 ms for a 6.5 MB body, needed only
    to match an Idempotency-Key's replay and to keep an asynchronous task's stored npz)."""
    task = load_task(body, hash_inputs=hash_inputs)
    return task, bytes_sha256(body) if hash_body else None


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
    options = parse_options(list(request.query_params.multi_items()), service.backend)
    webhook = await webhook_of(service, options.webhook, options.webhook_events, ("started", "completed"))
    if options.dataset is not None:  # POST /tasks?dataset=: the stored dataset, no body
        return await _handle_dataset(request, service, options, t0, request_id, webhook)
    kind = uploads.check_content_type(request.headers.get("content-type"))
    asynchronous, key = _admitted(request, service)
    await service.runner.check_queued(tenant_of(request), 1)  # the key's max_queued (before the body)
    settings = service.settings
    reservation = service.uploads.reservation()  # the body's bytes, as they arrive, until it is parsed
    try:
        t_recv = time.perf_counter()
        body = await uploads.read_body(request, settings.max_body_bytes, timeout_s=settings.upload_timeout_s,
                                       min_rate=settings.upload_min_rate, reservation=reservation)
        t_parse = time.perf_counter()
        form_config = None
        if kind == uploads.MULTIPART:
            body, form_config = await uploads.split_multipart(request.headers, bytes(body))
        config = options.config(form_config)
        hash_body = asynchronous or key is not None or webhook is not None  # (recorded before it runs)
        late = None
        if not hash_body and options.measure is None and service.runner.batch_max <= 1:
            # A synchronous task, recorded only once it has finished, on a backend that does not
            # batch: its job parses it and checks its budget on the device worker, the hop it
            # takes anyway (a body found invalid there is answered as refused, app.errors.NotAccepted).
            task, body_sha256 = None, None
            late = functools.partial(late_task, body, config, settings.max_task_work, settings.max_task_bytes,
                                     service.io_pool)
        elif len(body) <= PARSE_ON_LOOP_BYTES:  # a small body: parsing costs less than the hop to a thread
            # (an asynchronous task's input hashes are recorded before its 202; a synchronous one's
            # are computed by its run, on the device worker: the answer carries them)
            task, body_sha256 = _parse(body, hash_body, asynchronous)
        else:
            task, body_sha256 = await asyncio.to_thread(_parse, body, hash_body, asynchronous)
        parse_s = time.perf_counter() - t_parse
    finally:
        reservation.release()
    gate(service)  # a drain may have begun while the body streamed in
    if late is None:
        service.metrics.parse_seconds.observe(parse_s)
        # The budget, before the task is queued: its estimated work and memory (learner.budget).
        check_budget(estimate(task.train_count, task.test_count, config),
                     service.settings.max_task_work, service.settings.max_task_bytes)

    acc = Accepted(
        task_id=new_task_id(), task=task, config=config, backend=options.backend,
        include_scores=options.include_scores, measure=options.measure, mode="async" if asynchronous else "sync",
        request_id=request_id, t0=t0, receive_s=t_parse - t_recv, parse_s=0.0 if late else parse_s,
        body_bytes=len(body), deferred=not hash_body,  # synchronous, no Idempotency-Key: recorded once, when finished
        late=late, owner=tenant_of(request).owner, webhook=webhook, precision=options.precision,
    )
    return await _accepted(request, service, acc, body, body_sha256, key, asynchronous)


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


async def _handle_dataset(request: Request, service: Service, options, t0: float,
                          request_id: str | None, webhook: dict | None) -> Response:
    """A task on a stored dataset (issue #31): no body; the dataset's parsed arrays (parsed once
    per process); from there the same path as an uploaded task's, so the same answer, plus the
    dataset's digest and, with its labels, the count of correct predictions."""
    declared = request.headers.get("content-length")
    if (declared not in (None, "0")) or request.headers.get("transfer-encoding"):
        raise InvalidRequest("POST /tasks?dataset= trains on the stored dataset and takes no body; send either "
                             "the npz as the body or dataset=<digest>, not both", field="dataset")
    asynchronous, key = _admitted(request, service, upload=False)
    await service.runner.check_queued(tenant_of(request), 1)
    t_parse = time.perf_counter()
    catalog = service.datasets
    record = await asyncio.to_thread(catalog.get, options.dataset, tenant_of(request).owner)
    task = catalog.cached(options.dataset) or await asyncio.to_thread(catalog.task, options.dataset)
    labels = catalog.cached_labels(options.dataset) if record.labels_sha256 else None
    if record.labels_sha256 and labels is None:
        labels = await asyncio.to_thread(catalog.labels, options.dataset)
    config = options.config(None)
    check_budget(estimate(task.train_count, task.test_count, config),
                 service.settings.max_task_work, service.settings.max_task_bytes)
    gate(service)
    acc = Accepted(
        task_id=new_task_id(), task=task, config=config, backend=options.backend,
        include_scores=options.include_scores, measure=options.measure, mode="async" if asynchronous else "sync",
        request_id=request_id, t0=t0, receive_s=0.0, parse_s=time.perf_counter() - t_parse,
        body_bytes=record.bytes, deferred=not (asynchronous or key is not None or webhook is not None),
        dataset=options.dataset, labels=labels, owner=tenant_of(request).owner, webhook=webhook,
        precision=options.precision,
    )
    # (the body's SHA-256 is the dataset's: an Idempotency-Key matches the same bytes however sent)
    return await _accepted(request, service, acc, None, options.dataset.split(":", 1)[1], key, asynchronous)


async def _accepted(request: Request, service: Service, acc: Accepted, body: bytes | memoryview | None,
                    body_sha256: str | None, key: str | None, asynchronous: bool) -> Response:
    """An accepted task, from its record to its answer (any body, or a stored dataset)."""
    runner = service.runner
    record = None
    if not acc.deferred:
        try:  # durable before the 202: an asynchronous task's npz is stored with its record
            record, created = await asyncio.to_thread(
                runner.record, acc, body_sha256, acc.body_bytes, body if asynchronous else None, key)
        except IdempotencyConflict as exc:
            raise Conflict(f"{exc}; use a new key for a new task", task_id=exc.task_id) from None
        if not created:
            return await _existing(request, service, record, asynchronous)
    del body
    if asynchronous:
        runner.feeder.offer(acc)  # recorded queued: the feeder claims it by fair share (any replica's)
        return accepted_response(record)
    try:
        runner.queue(acc)
    except (QueueFull, Unavailable) as exc:  # the queue filled up meanwhile: not accepted after all
        if record is not None:
            await asyncio.to_thread(functools.partial(
                service.ledger.finish, acc.task_id, "failed", None,
                {"status": exc.status, "error": f"not accepted: {exc.message}"}, epoch=acc.epoch))
        raise
    if acc.task is not None:  # (else its job hashes it aside, once parsed)
        _hash_aside(acc.task, service.io_pool)

    settled = await runner.settle(acc, client_gone(request))
    if settled.status == 200 and settled.outcome is not None and wants_npz(request.headers.get("accept")):
        return npz_response(acc.task_id, settled)
    return Response(settled.json(), status_code=settled.status, headers=settled.headers, media_type="application/json")


def accepted_response(record: TaskRecord) -> JSONResponse:
    return JSONResponse(record.summary(), status_code=202,
                        headers={"Location": f"/tasks/{record.id}", "Retry-After": "1"})


async def _existing(request: Request, service: Service, record: TaskRecord, asynchronous: bool) -> Response:
    """An Idempotency-Key seen before with the same body: that task, not a second training."""
    if not asynchronous and not record.finished and record.id in service.runner.pending:
        # the first request's task is still in this process: wait for it too
        record = await service.runner.finished_record(record.id, service.settings.task_timeout_s) or record
    elif not asynchronous and not record.finished and service.runner.shared is not None:
        # ... or on another replica sharing the ledger: wait for its record there
        record = await service.runner.shared.wait_finished(record.id, service.settings.task_timeout_s) or record
    if asynchronous or not record.finished:
        return accepted_response(record)
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
