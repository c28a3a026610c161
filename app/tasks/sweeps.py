"""Sweeps (issue #31): one stored dataset, a grid of config values × seeds, one request.

A sweep's cells are the grid's product (every combination of its values) times its seeds, each
over the base config; an empty grid is the base config once per seed. Every cell's config is
checked against the config bounds and the task budget before anything is recorded (a 422 naming
the parameter and the value), and the sweep's cell count and total work have limits
(REV88_SWEEP_MAX_CELLS, REV88_SWEEP_MAX_WORK). Then each cell is an asynchronous task on the
dataset, recorded in the ledger like any other (``POST /tasks?dataset=`` with the cell's config
would give the same answer, byte for byte): it survives a restart, on the shared ledger any
replica runs it, and on a backend with batched launches the cells of one shape and config but
the seed share launches (app/tasks/device.py ``launch_key``). A sweep is its definition and its
cells' task ids; its state is read from the cells' own records (``state``).
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import itertools
import time
import uuid
from typing import Any

from learner.budget import check_budget, estimate
from learner.config import FIELDS, Config, make_config
from learner.errors import ConfigError

from ..errors import Conflict, InvalidRequest, NotFound
from ..ledger.datasets import SweepRecord
from ..ledger.outbox import message_rows
from .runner import new_task_id
from .work import Work

FINISHED = ("succeeded", "failed", "cancelled")
CELL_STATUSES = ("queued", "running", *FINISHED)
FINISHED_ROWS = 200_000  # finished cells' rows kept in memory (GET /sweeps/<id> reads only the others)


@dataclasses.dataclass(frozen=True)
class NeverRecorded:
    """What a cell of a cancelled sweep (or evaluation) that the ledger never recorded reads as:
    cancelled. Its chunk came after the cancel, or never came (a crash or a ledger error between
    two chunks, app/tasks/submit.py); once cancelled, no more of its cells are recorded, so it
    never runs."""

    status: str = "cancelled"
    answer: None = None
    error: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"status": 409, "error": "cancelled before it was recorded"})
    backend: None = None


NEVER_RECORDED = NeverRecorded()


def expand(definition: dict[str, Any]) -> list[Config]:
    """The cells' configs, in order (the grid's keys in the order given, the seeds innermost)."""
    base = definition.get("config") or {}
    grid = definition.get("grid") or {}
    if "seed" in base or "seed" in grid:
        raise InvalidRequest("seeds are given by 'seeds', not in 'config' or 'grid'", field="seed")
    for name, values in grid.items():
        if name not in FIELDS:
            raise InvalidRequest(f"grid parameter {name!r} is not a config key; the keys are {', '.join(FIELDS)}",
                                 field=name)
        if not isinstance(values, list) or not values:
            raise InvalidRequest(f"grid parameter {name!r} needs a non-empty list of values, got {values!r}",
                                 field=name)
    seeds = seeds_of(definition.get("seeds", [0]))
    names = list(grid)
    cells = []
    for combo in itertools.product(*(grid[n] for n in names)) if names else [()]:
        for seed in seeds:
            overrides = {**base, **dict(zip(names, combo)), "seed": seed}
            try:
                cells.append(make_config(overrides))
            except ConfigError as exc:
                raise InvalidRequest(f"cell {dict(zip(names, combo)) | {'seed': seed}}: {exc}",
                                     field=(getattr(exc, "details", None) or {}).get("field")) from None
    return cells


def seeds_of(seeds: Any) -> list[int]:
    if isinstance(seeds, dict):
        if set(seeds) != {"start", "count"}:
            raise InvalidRequest("seeds is a list of integers or {\"start\": S, \"count\": N}", field="seeds")
        start, count = seeds["start"], seeds["count"]
        if not (isinstance(start, int) and isinstance(count, int) and count >= 1 and start >= 0):
            raise InvalidRequest(f"seeds {{start, count}} must be integers, start >= 0 and count >= 1; got {seeds}",
                                 field="seeds")
        return list(range(start, start + count))
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                           for s in seeds):
        raise InvalidRequest(f"seeds must be a non-empty list of integers, got {seeds!r}", field="seeds")
    if len(set(seeds)) != len(seeds):
        raise InvalidRequest("seeds are given more than once", field="seeds")
    return list(seeds)


def check_limits(cells: list[Config], train_count: int, test_count: int, *, max_cells: int, max_work: int,
                 max_task_work: int, max_task_bytes: int) -> int:
    """Every cell within the task budget; the sweep within its own limits. Returns its work."""
    if len(cells) > max_cells:
        raise InvalidRequest(f"the sweep has {len(cells)} cells; at most {max_cells} (REV88_SWEEP_MAX_CELLS)",
                             limit=max_cells)
    total = 0
    for config in cells:
        est = estimate(train_count, test_count, config)
        check_budget(est, max_task_work, max_task_bytes)
        total += est.work
    if total > max_work:
        raise InvalidRequest(f"the sweep needs an estimated {total:,} work units in all; at most {max_work:,} "
                             "(REV88_SWEEP_MAX_WORK)", limit=max_work)
    return total


def new_sweep(dataset: str, definition: dict[str, Any], cells: list[Config], task_ids: list[str],
              key: str | None, owner: str | None = None) -> SweepRecord:
    return SweepRecord(id="sw-" + uuid.uuid4().hex, created_at=time.time(), dataset=dataset, definition=definition,
                       cells=[{"task_id": t, "config": c.as_dict()} for t, c in zip(task_ids, cells)],
                       idempotency_key=key, owner=owner)


def cell_row(cell: dict[str, Any], record: Any) -> dict[str, Any]:
    """A cell's row of the sweep's table, from its task's record (None: not recorded yet)."""
    if record is None:
        return outcome_row(cell["task_id"], cell["config"], "queued", None, None)
    return outcome_row(cell["task_id"], cell["config"], record.status, record.answer, record.error, record.backend)


def outcome_row(task_id: str, config: dict[str, Any], status: str, answer: dict[str, Any] | None,
                error: dict[str, Any] | None, backend: str | None = None) -> dict[str, Any]:
    """A cell's row from its status and, when finished, its answer or error; ``backend``: the
    one its task runs on (the device, as the answer names it, once it has succeeded)."""
    row = {"task_id": task_id, "config": config, "status": status, "backend": backend, "device": None}
    if answer and status == "succeeded":
        row["device"] = answer.get("device")
        row["predictions_sha256"] = answer.get("predictions_sha256")
        row["timing"] = answer.get("timing")
        if answer.get("energy") is not None:
            row["energy"] = answer["energy"]
        for name in ("correct", "total", "accuracy"):
            if name in answer:
                row[name] = answer[name]
    elif error:
        row["error"] = error.get("error")
    return row


def count(statuses: list[str]) -> dict[str, int]:
    """Cells by task status (every status, zeros included)."""
    counts = dict.fromkeys(CELL_STATUSES, 0)
    for status in statuses:
        counts[status] += 1
    return counts


def sweep_status(sweep: SweepRecord, counts: dict[str, int]) -> str:
    """queued (no cell started), running, completed (every cell finished) or cancelled (finished
    after a cancel): the document's and the list's status, from the cells' counts."""
    unfinished = counts["queued"] + counts["running"]
    if sweep.cancelled_at is not None and not unfinished and counts["cancelled"]:
        return "cancelled"  # (a cancel that came as its last cells finished, and stopped none: completed)
    if not unfinished:
        return "completed"
    return "queued" if counts["queued"] == sum(counts.values()) else "running"


def state(sweep: SweepRecord, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A sweep's document: its definition, status, counts by status, and its cells' rows."""
    counts = count([row["status"] for row in rows])
    return {"id": sweep.id, "status": sweep_status(sweep, counts), "dataset": sweep.dataset,
            "created_at": sweep.created_at, "cancelled_at": sweep.cancelled_at, "definition": sweep.definition,
            "counts": counts, "cells": rows}


def summary(sweep: SweepRecord, counts: dict[str, int]) -> dict[str, Any]:
    """A sweep in a list: its status and counts, no cell rows (GET /sweeps/<id> has them)."""
    return {"id": sweep.id, "status": sweep_status(sweep, counts), "dataset": sweep.dataset,
            "created_at": sweep.created_at, "cancelled_at": sweep.cancelled_at, "definition": sweep.definition,
            "cells": len(sweep.cells), "counts": counts, "location": f"/sweeps/{sweep.id}"}


def as_csv(doc: dict[str, Any]) -> str:
    """The cell table: one row per cell, the config's keys as columns."""
    keys = list(FIELDS)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["task_id", "status", *keys, "predictions_sha256", "run_ms", "total_ms", "correct", "total",
                     "accuracy"])
    for row in doc["cells"]:
        timing = row.get("timing") or {}
        writer.writerow([row["task_id"], row["status"], *(row["config"].get(k) for k in keys),
                         row.get("predictions_sha256", ""), timing.get("run_ms", ""), timing.get("total_ms", ""),
                         row.get("correct", ""), row.get("total", ""), row.get("accuracy", "")])
    return out.getvalue()


class Sweeps:
    """The sweeps of a service, over its task runner and dataset catalog (what the routes call)."""

    def __init__(self, runner: Any, datasets: Any, settings: Any) -> None:
        self.runner, self.datasets, self.settings = runner, datasets, settings
        self._finished: dict[str, dict[str, Any]] = {}  # task id -> its finished cell's row
        self._settled: dict[str, dict[str, int]] = {}  # sweep id -> its counts, once every cell has finished
        runner.recorded_hooks.append(self._recorded)

    async def submit(self, definition: dict[str, Any], backend: str, key: str | None,
                     owner: str | None = None, tenant: Any = None) -> tuple[SweepRecord, bool]:
        """Check the sweep, record it and its cells (each an asynchronous task on the dataset) and
        queue them; an Idempotency-Key seen before: that sweep (its missing cells, after a crash
        between the two records, recorded now), another definition under it a 409. ``owner``: the
        tenant making it (its dataset must be one of its own)."""
        catalog = self.datasets
        record = await asyncio.to_thread(catalog.get, definition["dataset"], owner)
        cells = expand(definition)
        s = self.settings
        check_limits(cells, record.train_count, record.test_count, max_cells=s.sweep_max_cells,
                     max_work=s.sweep_max_work, max_task_work=s.max_task_work, max_task_bytes=s.max_task_bytes)
        if tenant is not None:  # its cells are its tasks: max_queued counts them
            await self.runner.check_queued(tenant, len(cells))
        self.runner.feeder.check_capacity(len(cells), uploads=False)  # they wait in the ledger's backlog
        # the first launches' seed-derived states computed while the sweep and its cells are recorded
        self.runner.prepare_states_ahead([(config, record.train_count) for config in cells])
        task_ids = [new_task_id() for _ in cells]
        sweep, created = await asyncio.to_thread(catalog.store.create_sweep,
                                                 new_sweep(record.digest, definition, cells, task_ids, key, owner))
        if not created and sweep.definition != definition:
            raise Conflict(f"Idempotency-Key {key!r} was already used for sweep {sweep.id} with another definition; "
                           "use a new key for a new sweep", sweep_id=sweep.id)
        await self._record_cells(sweep, backend, configs=cells if created else None)
        return sweep, created

    async def _record_cells(self, sweep: SweepRecord, backend: str, configs: list[Config] | None = None) -> None:
        """Record and queue the sweep's cells that the ledger does not have yet. ``configs``: the
        sweep was created just now from these, one a cell in order: its cells' new ids cannot be in
        the ledger (not asked), and their configs are not made again from the record's."""
        fresh = configs is not None
        runner, catalog = self.runner, self.datasets
        if sweep.cancelled_at is not None:  # (a replay of a cancelled sweep: its cells never recorded stay so)
            return
        have = {} if fresh else await asyncio.to_thread(runner.ledger.get_many, [c["task_id"] for c in sweep.cells])
        missing = [c for c in sweep.cells if c["task_id"] not in have]
        if not missing:
            return
        record, task, labels = await asyncio.to_thread(catalog.load, sweep.dataset)
        include = bool(sweep.definition.get("include_scores"))
        if configs is None:
            configs = [make_config(c["config"]) for c in missing]
        accs = [Work(task_id=c["task_id"], task=task, config=config, backend=backend,
                     include_scores=include, mode="async", body_bytes=record.bytes, dataset=sweep.dataset,
                     labels=labels, sweep=sweep.id, owner=sweep.owner) for c, config in zip(missing, configs, strict=True)]
        # its webhook's message, with the cells' first chunk (the first time they are recorded)
        messages = (message_rows("sweep", sweep.id, sweep.definition.get("webhook"), sweep.owner)
                    if len(missing) == len(sweep.cells) else [])
        await runner.submit(accs, messages=messages)  # in chunks, each waiting in the ledger for the feeder at once
        latest = await asyncio.to_thread(catalog.store.get_sweep, sweep.id)
        if latest is not None and latest.cancelled_at is not None:  # cancelled while its chunks were recorded
            await asyncio.gather(*(runner.cancel(acc.task_id) for acc in accs), return_exceptions=True)

    async def state(self, sweep_id: str, viewer: str | None = None) -> dict[str, Any]:
        sweep = await asyncio.to_thread(self.datasets.store.get_sweep, sweep_id)
        if sweep is None or (viewer is not None and sweep.owner != viewer):  # (another tenant's: absent)
            raise NotFound(f"no sweep {sweep_id!r} here")
        await self.runner.written()
        # a finished cell's row never changes: kept here, so that a poll reads only the rest
        rows = {c["task_id"]: self._finished.get(c["task_id"]) for c in sweep.cells}
        missing = [task_id for task_id, row in rows.items() if row is None]
        records = await asyncio.to_thread(self.runner.ledger.get_many, missing, False) if missing else {}
        unrecorded = NEVER_RECORDED if sweep.cancelled_at is not None else None
        for cell in sweep.cells:
            if rows[cell["task_id"]] is None:
                record = records.get(cell["task_id"])
                row = rows[cell["task_id"]] = cell_row(cell, record or unrecorded)
                if row["status"] in FINISHED and record is not None:
                    self._keep(row)
        return state(sweep, [rows[c["task_id"]] for c in sweep.cells])

    async def page(self, limit: int, cursor: str | None,
                   viewer: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """One page of GET /sweeps, each sweep with its status and counts: the cells this process
        has not seen finish are read in one status-only query for the whole page (a finished
        sweep's counts are kept: they never change)."""
        sweeps, next_cursor = await asyncio.to_thread(self.datasets.store.list_sweeps, limit, cursor, viewer)
        await self.runner.written()
        known = {s.id: self._settled.get(s.id) for s in sweeps}
        ask = [c["task_id"] for s in sweeps if known[s.id] is None for c in s.cells
               if c["task_id"] not in self._finished]
        statuses = await asyncio.to_thread(self.runner.ledger.statuses, ask) if ask else {}
        rows = []
        for s in sweeps:
            counts = known[s.id]
            if counts is None:
                unrecorded = "queued" if s.cancelled_at is None else NEVER_RECORDED.status  # (not recorded yet)
                counts = count([(self._finished.get(c["task_id"]) or {}).get("status")
                                or statuses.get(c["task_id"], unrecorded) for c in s.cells])
                if not counts["queued"] and not counts["running"]:
                    if len(self._settled) >= FINISHED_ROWS:
                        self._settled.clear()
                    self._settled[s.id] = counts
            rows.append(summary(s, counts))
        return rows, next_cursor

    def _recorded(self, acc: Any, outcome: Any) -> None:
        """A cell of this process has its outcome in the ledger: its row kept from the answer in
        hand, so that no poll reads the answer back (decompressing and parsing its predictions:
        about as much CPU as writing it). Cells other replicas ran are read from the ledger."""
        if acc.sweep is not None and outcome.status in FINISHED:
            self._keep(outcome_row(acc.task_id, acc.config.as_dict(), outcome.status, outcome.answer, outcome.error,
                                   acc.backend))

    def _keep(self, row: dict[str, Any]) -> None:
        if len(self._finished) >= FINISHED_ROWS:
            self._finished.clear()  # (a bound, not a policy: the rows are read again when asked)
        self._finished[row["task_id"]] = row

    async def cancel(self, sweep_id: str, viewer: str | None = None) -> dict[str, Any]:
        """Every unfinished cell cancelled (queued ones never run, running ones stopped); finished
        cells kept. A sweep whose cells have all finished is left as it is (Conflict, 409: as a
        finished task's cancel)."""
        doc = await self.state(sweep_id, viewer)
        if doc["status"] in ("completed", "cancelled"):
            raise Conflict(f"sweep {sweep_id} has already finished ({doc['status']}); nothing to cancel",
                           sweep_status=doc["status"])
        await asyncio.to_thread(self.datasets.store.cancel_sweep, sweep_id)
        unfinished = [row["task_id"] for row in doc["cells"] if row["status"] not in FINISHED]
        await asyncio.gather(*(self.runner.cancel(task_id) for task_id in unfinished), return_exceptions=True)
        return await self.state(sweep_id)
