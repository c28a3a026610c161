"""Check that the tests can fail: each mutant below is a small, plausible bug put into the code
(one string replaced in one file); the tests named beside it must fail with it in place.

    python scripts/mutants.py            every mutant: applied, its tests run, the file restored
    python scripts/mutants.py m3 m12b    only these (by name prefix)
    python scripts/mutants.py --list     the mutants and the tests that kill them

A mutant whose text is no longer in its file says so ("does not apply"): the code moved, so the
mutant must be written again against the new code, not dropped. Each file is restored from the
copy read before the change, whatever happens (Ctrl-C included); nothing is committed. Run it
with nothing else changing the tree (docs/development.md, "Can a test fail?").
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    # ---- answers paired with the wrong task (issue #54)
    Mutant("m1_digests_by_position", "a launch's large hashes paired by position among the tasks that ran",
           "app/tasks/device.py",
           "            group = ran[at:at + DIGEST_GROUP]\n",
           "            group = list(range(at, min(at + DIGEST_GROUP, count)))\n",
           ("tests/test_pairing.py", "-k", "sqlite or hash_groups")),
    Mutant("m2_another_items_config", "a launch's result built with another item's config", "app/tasks/device.py",
           "result = finish_task(task, config, launch.engine,",
           "result = finish_task(task, launch.runs[[j for j, r in enumerate(launch.runs) if isinstance(r, tuple)][0]][1], "
           "launch.engine,",
           ("tests/test_pairing.py", "-k", "sqlite")),
    Mutant("m3_cells_numbered_among_fed", "a launch's outcomes paired with its items asynchronous ones first "
           "(a cell given a synchronous task's answer when both share a launch)", "app/tasks/launches.py",
           "self.finisher.launch([(item[3], value) for item, value in zip(launch.items, outcomes)],",
           "self.finisher.launch([(item[3], value) for item, value in zip(sorted(launch.items, "
           "key=lambda it: it[3].mode), outcomes)],",
           ("tests/test_pairing.py", "-k", "sqlite")),
    Mutant("m4_writer_slice_not_advancing", "the ledger writer's slice of a launch's results not advancing",
           "app/ledger/writer.py", "                at += len(o)\n", "                pass\n",
           ("tests/test_pairing.py", "-k", "writer")),
    Mutant("m5_fused_output_buffer_reused", "the fused backend's output buffer reused across launches of one shape",
           "learner/backends/fused.py", "        out = LaunchOutputs(count, m, size, self.torch_device)\n",
           "        cache = self.__dict__.setdefault('_outs', {})\n"
           "        out = cache.setdefault((count, m, size), LaunchOutputs(count, m, size, self.torch_device))\n",
           ("tests/test_fused.py", "-k", "outlive")),
    # ---- fair share and claims
    Mutant("m6_sqlite_claim_ignores_picks", "SQLite's claim taking the oldest task of any tenant",
           "app/ledger/local_claims.py", "for tenant, n in picks or []:", "for tenant, n in []:",
           ("tests/test_fair_share.py", "-k", "not replicas and not shared_ledger")),
    Mutant("m7_claims_ignore_weights", "the claims ignoring tenant weights", "app/tasks/backlog.py",
           "Waiting(self.runner.weight_of(t), oldest, count)", "Waiting(1.0, oldest, count)",
           ("tests/test_fair_share.py", "-k", "q4-b4 or q2 or one_claim")),
    Mutant("m8_pg_claim_ignores_picks", "PostgreSQL's claim ignoring the fair-share picks (and so weights)",
           "app/ledger/postgres.py", "            if picks:\n", "            if False:\n",
           ("tests/test_fair_share.py", "-k", "shared_ledger")),
    Mutant("m9_plan_most_served", "plan() picking the tenant furthest over its share", "app/tasks/feeder.py",
           "[tenant] = executor.fair_order(1, {t: waiting[t] for t in under})",
           "tenant = max(under, key=lambda t: (executor.fair.next_start(t), t))",
           ("tests/test_fair_share.py", "-k", "not replicas and not shared_ledger")),
    Mutant("m16_fair_ties_by_id", "the claims' ties decided by tenant id", "app/runtime/fair_share.py",
           "key=lambda t: (finish[t], waiting[t].since)", "key=lambda t: (finish[t], t)",
           ("tests/test_fair_share.py", "-k", "rule")),
    Mutant("m17_idle_hoards_credit", "an idle tenant keeping the credit of its idle time",
           "app/runtime/fair_share.py", "return finish if self.active(tenant) else max(self.now, finish)",
           "return finish", ("tests/test_fair_share.py", "-k", "late or idle")),
    Mutant("m18_executor_ties_by_id", "the device queue's ties decided by tenant id", "app/runtime/worker_loop.py",
           "key=lambda j: (j.tag, j.submitted))", "key=lambda j: (j.tag, j.tenant))",
           ("tests/test_fair_share.py", "-k", "equal_tags")),
    # ---- admission and the backlog
    Mutant("m10_backlog_ignores_adding", "the backlog check ignoring how many tasks a request adds",
           "app/tasks/backlog.py", 'if backlog["tasks"] + adding > self.limit:', 'if backlog["tasks"] + 1 > self.limit:',
           ("tests/test_admission.py", "-k", "backlog_limit")),
    Mutant("m11_backlog_bytes_on_cells", "REV88_BACKLOG_BYTES applied to the wrong kind of work", "app/tasks/backlog.py",
           "if uploads and self.limit_bytes is not None", "if not uploads and self.limit_bytes is not None",
           ("tests/test_admission.py", "-k", "backlog_bytes")),
    Mutant("m12a_cancel_not_discarded", "a cancelled waiting task left in the backlog", "app/tasks/runner.py",
           "            self.feeder.discard(task_id)\n", "            pass\n",
           ("tests/test_admission.py", "-k", "cancelled_waiting")),
    Mutant("m12b_claim_no_ledger_check", "a claim not checked against the ledger (a cancelled task claimed)",
           "app/ledger/local_claims.py", "if statuses.get(entry[1]) in UNFINISHED)",
           "if entry[1] in statuses)", ("tests/test_ledger.py", "-k", "embedded_claims")),
    # ---- seed states
    Mutant("m13_cache_evicts_one", "the seed-state cache evicting one state per insert", "learner/seed_state.py",
           "            while self._bytes > self.max_bytes:\n", "            if self._bytes > self.max_bytes:\n",
           ("tests/test_seed_state.py",)),
    Mutant("m14_prepare_once", "the prepare thread preparing only once per process", "app/tasks/launches.py",
           "                if not wanted:\n                    self._drains -= 1\n",
           "                if not wanted:\n                    pass\n",
           ("tests/test_launches.py", "-k", "recorded_each_time")),
    Mutant("m15_sweep_first_seed", "a sweep preparing the first cell's seed for every cell", "app/tasks/sweeps.py",
           "[(config, record.train_count) for config in cells]",
           "[(cells[0], record.train_count) for config in cells]",
           ("tests/test_launches.py", "-k", "recorded_each_time")),
    # ---- the host's ceiling (issue #55): what saves work must not lose any
    Mutant("m20_launch_unfenced", "a launch's outcomes written on PostgreSQL without their attempts' fence",
           "app/ledger/postgres.py",
           "sent.append((i, params, self._write_outcome(conn, params, o.with_answer, True,",
           "sent.append((i, params, self._write_outcome(conn, params, o.with_answer, False,",
           ("tests/test_ledger_pg.py", "-k", "launchs_outcomes or finish_many")),
    Mutant("m21_launch_leases_kept", "a launch's written outcomes still counted as leases held here",
           "app/ledger/postgres.py",
           "            self._finished_here(written)\n", "",
           ("tests/test_ledger_pg.py", "-k", "launchs_outcomes")),
    Mutant("m22_sync_end_claims", "every synchronous task's end waking the claimer with nothing waiting",
           "app/tasks/feeder.py",
           "        if self.leases or len(self.ledger):\n            self.wake()",
           "        if True:\n            self.wake()",
           ("tests/test_app_sync_record.py",)),
    Mutant("m23_plan_claims_nothing_waiting", "the plan claiming from SQLite's index when it is empty",
           "app/tasks/feeder.py",
           "        if not waiting and not self.leases:  # (SQLite's index is exact: nothing waits in the ledger)\n"
           "            return None\n", "",
           ("tests/test_app_sync_record.py",)),
    # ---- answers paired with the wrong task, again (issue #55): where a launch's results and a claim's parts meet
    Mutant("m24_refusals_told_to_another", "a launch's ledger results told to its outcomes shifted by one (the "
           "refusal of one told to another)", "app/tasks/finisher.py",
           "for (i, work, outcome), result in zip(rows, results):",
           "for (i, work, outcome), result in zip(rows, results[1:] + results[:1]):",
           ("tests/test_pairing.py", "-k", "refuses_one")),
    Mutant("m25_claim_epoch_of_first", "every task of a claim run under the first one's lease (epoch)",
           "app/tasks/feeder.py", "                acc.epoch = claim.epoch\n", "                acc.epoch = claims[0].epoch\n",
           ("tests/test_claims.py", "-k", "claimed_together")),
    Mutant("m26_claim_input_of_first", "every stored task of a claim run on the first one's stored input",
           "app/tasks/feeder.py",
           "acc = await self._from_stored(record, bodies.get(task_id), claim.epoch)",
           "acc = await self._from_stored(record, bodies.get(stored[0]) if stored else None, claim.epoch)",
           ("tests/test_claims.py", "-k", "claimed_together")),
    Mutant("m27_launch_cancel_of_first", "every task of a launch discarded (or kept) by the first one's cancel",
           "app/tasks/device.py", "        item = launch.items[i]\n        cancel = item[2] if len(item) > 2 else None\n",
           "        item = launch.items[i]\n        cancel = launch.items[0][2] if len(item) > 2 else None\n",
           ("tests/test_launches.py", "-k", "cancelled_while")),
    Mutant("m28_webhook_doc_of_first", "a round's sweep and evaluation messages all sent with the first one's "
           "document", "app/webhooks/delivery.py", "            doc = seen[subject_id]\n",
           "            doc = next(iter(seen.values()))\n", ("tests/test_webhooks.py", "-k", "many_subjects")),
    Mutant("m29_webhook_slot_late_binding", "a claim's delivery slots all given back as its last message's "
           "(the others never free)", "app/webhooks/delivery.py",
           "task.add_done_callback(lambda _t, mid=m.id: self._done(mid))",
           "task.add_done_callback(lambda _t: self._done(m.id))", ("tests/test_webhooks.py", "-k", "every_delivery_slot")),
    Mutant("m30_virtual_time_back", "virtual time moved back when a backlogged tenant's work behind it begins",
           "app/runtime/fair_share.py", "        self.now = max(self.now, start)", "        self.now = start",
           ("tests/test_fair_share.py", "-k", "never_moves_back")),
    Mutant("m31_max_queued_ignores_adding", "a key's max_queued checked without what the request adds",
           "app/tasks/tenants.py", "if limit is None or count + adding <= limit:", "if limit is None or count < limit:",
           ("tests/test_tenants.py", "-k", "quotas")),
    # ---- found by a hunt over the task's life (2026-12-06): each survived the tests nearest to it
    Mutant("m32_claims_not_evictable", "claimed work queued as not evictable and a synchronous upload as evictable",
           "app/tasks/runner.py", "evictable=fed,", "evictable=not fed,",
           ("tests/test_admission.py", "-k", "takes_a_claimed")),
    Mutant("m33_async_timer_idle", "an asynchronous task's timeout timer that never stops its job", "app/tasks/runner.py",
           "if job is not None and not job.future.done():", "if job is not None and job.future.done():",
           ("tests/test_app_concurrency.py", "-k", "asynchronous_task_past")),
    Mutant("m34_energy_valid_without_hash", "a draw's energy valid without its predictions hashing as its task's",
           "app/tasks/evaluation_report.py", '"valid": bool(doc.get("valid")) and same if',
           '"valid": bool(doc.get("valid")) if', ("tests/test_evaluations.py", "-k", "energy_is_valid_only")),
    Mutant("m35_max_queued_ignores_sync_in_flight", "a key's max_queued not counting its synchronous tasks in flight",
           "app/tasks/tenant_gate.py", "        return self.ledger.count_unfinished(owner) + unrecorded_here",
           "        return self.ledger.count_unfinished(owner)", ("tests/test_tenants.py", "-k", "quotas")),
    Mutant("m36_measurement_task_timeout", "a measurement timed out by a task's timeout, not its protocol's",
           "app/tasks/runner.py", "            return measure_timeout_s(work.measure, self.task_timeout_s)",
           "            return self.task_timeout_s", ("tests/test_app_concurrency.py", "-k", "measurement_waits")),
    Mutant("m37_backlog_bytes_past_limit", "REV88_BACKLOG_BYTES refusing only past the limit, not at it",
           "app/tasks/backlog.py", 'backlog["bytes"] >= self.limit_bytes', 'backlog["bytes"] > self.limit_bytes',
           ("tests/test_admission.py", "-k", "backlog_bytes_limit")),
    Mutant("m38_cells_body_sha_prefix", "a sweep's cells recorded with the digest's prefix as their body_sha256",
           "app/tasks/runner.py", 'body_sha256=w.dataset.split(":", 1)[1]', 'body_sha256=w.dataset.split(":", 1)[0]',
           ("tests/test_sweeps.py", "-k", "every_cell_as_its_single")),
    Mutant("m39_max_running_plus_one", "a key's max_running letting one more job run", "app/runtime/worker_loop.py",
           "self._running[job.tenant] >= job.max_running", "self._running[job.tenant] > job.max_running",
           ("tests/test_tenants.py", "-k", "max_running_holds")),
    Mutant("m40_launch_timeout_as_stopped", "a timeout during a launch that cannot be stopped answered as stopped",
           "app/tasks/finisher.py", 'if job.stop[0] == "timeout":', 'if job.stop[0] == "deadline":',
           ("tests/test_launches.py", "-k", "timeout_passes_while")),
    Mutant("m41_timer_kept", "a finished task's timeout timer left on the event loop (it holds the work)",
           "app/tasks/finisher.py", "        if work.timer is not None:\n            work.timer.cancel()\n",
           "        if work.timer is not None:\n            pass\n", ("tests/test_app_memory.py", "-k", "freed_at_once")),
    Mutant("m42_idle_worker_keeps_launch", "an idle worker keeping its last launch's jobs (and their tasks)",
           "app/runtime/worker_loop.py", "            del head, group\n", "            pass\n",
           ("tests/test_app_memory.py", "-k", "freed_at_once")),
    Mutant("m43_shares_rounded_up", "the device queue's shares rounded up (they add up to more than the queue)",
           "app/runtime/admission.py", "max(1, math.floor(self.capacity * max(w, 1e-9) / total + 1e-9))",
           "max(1, math.ceil(self.capacity * max(w, 1e-9) / total - 1e-9))",
           ("tests/test_admission.py", "-k", "shares_are")),
    Mutant("m44_health_synchronous_counts_claims", "/health's synchronous count per tenant counting claimed work",
           "app/runtime/admission.py", 'if j.kind != "warmup" and not (hard_only and j.evictable))',
           'if j.kind != "warmup")', ("tests/test_admission.py", "-k", "takes_a_claimed")),
    Mutant("m45_finish_twice", "a unit's outcome taken a second time while the first is being told",
           "app/tasks/work.py", "            if self.state in (S.FINISHED, S.TOLD):\n                return False",
           "            if self.state == S.TOLD:\n                return False", ("tests/test_work.py",)),
    Mutant("m46_precision_not_kept", "a task's ?precision= not kept in its options (a claim elsewhere runs without it)",
           "app/tasks/work.py", '("dataset", "sweep", "evaluation", "owner", "webhook", "precision")',
           '("dataset", "sweep", "evaluation", "owner", "webhook")', ("tests/test_work.py",)),
    Mutant("m47_dataset_task_no_max_queued", "a task (on a stored dataset, or uploaded) not checked against its "
           "key's max_queued", "app/api/intake.py",
           "    await service.runner.check_queued(tenant, 1)  # the key's max_queued (before the body)\n", "",
           ("tests/test_tenants.py", "-k", "quotas")),
    Mutant("m48_stored_task_no_scores", "a task run again from its stored input without its include=scores",
           "app/tasks/work.py", 'include_scores=bool(o.get("include_scores")),', "include_scores=False,",
           ("tests/test_app_ledger.py", "-k", "kill_9_with_accepted")),
    Mutant("m49_dataset_task_body_sha_prefix", "a task on a stored dataset recorded with the digest's prefix as its "
           "body_sha256", "app/tasks/submit.py", 'Parsed(task, digest.split(":", 1)[1], None,',
           'Parsed(task, digest.split(":", 1)[0], None,',
           ("tests/test_datasets.py", "-k", "answers_as_the_upload")),
    Mutant("m50_claim_without_precision", "a recorded task run again elsewhere without its ?precision=",
           "app/tasks/work.py", 'webhook=o.get("webhook"), precision=o.get("precision"))',
           'webhook=o.get("webhook"), precision=None)', ("tests/test_work.py",)),
    Mutant("m51_dataset_task_held_to_upload_bytes", "a task on a stored dataset refused by REV88_BACKLOG_BYTES "
           "(it keeps no upload)", "app/api/intake.py", "_admitted(request, service, upload=options.dataset is None)",
           "_admitted(request, service, upload=True)", ("tests/test_admission.py", "-k", "backlog_bytes_limit")),
    Mutant("m52_sync_replay_not_waiting", "a synchronous replay of a key whose task still runs here answered 202",
           "app/api/intake.py",
           "    if not asynchronous and not record.finished and record.id in service.runner.pending:",
           "    if False:", ("tests/test_app_ledger.py", "-k", "synchronous_replay_while")),
    Mutant("m53_list_keeps_running_counts", "GET /sweeps keeping a sweep's counts while a cell still runs",
           "app/tasks/sweeps.py", 'if not counts["queued"] and not counts["running"]:', 'if not counts["queued"]:',
           ("tests/test_sweeps.py", "-k", "list_carries")),
    Mutant("m54_sweep_row_without_accuracy", "a sweep's cell rows without their accuracy", "app/tasks/sweeps.py",
           'for name in ("correct", "total", "accuracy"):', 'for name in ("correct", "total"):',
           ("tests/test_sweeps.py", "-k", "every_cell_as_its_single")),
    Mutant("m55_discard_keeps_bytes", "a cancelled waiting upload's bytes left in SQLite's backlog count",
           "app/ledger/local_claims.py", "                    del entries[i]\n                    self._bytes -= entry[2]\n",
           "                    del entries[i]\n", ("tests/test_admission.py", "-k", "cancelled_waiting_task")),
    Mutant("m56_failed_claim_loses_tasks", "SQLite's claim dropping the tasks it took when the ledger cannot be read",
           "app/ledger/local_claims.py", "                self.add(task_id, tenant or None, created_at, stored)\n",
           "                pass\n", ("tests/test_ledger.py", "-k", "lose_nothing")),
    Mutant("m57_release_requeues_finished", "SQLite's release putting a task finished meanwhile back in the backlog",
           "app/ledger/local_claims.py",
           '            if record is not None and not record.finished and record.mode == "async":',
           '            if record is not None and record.mode == "async":', ("tests/test_ledger.py", "-k", "lose_nothing")),
    # ---- a launch's hashes made side by side (learner/sha256_lanes.c)
    Mutant("m58_digests_by_group_position", "every run of a hash group given its group's first run's digests",
           "app/tasks/device.py", "digests.update((i, (future, k)) for k, i in enumerate(group))",
           "digests.update((i, (future, 0)) for k, i in enumerate(group))",
           ("tests/test_pairing.py", "-k", "hash_groups")),
    Mutant("m59_many_digests_unsorted", "sha256_many's digests given back in the lanes' order (longest first)",
           "learner/hashing.py", "            out[i] = digest\n", "            out[order.index(i)] = digest\n",
           ("tests/test_hashing.py",)),
    # ---- the device loop and the finisher, each on its own (issue #55, 2026-12-06 afternoon)
    Mutant("m60_device_unbounded", "the device running every launch it is given, however far the finisher is behind",
           "app/tasks/launches.py", "        places.acquire()  #", "        places  #",
           ("tests/test_launches.py", "-k", "few_launches")),
    Mutant("m61_finisher_waits_for_the_write", "the finisher thread waiting for each launch's records to be written",
           "app/tasks/finisher.py",
           "        write.add_done_callback(lambda write: self._written(write, rows, ended, told, done))\n",
           "        write.add_done_callback(lambda write: self._written(write, rows, ended, told, done))\n"
           "        done.exception()\n",
           ("tests/test_launches.py", "-k", "answers_the_next")),
    Mutant("m62_stop_before_the_records", "the stop going on before the launches' records are written",
           "app/tasks/launches.py", "        concurrent.futures.wait(list(self._unrecorded), timeout=timeout_s)\n", "",
           ("tests/test_launches.py", "-k", "stop_while")),
    Mutant("m63_finiteness_not_read", "a run's non-finite entries not found with its digests",
           "learner/result.py", "            if not np.isfinite(values).all()]", "            if False]",
           ("tests/test_hashing.py", "-k", "run_digests")),
    Mutant("m64_padding_region_unread", "fused's unpacking not reading the head's padded class rows",
           "learner/kernels/fused_parts.py", "               halves[:, :, CLASSES:, :], states", "               states",
           ("tests/test_fused.py", "-k", "padding")),
    Mutant("m65_writer_keeps_its_last_batch", "the ledger writer keeping its last batch until the next one",
           "app/ledger/writer.py", "        while self._write(self._take()):\n",
           "        while self._write(items := self._take()):\n", ("tests/test_app_memory.py", "-k", "freed_at_once")),
    Mutant("m66_batch_json_by_value_alone", "a batch's remembered JSON keyed by value alone (1, 1.0 and True one key)",
           "app/ledger/task_writes.py", "key = tuple((k, type(v), v) for k, v in value.items())",
           "key = tuple((k, v) for k, v in value.items())", ("tests/test_task_row.py", "-k", "batch")),
    Mutant("m67_compact_text_skips_ten", "a stored answer's JSON length counting two-digit predictions only past 10",
           "app/ledger/rows.py", "if top >= 10 else 0", "if top > 10 else 0",
           ("tests/test_task_row.py", "-k", "compactly")),
    Mutant("m68_offered_work_looked_up_late", "a claim's offered work looked up in the cache only when its turn comes",
           "app/tasks/feeder.py", "                acc = held.pop(task_id, None)\n",
           "                acc = held.pop(task_id, None) if task_id in self.offered else None\n",
           ("tests/test_launches.py", "-k", "pushed_out")),
    Mutant("m69_webhook_rows_with_every_chunk", "a sweep's webhook rows written with every chunk of its cells",
           "app/tasks/submit.py", "            created, messages, chunk = True, None, []\n",
           "            created, chunk = True, []\n",
           ("tests/test_runner_submit.py", "-k", "chunks")),
    Mutant("m70_other_requests_chunk_taken_whole", "a chunk another request recorded part of taken as all of it theirs",
           "app/tasks/submit.py",
           "                chunk, messages = [acc for acc in chunk if acc.task_id not in have], None",
           "                chunk, messages = [], None",
           ("tests/test_runner_submit.py", "-k", "another_request")),
    Mutant("m71_cancel_between_chunks_missed", "a sweep cancelled while its cells are recorded: the later chunks run",
           "app/tasks/sweeps.py", "        if latest is not None and latest.cancelled_at is not None:",
           "        if latest is not None and latest.cancelled_at is None:",
           ("tests/test_sweeps.py", "-k", "cancelled_while")),
    Mutant("m72_cancel_skips_cells_not_yet_recorded", "a sweep's cancel skips the cells not yet recorded",
           "app/tasks/sweeps.py",
           'unfinished = [row["task_id"] for row in doc["cells"] if row["status"] not in FINISHED]',
           'unfinished = [row["task_id"] for row in doc["cells"] if row["status"] not in FINISHED and row.get("backend")]',
           ("tests/test_sweeps.py", "-k", "mark_is_written")),
    Mutant("m73_cancelled_sweeps_unrecorded_cells_queued", "a cancelled sweep's never-recorded cells read queued",
           "app/tasks/sweeps.py",
           "        unrecorded = NEVER_RECORDED if sweep.cancelled_at is not None else None\n",
           "        unrecorded = None\n",
           ("tests/test_sweeps.py", "-k", "half_recorded")),
    Mutant("m74_cancelled_evaluation_records_more", "a replay of a cancelled evaluation records its missing draws",
           "app/tasks/evaluations.py",
           "        if ev.cancelled_at is not None:  # (a replay of a cancelled evaluation: its draws never recorded stay so)\n"
           "            return\n", "",
           ("tests/test_evaluations.py", "-k", "half_recorded")),
    Mutant("m75_unsettled_seed_states", "a seed-state batch that failed leaves its states under way for ever",
           "app/tasks/launches.py",
           "                cache.settle(key, states[i] if i < len(states) else None)\n",
           "                if i < len(states) and states[i] is not None:\n"
           "                    cache.settle(key, states[i])\n",
           ("tests/test_seed_processes.py", "-k", "service")),
    Mutant("m76_waiter_computes_unkept", "a get that waited for a state not given computes it without keeping it",
           "learner/seed_state.py",
           "            under_way.wait()\n        try:\n",
           "            under_way.wait()\n            return self._compute(config, train_count, cancel)\n        try:\n",
           ("tests/test_seed_processes.py", "-k", "claimed")),
    Mutant("m77_launch_line_out_of_order", "a launch's log line naming its tasks in another order than their facts",
           "app/tasks/answers.py", '"task_ids": [w.task_id for w in works]', '"task_ids": [w.task_id for w in works[::-1]]',
           ("tests/test_launches.py", "-k", "single_tasks_on_sqlite")),
    Mutant("m78_dataset_task_without_labels", "a task on a stored dataset answered without its labels' score",
           "app/tasks/submit.py", "record.bytes, labels)", "record.bytes, None)",
           ("tests/test_datasets.py", "-k", "answers_as_the_upload")),
    Mutant("m79_launch_line_without_request_ids", "a launch's log line without its synchronous tasks' request ids",
           "app/tasks/answers.py", "    if any(w.request_id is not None for w in works):", "    if False:",
           ("tests/test_logs.py", "-k", "launch_of_several")),
    Mutant("m80_dataset_task_with_a_chunked_body", "POST /tasks?dataset= with a chunked body trained on the dataset, "
           "its body ignored", "app/tasks/options.py",
           'headers.get("content-length") not in (None, "0") or headers.get("transfer-encoding")',
           'headers.get("content-length") not in (None, "0")',
           ("tests/test_datasets.py", "-k", "answers_as_the_upload")),
    # ---- a batch of seed states computed together (learner/permutations.py, learner/seed_state.py)
    Mutant("m81_batch_permutations_misdealt", "a batch's permutations dealt to its states in another order",
           "learner/seed_state.py", "        for i, perms in zip(members, drawn):\n",
           "        for i, perms in zip(members[::-1], drawn):\n",
           ("tests/test_seed_state.py", "-k", "together")),
    Mutant("m82_failed_batch_left_under_way", "a prepared batch that failed leaves its states under way for ever",
           "learner/seed_state.py", "            for (key, _), state in zip(claimed, computed):\n                self.settle(key, state)\n",
           "            for (key, _), state in zip(claimed, computed):\n                if state is not None:\n"
           "                    self.settle(key, state)\n",
           ("tests/test_seed_state.py", "-k", "prepared")),
    Mutant("m83_permutations_unchecked", "the C permutations used without being compared with numpy's",
           "learner/permutations.py", "        permute = _extension().permute\n    except ImportError:\n        return False\n",
           "        permute = _extension().permute\n    except ImportError:\n        return False\n    return True\n",
           ("tests/test_permutations.py", "-k", "never_used")),
    Mutant("m84_weights_filled_out_of_order", "the initial weights in one buffer filled in another order",
           "learner/train.py", "    for w in weights:\n        nn.init.normal_(", "    for w in weights[::-1]:\n        nn.init.normal_(",
           ("tests/test_training.py", "-k", "one_buffer")),
]


def run(mutant: Mutant) -> str:
    path = ROOT / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        return "does not apply (the code moved: write the mutant again)"
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
                              cwd=ROOT, capture_output=True, text=True)
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        verdict = "killed" if proc.returncode == 1 else ("SURVIVED" if proc.returncode == 0 else f"rc {proc.returncode}")
        return f"{verdict} in {time.monotonic() - t0:.0f} s ({last})"
    finally:
        path.write_text(original)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutant name prefixes (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.names or any(m.name.startswith(n) for n in args.names)]
    bad = 0
    for m in chosen:
        if args.list:
            print(f"{m.name}: {m.what} ({m.path}) -- {' '.join(m.tests)}")
            continue
        verdict = run(m)
        bad += not verdict.startswith("killed")
        print(f"{m.name}: {verdict}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
