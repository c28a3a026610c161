"""The device queue: the executor on its own (serial, bounded, exactly-once answers under
timeouts and drain), then on real servers: a burst larger than the queue, and 504s for a
task that times out while running and one that times out while queued."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import httpx
import pytest

from app.errors import QueueFull, TaskTimeout, Unavailable
from app.runtime.executor import DeviceExecutor
from learner.config import make_config
from learner.hashing import array_sha256
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .gates import FileGate
from .helpers import small_task
from .server import post_task, running_job, running_server, wait_for

# --------------------------------------------------------------------------- the executor alone


@pytest.fixture
def executor():
    ex = DeviceExecutor(capacity=2)
    ex.start()
    yield ex
    ex.abandon_all("test over")
    ex.stop(5)


def test_jobs_run_one_at_a_time_in_order_on_one_thread(executor):
    log, active, overlaps = [], [0], []

    def job(i):
        def run():
            active[0] += 1
            overlaps.append(active[0])
            log.append((i, threading.current_thread().name))
            time.sleep(0.02)
            active[0] -= 1
            return i * i

        return run

    async def main():
        results = []
        for batch in ([0, 1], [2, 3], [4, 5]):  # at most capacity (2) waiting
            jobs = [executor.submit(job(i), label=str(i)) for i in batch]
            results += await asyncio.gather(*(executor.wait(j, 10) for j in jobs))
        return results

    assert asyncio.run(main()) == [0, 1, 4, 9, 16, 25]
    assert [i for i, _ in log] == [0, 1, 2, 3, 4, 5]
    assert {name for _, name in log} == {"rev88-worker-cpu:0"}  # one worker: one thread
    assert max(overlaps) == 1
    assert executor.stats.completed == 6 and executor.stats.accepted == 6


def test_full_queue_refuses_with_retry_after(executor):
    gate = threading.Event()
    first = executor.submit(gate.wait)
    wait_for(lambda: executor.busy, 5, what="first job running")
    waiting = [executor.submit(lambda: "ok"), executor.submit(lambda: "ok")]
    with pytest.raises(QueueFull) as info:
        executor.submit(lambda: "never")
    assert info.value.status == 503 and info.value.retry_after >= 1
    assert "queue is full (2 of 2" in info.value.message
    gate.set()
    assert first.future.result(5) is True
    assert [j.future.result(5) for j in waiting] == ["ok", "ok"]
    assert executor.stats.refused_full == 1


def test_timeout_while_queued_never_runs_and_frees_its_slot(executor):
    gate = threading.Event()
    ran = []
    blocker = executor.submit(gate.wait)
    wait_for(lambda: executor.busy, 5, what="blocker running")
    queued = executor.submit(lambda: ran.append("queued job ran"))

    with pytest.raises(TaskTimeout) as info:
        asyncio.run(executor.wait(queued, 0.05))
    assert info.value.details["where"] == "queued" and info.value.status == 504
    assert "never ran" in info.value.message
    assert executor.depth == 0  # its queue slot is free again
    gate.set()
    blocker.future.result(5)
    follow = executor.submit(lambda: "after")
    assert follow.future.result(5) == "after"
    assert ran == []
    s = executor.stats
    assert (s.expired, s.completed, s.accepted) == (1, 2, 3)


def test_timeout_while_running_answers_once_and_discards_the_late_result(executor):
    gate = threading.Event()
    running = executor.submit(lambda: gate.wait() and "late result")
    wait_for(lambda: executor.busy, 5, what="job running")
    with pytest.raises(TaskTimeout) as info:
        asyncio.run(executor.wait(running, 0.05))
    assert info.value.details["where"] == "running"
    assert executor.busy  # the device is still held by the job
    gate.set()
    wait_for(lambda: not executor.busy, 5, what="job finished")
    # the future still holds the one answer given: the timeout, not the late result
    assert isinstance(running.future.exception(), TaskTimeout)
    s = executor.stats
    assert (s.abandoned, s.abandoned_finished, s.completed) == (1, 1, 0)
    assert executor.submit(lambda: 7).future.result(5) == 7


def test_result_that_wins_the_race_is_answered(executor):
    job = executor.submit(lambda: "done")
    job.future.result(5)
    executor.expire(job, 0.0)  # a timeout that fires after the result: no effect
    assert asyncio.run(executor.wait(job, 0.0)) == "done"
    assert executor.stats.expired == 0 and executor.stats.abandoned == 0


def test_drain_refuses_new_work_and_the_deadline_answers_the_rest(executor):
    gate = threading.Event()
    running = executor.submit(gate.wait)
    wait_for(lambda: executor.busy, 5, what="job running")
    queued = executor.submit(lambda: "never")
    executor.close("draining for shutdown")
    with pytest.raises(Unavailable):
        executor.submit(lambda: "refused")
    assert executor.abandon_all("shutting down") == 2
    for job, where in ((running, "running"), (queued, "queued")):
        err = job.future.exception(1)
        assert isinstance(err, Unavailable) and err.details["where"] == where
    gate.set()
    assert executor.stop(5)
    s = executor.stats
    assert (s.cancelled, s.abandoned, s.abandoned_finished, s.refused_closed) == (1, 1, 1, 1)
    assert s.answered() == s.accepted


def test_many_waiters_each_answered_exactly_once():
    ex = DeviceExecutor(capacity=64)
    ex.start()
    answers: dict[int, list] = {}

    async def one(i):
        job = ex.submit(lambda: (time.sleep(0.002), i)[1], label=str(i))
        try:
            value = await ex.wait(job, 0.02 + (i % 5) * 0.01)
        except TaskTimeout as exc:
            value = exc
        answers.setdefault(i, []).append(value)

    async def main():
        await asyncio.gather(*(one(i) for i in range(60)))

    asyncio.run(main())
    assert ex.stop(10)
    assert sorted(answers) == list(range(60))
    assert all(len(v) == 1 for v in answers.values())
    assert all(v[0] == i or isinstance(v[0], TaskTimeout) for i, v in answers.items())
    s = ex.stats
    assert s.accepted == 60 and s.answered() == 60
    assert s.completed == sum(1 for v in answers.values() if not isinstance(v[0], TaskTimeout))


# --------------------------------------------------------------------------- burst on a real server


BURST = 12
QUEUE = 2


@pytest.fixture(scope="module")
def burst_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("burst-server")
    gate = FileGate(folder / "hold")
    with running_server(folder, env={"REV88_BACKEND": "cpu", "REV88_QUEUE_SIZE": str(QUEUE), "REV88_WORKERS": "1"}, gate=gate.path) as srv:
        srv.gate = gate
        yield srv
    gate.release()


def test_burst_larger_than_the_queue_gets_200s_and_503s_only(burst_server):
    """The device is held by one task while the burst arrives (whatever the machine's speed):
    exactly QUEUE tasks find a queue slot, every other one is refused with 503 + Retry-After."""
    config = make_config({"epochs": 2})
    tasks = [small_task(1500, 200, seed) for seed in range(BURST + 1)]  # every request a different task
    bodies = [task_to_npz_bytes(t) for t in tasks]
    barrier = threading.Barrier(BURST)
    burst_server.gate.hold()

    def send(i):
        with burst_server.client() as c:
            if i > 0:
                barrier.wait()
            return post_task(c, bodies[i], params={"epochs": "2"})

    with concurrent.futures.ThreadPoolExecutor(BURST + 1) as pool:
        blocker = pool.submit(send, 0)
        wait_for(lambda: (running_job(burst_server) or {}).get("kind") == "task", 60, what="the blocker holding the device")
        burst = [pool.submit(send, i) for i in range(1, BURST + 1)]
        wait_for(lambda: sum(f.done() for f in burst) == BURST - QUEUE, 120, what="the refusals")
        burst_server.gate.release()
        responses = [blocker.result(), *(f.result() for f in burst)]

    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, [(r.status_code, r.text[:200]) for r in responses]
    assert codes.count(200) == QUEUE + 1 and codes.count(503) == BURST - QUEUE, codes
    for i, r in enumerate(responses):
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert "retry later" in r.json()["error"]
        else:
            expected = run_task(tasks[i], config, "cpu")
            answer = r.json()
            assert answer["predictions_sha256"] == expected.predictions_sha256, i
            assert answer["predictions"] == expected.predictions.tolist(), i
            assert answer["metadata"]["input_hashes"]["train_images"] == array_sha256(tasks[i].train_images)

    # nothing lost: every accepted task was answered, nothing waits or runs, metrics agree
    with burst_server.client() as c:
        queue = c.get("/health").json()["queue"]
        metrics = c.get("/metrics").text
    assert queue["depth"] == 0 and queue["in_flight"] == 0 and queue["running"] is None
    tasks_accepted = queue["accepted"] - 1  # minus the warm-up
    assert tasks_accepted == codes.count(200)
    assert queue["completed"] - 1 == codes.count(200)
    assert queue["expired"] == queue["abandoned"] == queue["cancelled"] == queue["failed"] == 0
    assert f'rev88_tasks_total{{outcome="ok"}} {float(codes.count(200))}' in metrics
    assert f'rev88_tasks_total{{outcome="queue_full"}} {float(codes.count(503))}' in metrics


# --------------------------------------------------------------------------- timeouts on a real server


TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory):
    """A cpu server with a short task timeout whose runs the tests hold at a gate: a task is
    "long" because the test says so, not because the machine is slow."""
    folder = tmp_path_factory.mktemp("timeout-server")
    gate = FileGate(folder / "hold")
    env = {"REV88_BACKEND": "cpu", "REV88_TASK_TIMEOUT_S": str(TIMEOUT_S), "REV88_QUEUE_SIZE": "4", "REV88_WORKERS": "1"}
    with running_server(folder, env=env, gate=gate.path) as srv:
        srv.gate = gate
        yield srv
    gate.release()


def _send(server, results, name, body, params=None):
    with server.client() as c:
        results[name] = post_task(c, body, params=params)


def _queue(server) -> dict:
    with server.client() as c:
        return c.get("/health").json()["queue"]


def timeouts_counted(server) -> float:
    with server.client() as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith('rev88_tasks_total{outcome="timeout"}'):
                return float(line.split()[-1])
    raise AssertionError("no timeout counter in /metrics")


def test_timeout_while_queued_is_504_and_the_task_never_runs(timeout_server):
    small = task_to_npz_bytes(small_task(19, 7, seed=2))
    before = _queue(timeout_server)
    results: dict[str, httpx.Response] = {}
    # The blocker: an energy measurement (whose own timeout is far longer than a task's) held at
    # the gate, so the task queued behind it times out while still queued: it never runs.
    timeout_server.gate.hold()
    blocker = threading.Thread(target=_send, args=(timeout_server, results, "blocker", small, {
        "measure": "energy", "trials": "1", "target_seconds": "0.1", "settle_seconds": "0", "idle_seconds": "0"}))
    blocker.start()
    try:
        wait_for(lambda: (running_job(timeout_server) or {}).get("kind") == "measure", 60, what="the measurement running")
        _send(timeout_server, results, "queued", task_to_npz_bytes(small_task(19, 7, seed=5)))
    finally:
        timeout_server.gate.release()
    rq = results["queued"]
    assert rq.status_code == 504, rq.text
    assert rq.json()["where"] == "queued" and "never ran" in rq.json()["error"]
    blocker.join(300)
    assert results["blocker"].status_code == 200, results["blocker"].text
    _send(timeout_server, results, "after", small)
    assert results["after"].status_code == 200, results["after"].text

    after = _queue(timeout_server)
    assert after["expired"] - before["expired"] == 1
    assert after["completed"] - before["completed"] == 2  # the blocker and the one after; never the queued one
    assert after["accepted"] - before["accepted"] == 3
    assert after["depth"] == 0 and after["in_flight"] == 0


def test_timeout_while_running_is_504_and_the_task_is_stopped_on_the_device(timeout_server):
    body = task_to_npz_bytes(small_task(300, 50, 1))
    small = task_to_npz_bytes(small_task(19, 7, seed=3))
    before = _queue(timeout_server)
    timeouts_before = timeouts_counted(timeout_server)
    results: dict[str, httpx.Response] = {}
    timeout_server.gate.hold()  # never released for this task: only the stop can end its run
    try:
        _send(timeout_server, results, "long", body)
        r = results["long"]
        assert r.status_code == 504, r.text
        assert r.json()["where"] == "running" and r.json()["stopped"] is True
        assert "stopped on the device" in r.json()["error"] and "REV88_TASK_TIMEOUT_S" in r.json()["error"]
        assert running_job(timeout_server) is None  # the device is free again: answered after the stop
    finally:
        timeout_server.gate.release()
    _send(timeout_server, results, "after", small)
    assert results["after"].status_code == 200, results["after"].text

    after = _queue(timeout_server)
    assert after["stopped"] - before["stopped"] == 1
    assert after["abandoned"] == before["abandoned"]  # answered once, after it stopped: nothing left running
    assert after["completed"] - before["completed"] == 1  # only the task after
    assert after["depth"] == 0 and after["in_flight"] == 0
    assert after["accepted"] == sum(after[k] for k in ("completed", "failed", "expired", "dropped", "abandoned", "cancelled"))
    assert timeouts_counted(timeout_server) - timeouts_before == 1
    with timeout_server.client() as c:
        assert 'rev88_tasks_stopped_total{where="running"}' in c.get("/metrics").text


def test_an_asynchronous_task_past_its_timeout_is_stopped_and_recorded_failed(timeout_server):
    """Nobody waits for an asynchronous task, so its timeout is a timer of its own: one held
    running past REV88_TASK_TIMEOUT_S is stopped on the device and recorded failed with a 504,
    and the device is free for the next task."""
    small = task_to_npz_bytes(small_task(19, 7, seed=8))
    before = _queue(timeout_server)
    timeout_server.gate.hold()  # never released for this task: only its timeout can end it
    try:
        with timeout_server.client() as c:
            task_id = post_task(c, small, headers={"Prefer": "respond-async"}).json()["id"]
            wait_for(lambda: c.get(f"/tasks/{task_id}").json()["status"] in ("succeeded", "failed", "cancelled"),
                     10 * TIMEOUT_S, 0.05, "the asynchronous task finished by its timeout")
            record = c.get(f"/tasks/{task_id}").json()
    finally:
        timeout_server.gate.release()
    assert record["status"] == "failed" and record["started_at"] is not None, record
    error = record["error"]
    assert error["status"] == 504 and error["where"] == "running" and error["stopped"] is True, error
    assert "REV88_TASK_TIMEOUT_S" in error["error"] and "stopped on the device" in error["error"], error
    assert running_job(timeout_server) is None
    with timeout_server.client() as c:
        assert post_task(c, small).status_code == 200  # the device is free again
    after = _queue(timeout_server)
    assert after["stopped"] - before["stopped"] == 1 and after["completed"] - before["completed"] == 1
    assert after["depth"] == 0 and after["in_flight"] == 0


def test_a_measurement_waits_in_the_queue_by_its_own_timeout_not_a_tasks(timeout_server):
    """A measurement's timeout is its protocol's (every window, and a task's timeout for each run
    it makes), far longer than REV88_TASK_TIMEOUT_S: one queued behind another measurement for
    longer than a task's timeout still runs and is answered."""
    params = {"measure": "energy", "trials": "1", "target_seconds": "0.1", "settle_seconds": "0", "idle_seconds": "0"}
    results: dict[str, httpx.Response] = {}
    timeout_server.gate.hold()
    first = threading.Thread(target=_send, args=(timeout_server, results, "first",
                                                 task_to_npz_bytes(small_task(19, 7, seed=12)), params))
    second = threading.Thread(target=_send, args=(timeout_server, results, "second",
                                                  task_to_npz_bytes(small_task(19, 7, seed=13)), params))
    first.start()
    try:
        wait_for(lambda: (running_job(timeout_server) or {}).get("kind") == "measure", 60, what="the first measuring")
        second.start()
        wait_for(lambda: _queue(timeout_server)["depth"] == 1, 30, 0.02, "the second measurement queued")
        time.sleep(2 * TIMEOUT_S)  # past a task's timeout, well within a measurement's
        assert "second" not in results, results["second"].text  # still waiting, not expired
    finally:
        timeout_server.gate.release()
        first.join(300)
        second.join(300)
    assert results["first"].status_code == 200, results["first"].text
    assert results["second"].status_code == 200, results["second"].text
