"""The one way work enters the runner (issue #46): ``TaskRunner.submit`` calls ``submit`` here.

Every task comes through it -- an upload (``POST /tasks`` with a body), a task on a stored dataset
(``?dataset=``), a sweep's or an evaluation's cells, a claim from the ledger (a restart's recovery
is claims too) -- and it decides, by what the task is and nothing else:

    where its body is parsed   ``parse_upload`` (before ``submit``: the budget needs the arrays):
                               by the task's own job on the device worker (a plain synchronous
                               task on a backend that does not batch: the hop it takes anyway),
                               on the loop (a body up to PARSE_ON_LOOP_BYTES: less than the hop to
                               a thread), else on the io pool (asyncio's default executor, sized to
                               the host's cores: a many-core host parses uploads side by side)
    when it is recorded        now, durable before it is queued or answered 202 (asynchronous work,
                               cells, anything with an Idempotency-Key or a webhook); or once it has
                               finished (a plain synchronous task: its client holds the answer)
    where it waits             in the ledger, offered to the feeder, which claims it into the device
                               queue by fair share (asynchronous work, cells); queued here at once
                               within its tenant's share (a synchronous task); or queued as the
                               claim it is (``claimed``: the feeder's own, answered with its launch)

What a route does with the result (a 202, the answer, an idempotent replay) stays the route's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from learner.budget import check_budget, estimate
from learner.hashing import bytes_sha256
from learner.taskio import TaskArrays, load_task

from ..errors import QueueFull, Unavailable
from ..ledger import TaskRecord
from .answers import Settled

# Bodies up to this size are parsed (and their inputs hashed) on the event loop: for them the
# hop to a thread and back costs more than the work (bench/bench_shell.py, docs/performance.md).
PARSE_ON_LOOP_BYTES = 256 * 1024


@dataclasses.dataclass
class Parsed:
    """A task's input, admitted: an uploaded body parsed now (``task``) or by its job later
    (``late``), or a stored dataset's arrays (``stored_task``)."""

    task: TaskArrays | None
    body_sha256: str | None  # computed when the task is recorded before it runs (its replay, its stored npz)
    late: Callable[[], TaskArrays] | None
    parse_s: float
    body_bytes: int = 0  # the npz's size (a stored dataset's: as stored)
    labels: Any = None  # a stored dataset's scoring labels, if attached


@dataclasses.dataclass
class Submitted:
    """What ``submit`` did: ``record`` (recorded now; with ``created`` False it is the task an
    Idempotency-Key already made, nothing new was queued); ``settled``: a synchronous task's answer."""

    record: TaskRecord | None = None
    created: bool = True
    settled: Settled | None = None


def late_task(body: bytes | memoryview, config, max_work: float, max_bytes: float, pool) -> TaskArrays:
    """A synchronous task's body, parsed and budget-checked by its job on the device worker."""
    task = load_task(body, hash_inputs=False)
    check_budget(estimate(task.train_count, task.test_count, config), max_work, max_bytes)
    hash_aside(task, pool)
    return task


def _parse(body: bytes, hash_body: bool, hash_inputs: bool) -> tuple:
    """The task (validated; its input hashes computed when ``hash_inputs``) and, when asked, the
    body's SHA-256 (None otherwise: it costs milliseconds for a draw-0 body, docs/performance.md,
    and is needed only to match an Idempotency-Key's replay and to keep an asynchronous task's
    stored npz)."""
    task = load_task(body, hash_inputs=hash_inputs)
    return task, bytes_sha256(body) if hash_body else None


async def parse_upload(body: bytes | memoryview, config, *, recorded_now: bool, asynchronous: bool,
                       measure: bool, batching: bool, max_work: float, max_bytes: float, pool) -> Parsed:
    """Parse an uploaded body where it costs least (the module's table) and check its budget
    (``learner.budget``: its estimated work and memory), unless its job does both."""
    t0 = time.perf_counter()
    if not recorded_now and not measure and not batching:
        # A synchronous task recorded only once it has finished, on a backend that does not
        # batch: its job parses it and checks its budget on the device worker, the hop it takes
        # anyway (a body found invalid there is answered as refused, app.errors.NotAccepted).
        return Parsed(None, None, functools.partial(late_task, body, config, max_work, max_bytes, pool), 0.0, len(body))
    if len(body) <= PARSE_ON_LOOP_BYTES:  # a small body: parsing costs less than the hop to a thread
        # (an asynchronous task's input hashes are recorded before its 202; a synchronous one's
        # are computed by its run, on the device worker: the answer carries them)
        task, body_sha256 = _parse(body, recorded_now, asynchronous)
    else:
        task, body_sha256 = await asyncio.to_thread(_parse, body, recorded_now, asynchronous)
    parsed = Parsed(task, body_sha256, None, time.perf_counter() - t0, len(body))
    check_budget(estimate(task.train_count, task.test_count, config), max_work, max_bytes)
    return parsed


def stored_task(catalog: Any, digest: str, viewer: str | None, config, max_work: float, max_bytes: float) -> Parsed:
    """A task on a stored dataset (``POST /tasks?dataset=``; blocking: in a thread): the dataset's
    arrays, parsed once per process (app/tasks/datasets.py), and its labels; its budget checked as
    an upload's. Its body's SHA-256 is the dataset's: an Idempotency-Key matches the same bytes
    however they were sent."""
    t0 = time.perf_counter()
    record, task, labels = catalog.load(digest, viewer)
    check_budget(estimate(task.train_count, task.test_count, config), max_work, max_bytes)
    return Parsed(task, digest.split(":", 1)[1], None, time.perf_counter() - t0, record.bytes, labels)


def hash_aside(task: TaskArrays, pool) -> None:
    """A large synchronous task's input hashes (milliseconds for draw 0), computed in the io pool while
    it runs: only its answer needs them, where the run's result takes them (TaskArrays.input_hashes
    waits for this thread if it has not finished). Handed to the pool directly: nobody awaits it,
    so its end need not wake the event loop."""
    if pool is not None and task.train_images.nbytes + task.test_images.nbytes > PARSE_ON_LOOP_BYTES:
        pool.submit(task.input_hashes)


async def submit(runner: Any, work: Any, *, body: bytes | memoryview | None = None, body_sha256: str | None = None,
                 key: str | None = None, messages: list[tuple] | None = None,
                 gone: Callable[[], Awaitable[None]] | None = None, claimed: bool = False) -> Submitted:
    """The runner's one entry (``TaskRunner.submit``): ``work`` is one ``Work`` or a list of
    them (cells: recorded in one transaction with ``messages``, their webhook's outbox rows)."""
    if isinstance(work, list):
        return await _cells(runner, work, messages)
    acc = work
    if claimed:  # recorded already, claimed from the ledger by the feeder: queued as that claim
        runner.queue(acc, fed=True)
        runner.watch(acc)  # (nobody awaits it: the finisher records its outcome)
        return Submitted()
    record, created = None, True
    if not acc.deferred:  # durable before it is queued (an asynchronous task's npz with its record)
        record, created = await asyncio.to_thread(
            runner.record, acc, body_sha256, acc.body_bytes, body if acc.mode == "async" else None, key)
        if not created:
            return Submitted(record, created=False)
        acc.record()
    if acc.mode == "async":
        runner.feeder.offer(acc)  # recorded queued: the feeder claims it by fair share (any replica's)
        return Submitted(record)
    try:
        runner.queue(acc)
    except (QueueFull, Unavailable) as exc:  # the queue filled up meanwhile: not accepted after all
        if record is not None:
            await asyncio.to_thread(functools.partial(
                runner.ledger.finish, acc.task_id, "failed", None,
                {"status": exc.status, "error": f"not accepted: {exc.message}"}, epoch=acc.epoch))
        raise
    if acc.task is not None:  # (else its job hashes it aside, once parsed)
        hash_aside(acc.task, runner.io_pool())
    return Submitted(record, settled=await runner.settle(acc, gone() if gone is not None else None))


async def _cells(runner: Any, accs: list, messages: list[tuple] | None) -> Submitted:
    """A sweep's or an evaluation's cells: recorded in chunks (``cell_chunks``), each chunk in
    one transaction (all of it or none) and offered to the feeder as soon as it is recorded, so
    that the first launches are claimed while the rest are written (any replica's feeder claims
    them by fair share). ``messages`` (the webhook's outbox rows) go with the first chunk. A
    chunk whose cells the ledger has already (the same Idempotency-Key's other request, at once)
    is that request's: only the cells it lacks are recorded here."""
    if not accs:
        return Submitted()
    runner.prepare_ahead(accs)  # the first launches' seed-derived states, while the ledger records the cells
    created = False
    for chunk in cell_chunks(accs, runner.launches_ahead):
        while chunk:
            try:
                await asyncio.to_thread(runner.record_many, chunk, messages)
            except ValueError:  # (ids in the ledger already)
                have = await asyncio.to_thread(runner.ledger.statuses, [acc.task_id for acc in chunk])
                if not have:
                    raise
                chunk, messages = [acc for acc in chunk if acc.task_id not in have], None  # (written with theirs)
                continue
            for acc in chunk:
                acc.record()
                runner.feeder.offer(acc)
            created, messages, chunk = True, None, []
    return Submitted(created=created)


def cell_chunks(accs: list, first: int) -> list[list]:
    """``accs`` cut into the chunks they are recorded in: ``first`` of them (the first launches'),
    then each chunk twice the one before (a 1,320-cell sweep with launches of 132: 264, 528, 528),
    so that a large sweep costs a few more transactions, not one per launch."""
    chunks, at, size = [], 0, max(1, first)
    while at < len(accs):
        chunks.append(accs[at:at + size])
        at, size = at + size, 2 * size
    return chunks
