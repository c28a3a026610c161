"""Graded evaluations (issue #32): the published eleven-draw protocol for one config, on the server.

``POST /evaluations`` names draws (of the published 0..10), a config and a backend. Each draw is
built from the server's MNIST files exactly as ``rev88 make-task --dataset-seed 2026091400+k``
builds it (``learner.taskio.make_task``), stored as a dataset with its query labels attached
(``PublishedDraws``: content-addressed, so built and stored once), and run as an asynchronous task
on it, recorded in the ledger like a sweep's cell: it survives a restart, any replica of a shared
ledger runs it, and on a batching backend the draws (one shape, one config) share launches. The
task's answer counts its correct predictions against the labels it never sees; the labels reach
no answer. With ``measure: "energy"`` each draw also gets a measurement task (the gated protocol,
docs/energy.md) whose predictions must hash as the draw's task's did.

When the last cell has finished, whichever process sees it first grades the evaluation (``grade``,
the figures of ``rev88 evaluate``'s summary.json, by ``learner.evaluate``'s own functions) and
records the result once; after that, reads are one row.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from learner.budget import check_budget, estimate
from learner.config import Config, make_config, unknown_text
from learner.errors import ConfigError
from learner.evaluate import dataset_seed, parse_draws

from ..errors import Conflict, InvalidRequest, NotFound
from ..ledger.evaluations import SORTS, EvaluationRecord, open_evaluations
from ..ledger.outbox import message_rows
from .evaluation_report import (  # noqa: F401 - (its users import them here)
    PROTOCOL,
    cell_ids,
    cell_status,
    comparison_label,
    comparison_of,
    config_changes,
    counts,
    document,
    draw_row,
    draw_set,
    energy_of,
    grade,
    leaderboard_row,
    per_draw,
    progress,
    seed_figures,
    status_of,
)
from .options import MEASURE_PARAMS, measure_arguments
from .runner import new_task_id
from .sweeps import NEVER_RECORDED, seeds_of
from .work import Work

log = logging.getLogger("rev88." + __name__)

FINISHED = ("succeeded", "failed", "cancelled")


# --------------------------------------------------------------------------- the request


def check_definition(body: dict[str, Any], backend: str, settings: Any) -> dict[str, Any]:
    """The request as it is recorded: draws a sorted list, the config whole, the measurement's
    arguments filled in. A 422 names the field (``draws``, the config key, ``protocol``...)."""
    try:
        draws = parse_draws(body.get("draws", "0-10"), "draws")
    except ValueError as exc:
        raise InvalidRequest(str(exc), field="draws") from None
    overrides = body.get("config") or {}
    try:
        config = make_config(overrides)
    except ConfigError as exc:
        unknown = sorted(set(overrides) - set(Config().as_dict()))
        field = (getattr(exc, "details", None) or {}).get("field") or (unknown[0] if unknown else "config")
        raise InvalidRequest(f"config: {exc}", field=field) from None
    measure, protocol = body.get("measure"), body.get("protocol")
    if protocol and measure is None:
        raise InvalidRequest("protocol only applies with measure: \"energy\"", field="protocol")
    unknown = sorted(set(protocol or {}) - set(MEASURE_PARAMS))
    if unknown:
        raise InvalidRequest(f"protocol key(s) {unknown_text(unknown, MEASURE_PARAMS)} are not known; the keys are "
                             f"{', '.join(MEASURE_PARAMS)}", field="protocol")
    definition: dict[str, Any] = {"draws": draws, "config": config.as_dict(), "backend": backend,
                                  "name": body.get("name"), "measure": measure}
    if body.get("seeds") is not None:
        if "seed" in overrides:
            raise InvalidRequest("give the seed in config or the seeds, not both", field="seeds")
        definition["seeds"] = seeds_of(body["seeds"])
    if measure is not None:
        definition["protocol"] = measure_arguments({k: str(v) for k, v in (protocol or {}).items()})
    if body.get("webhook") is not None:  # checked by the route (app/webhooks): {"url", "events"}
        definition["webhook"] = body["webhook"]
    each = estimate(10000, 10000, config)
    check_budget(each, settings.max_task_work, settings.max_task_bytes)  # each draw's
    runs = len(draws) * len(definition.get("seeds", [0]))
    if "seeds" in definition:  # bounded as a sweep of as many cells is
        if runs > settings.sweep_max_cells:
            raise InvalidRequest(f"the evaluation has {len(draws)} draws x {len(definition['seeds'])} seeds = {runs} "
                                 f"runs; at most {settings.sweep_max_cells} (REV88_SWEEP_MAX_CELLS)",
                                 field="seeds", limit=settings.sweep_max_cells)
        if runs * each.work > settings.sweep_max_work:
            raise InvalidRequest(f"the evaluation needs an estimated {runs * each.work:,} work units in all; at most "
                                 f"{settings.sweep_max_work:,} (REV88_SWEEP_MAX_WORK)", field="seeds",
                                 limit=settings.sweep_max_work)
    return definition


def runs_of(definition: dict[str, Any]) -> int:
    """Tasks an evaluation records: one per draw and seed, twice that when each is measured."""
    runs = len(definition["draws"]) * len(definition.get("seeds") or [0])
    return runs * (2 if definition.get("measure") is not None else 1)


# --------------------------------------------------------------------------- the draws


@dataclass(frozen=True)
class Draw:
    draw: int
    digest: str  # the stored dataset's
    query_labels_sha256: str  # learner.hashing.array_sha256 of the int64 labels, as rev88 evaluate reports it
    input_hashes: dict[str, str]
    build_seconds: float


class PublishedDraws:
    """The published draws as stored datasets with their labels attached, built on first use."""

    def __init__(self, catalog: Any, mnist_dir: str | Path | None) -> None:
        self.catalog, self.mnist_dir = catalog, mnist_dir
        self._known: dict[int, Draw] = {}
        self._lock = threading.Lock()

    def ensure(self, k: int) -> Draw:
        """(blocking) Draw k stored, its labels attached; built when this process has not."""
        with self._lock:
            known = self._known.get(k)
            if known is not None:
                record = self.catalog.store.get(known.digest)
                if record is not None and record.labels_sha256 is not None:
                    return known
            drawn = self._build(k)
            self._known[k] = drawn
            return drawn

    def _build(self, k: int) -> Draw:
        from learner.hashing import array_sha256
        from learner.taskio import InputError, make_task, task_to_npz_bytes

        t0 = time.perf_counter()
        try:
            task, labels = make_task(self.mnist_dir, dataset_seed(k))
        except (InputError, OSError) as exc:
            raise InvalidRequest(f"the server cannot build draw {k} from its MNIST files ({exc}); "
                                 "set REV88_MNIST_DIR to a folder with the official files") from None
        record, _ = self.catalog.put(task_to_npz_bytes(task))
        npy = io.BytesIO()
        np.save(npy, labels.astype(np.int64))
        try:
            self.catalog.put_labels(record.digest, npy.getvalue())
        except Conflict:
            raise Conflict(f"dataset {record.digest} (published draw {k}) has other scoring labels attached than "
                           "the draw's own; DELETE /datasets/" + record.digest + " to let evaluations store it "
                           "with its true labels", field="draws") from None
        return Draw(k, record.digest, array_sha256(labels.astype(np.int64)), dict(task.input_hashes()),
                    time.perf_counter() - t0)


# --------------------------------------------------------------------------- grading


class Evaluations:
    """The evaluations of a service, over its task runner and dataset catalog (what the routes call)."""

    def __init__(self, runner: Any, datasets: Any, settings: Any) -> None:
        self.runner, self.datasets, self.settings = runner, datasets, settings
        self.store = open_evaluations(datasets.store)
        self.draws = PublishedDraws(datasets, None)  # $REV88_MNIST_DIR, else the checkout's data/mnist
        self._grading: set[asyncio.Task] = set()
        self._to_grade: set[str] = set()  # evaluations whose grading is scheduled, not begun
        runner.recorded_hooks.append(self._recorded)

    async def submit(self, body: dict[str, Any], backend: str, key: str | None,
                     tenant: Any = None) -> tuple[EvaluationRecord, bool]:
        """Check the request, build (or find) its draws, record the evaluation and its cells and
        queue them; an Idempotency-Key seen before: that evaluation (its missing cells recorded
        now), another request under it a 409."""
        definition = check_definition(body, backend, self.settings)
        if key is not None:
            seen = await asyncio.to_thread(self.store.by_key, key)
            if seen is not None:
                self._replay(seen, definition)
                await self._record_cells(seen)  # (cells a crash kept out of the ledger)
                return seen, False
        if tenant is not None:  # its cells are its tasks: max_queued counts them
            await self.runner.check_queued(tenant, runs_of(definition))
        self.runner.feeder.check_capacity(runs_of(definition), uploads=False)
        draws = [await asyncio.to_thread(self.draws.ensure, k) for k in definition["draws"]]
        if tenant is not None:  # the draws' datasets are the tenant's to see, as if it had sent them
            for d in draws:
                await asyncio.to_thread(self.datasets.owners.own, d.digest, tenant.id)
        owner = None if tenant is None else tenant.owner
        measured = definition.get("measure") is not None
        cells = []
        for d in draws:  # (draw-major: a draw's seeds share its dataset, and on a batching backend launches)
            for seed in definition.get("seeds") or [None]:
                cell = {"draw": d.draw, **({} if seed is None else {"seed": seed}), "dataset": d.digest,
                        "task_id": new_task_id(), "input_hashes": d.input_hashes,
                        "query_labels_sha256": d.query_labels_sha256, "build_seconds": round(d.build_seconds, 6)}
                if measured:
                    cell["measure_task_id"] = new_task_id()
                cells.append(cell)
        record = EvaluationRecord(id="ev-" + uuid.uuid4().hex, created_at=time.time(), name=definition.get("name"),
                                  definition=definition, cells=cells, idempotency_key=key, owner=owner)
        stored, created = await asyncio.to_thread(self.store.create, record)
        if not created:  # (the same key sent twice at once: the first one's)
            stored = self._replay(stored, definition)
        await self._record_cells(stored, fresh=created)
        return stored, created

    def _replay(self, seen: EvaluationRecord, definition: dict[str, Any]) -> EvaluationRecord:
        if seen.definition != definition:
            raise Conflict(f"Idempotency-Key was already used for evaluation {seen.id} with another request; use a "
                           "new key for a new evaluation", evaluation_id=seen.id)
        return seen

    async def _record_cells(self, ev: EvaluationRecord, fresh: bool = False) -> None:
        """Record and queue the evaluation's cells that the ledger does not have yet (``fresh``:
        created just now, its cells' new ids cannot be there: not asked)."""
        runner, catalog = self.runner, self.datasets
        if ev.cancelled_at is not None:  # (a replay of a cancelled evaluation: its draws never recorded stay so)
            return
        ids = [c["task_id"] for c in ev.cells] + [c["measure_task_id"] for c in ev.cells if "measure_task_id" in c]
        have = {} if fresh else await asyncio.to_thread(runner.ledger.get_many, ids)
        base = ev.definition["config"]
        configs = {seed: make_config(base if seed is None else {**base, "seed": seed})
                   for seed in ev.definition.get("seeds") or [None]}
        protocol = ev.definition.get("protocol")

        def inputs(digests: list[str]) -> dict:  # (blocking: one thread hop for every draw)
            return {d: catalog.load(d) for d in digests}

        draws = await asyncio.to_thread(inputs, sorted({c["dataset"] for c in ev.cells}))
        accs = []
        for cell in ev.cells:
            wanted = [(cell["task_id"], None)]
            if "measure_task_id" in cell:
                wanted.append((cell["measure_task_id"], protocol))
            wanted = [(t, m) for t, m in wanted if t not in have]
            if not wanted:
                continue
            digest = cell["dataset"]
            record, task, labels = draws[digest]
            accs += [Work(task_id=t, task=task, config=configs[cell.get("seed")], backend=ev.definition["backend"], measure=m,
                              mode="async", body_bytes=record.bytes, dataset=digest, labels=labels, evaluation=ev.id,
                              owner=ev.owner)
                     for t, m in wanted]
        if not accs:
            return
        # its webhook's message, with the cells' first chunk (the first time they are recorded)
        messages = message_rows("evaluation", ev.id, ev.definition.get("webhook"), ev.owner) if not have else []
        await runner.submit(accs, messages=messages)  # in chunks, each waiting in the ledger for the feeder at once
        latest = await asyncio.to_thread(self.store.get, ev.id)
        if latest is not None and latest.cancelled_at is not None:  # cancelled while its chunks were recorded
            await asyncio.gather(*(runner.cancel(acc.task_id) for acc in accs), return_exceptions=True)

    # ------------------------------------------------------------------ reading and grading
    async def get(self, evaluation_id: str, viewer: str | None = None) -> EvaluationRecord:
        ev = await asyncio.to_thread(self.store.get, evaluation_id)
        if ev is None or (viewer is not None and ev.owner != viewer):  # (another tenant's: absent)
            raise NotFound(f"no evaluation {evaluation_id!r} here")
        return ev

    async def state(self, evaluation_id: str, viewer: str | None = None) -> dict[str, Any]:
        ev = await self.get(evaluation_id, viewer)
        if ev.result is not None:
            return document(ev)
        ev, rows, status = await self._grade(ev)
        return document(ev, rows, status)

    async def _grade(self, ev: EvaluationRecord) -> tuple[EvaluationRecord, list[dict[str, Any]], str]:
        """The draws' rows from their tasks' records; when all have finished, the result recorded."""
        await self.runner.written()
        ids = [c["task_id"] for c in ev.cells] + [c["measure_task_id"] for c in ev.cells if "measure_task_id" in c]
        records = await asyncio.to_thread(self.runner.ledger.get_many, ids, False)  # (no predictions needed)
        if ev.cancelled_at is not None:  # its draws never recorded read as cancelled (they never run)
            records = {t: records.get(t, NEVER_RECORDED) for t in ids}
        rows = []
        for cell in ev.cells:
            row = draw_row(cell, records.get(cell["task_id"]), records.get(cell.get("measure_task_id", "")))
            row["build_seconds"] = cell.get("build_seconds")
            rows.append(row)
        status = status_of(ev, rows)
        if status in ("queued", "running"):
            return ev, rows, status
        figures = grade(ev, rows)
        result = {"draws": rows, **figures}
        totals_ = figures["totals"]
        time_ = figures["time"] or {}
        energy = figures["energy"] or {}
        stored = await asyncio.to_thread(
            self.store.finish, ev.id, status, result, None if totals_ is None else totals_["mean_accuracy"],
            time_.get("ms_per_task") if totals_ is not None else None, energy.get("mj_per_task"))
        return stored or ev, rows, status

    def _recorded(self, acc: Any, outcome: Any) -> None:
        """A cell's outcome is in the ledger: grade its evaluation if that was the last one (the
        process whose outcome commits last sees every cell finished)."""
        if acc.evaluation is None or outcome.status not in FINISHED:
            return
        if acc.evaluation in self._to_grade:  # (a launch answers many cells of one evaluation: graded once)
            return
        self._to_grade.add(acc.evaluation)
        task = asyncio.get_running_loop().create_task(self._grade_quietly(acc.evaluation))
        self._grading.add(task)
        task.add_done_callback(self._grading.discard)

    async def _grade_quietly(self, evaluation_id: str) -> None:
        self._to_grade.discard(evaluation_id)  # (cells recorded from now on ask again)
        try:
            ev = await asyncio.to_thread(self.store.get, evaluation_id)
            if ev is not None and ev.result is None:
                await self._grade(ev)
        except Exception as exc:  # noqa: BLE001 - the next read grades it instead
            log.warning("evaluation not graded yet", extra={"evaluation": evaluation_id, "error": str(exc)})

    async def page(self, limit: int, cursor: str | None, sort: str,
                   viewer: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the leaderboard (ungraded evaluations whose cells have all finished are
        graded first, so that they sort where they belong)."""
        if sort not in SORTS:
            raise InvalidRequest(f"sort must be one of {', '.join(SORTS)}, got {sort!r}", field="sort")
        await self.runner.written()
        unfinished = await asyncio.to_thread(self.store.unfinished)
        statuses = await self._statuses([t for ev in unfinished for t in cell_ids(ev)])
        for ev in unfinished:  # (each read once, answers included, when its last task has finished)
            if progress(ev, statuses)[0] == "graded":
                await self._grade(ev)
        try:
            records, next_cursor = await asyncio.to_thread(self.store.list, limit, cursor, sort, viewer)
        except ValueError as exc:
            raise InvalidRequest(str(exc), field="cursor") from None
        missing = [t for ev in records if ev.result is None for t in cell_ids(ev) if t not in statuses]
        statuses.update(await self._statuses(missing))  # (made since the first read)
        rows = []
        for ev in records:
            live = None
            if ev.result is None:
                status, draw_counts = progress(ev, statuses)
                live = ("running" if status == "graded" else status), draw_counts  # (graded by the next read)
            rows.append(leaderboard_row(ev, live))
        return rows, next_cursor

    async def _statuses(self, task_ids: list[str]) -> dict[str, str]:
        """The tasks' statuses in one status-only query (no answers read)."""
        return await asyncio.to_thread(self.runner.ledger.statuses, task_ids) if task_ids else {}

    async def cancel(self, evaluation_id: str, viewer: str | None = None) -> dict[str, Any]:
        """Every unfinished cell cancelled (queued ones never run, running ones stopped). An
        evaluation whose cells have all finished is left as it is (Conflict, 409: as a finished
        task's cancel)."""
        doc = await self.state(evaluation_id, viewer)
        if doc["status"] not in ("queued", "running"):
            raise Conflict(f"evaluation {evaluation_id} has already finished ({doc['status']}); nothing to cancel",
                           evaluation_status=doc["status"])
        ev = await self.get(evaluation_id, viewer)
        await asyncio.to_thread(self.store.cancel, evaluation_id)
        ids = [c["task_id"] for c in ev.cells] + [c["measure_task_id"] for c in ev.cells if "measure_task_id" in c]
        records = await asyncio.to_thread(self.runner.ledger.get_many, ids)
        unfinished = [t for t in ids if cell_status(records.get(t)) not in FINISHED]
        await asyncio.gather(*(self.runner.cancel(t) for t in unfinished), return_exceptions=True)
        return await self.state(evaluation_id, viewer)
