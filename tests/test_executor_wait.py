"""DeviceExecutor.wait: one loop future woken by the job's end, the client's disconnect (a future,
or a coroutine run beside it) or the timeout -- whichever comes first decides the answer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.errors import TaskStopped, TaskTimeout
from app.runtime.executor import DeviceExecutor


@pytest.fixture
def executor():
    ex = DeviceExecutor(capacity=4)
    ex.start()
    try:
        yield ex
    finally:
        ex.stop(10)


def held(release: threading.Event, value="done"):
    def fn():
        assert release.wait(10)
        return value
    return fn


def test_the_jobs_answer(executor):
    async def main():
        job = executor.submit(lambda: 41 + 1)
        return await executor.wait(job, 10.0)

    assert asyncio.run(main()) == 42


def test_the_jobs_error_is_raised(executor):
    def fails():
        raise ValueError("the run failed")

    async def main():
        return await executor.wait(executor.submit(fails), 10.0)

    with pytest.raises(ValueError, match="the run failed"):
        asyncio.run(main())


def test_a_disconnect_future_stops_a_queued_job(executor):
    release = threading.Event()

    async def main():
        blocker = executor.submit(held(release))  # holds the one worker
        queued = executor.submit(lambda: "never")
        gone = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, gone.set_result, None)
        try:
            await executor.wait(queued, 10.0, gone)
        finally:
            release.set()
        return blocker, queued

    with pytest.raises(TaskStopped):
        asyncio.run(main())
    assert executor.stats.dropped == 1


def test_a_disconnect_coroutine_stops_a_running_job_and_a_finished_job_cancels_it(executor):
    release = threading.Event()
    tasks: list[asyncio.Task] = []

    async def never_gone():
        tasks.append(asyncio.current_task())
        await asyncio.sleep(3600)

    async def gone_soon():
        await asyncio.sleep(0.05)

    async def main():
        assert await executor.wait(executor.submit(lambda: "quick"), 10.0, never_gone()) == "quick"
        await asyncio.sleep(0)
        assert tasks and tasks[0].cancelled()  # the coroutine's task did not outlive the wait
        job = executor.submit(held(release))
        threading.Timer(0.3, release.set).start()  # this job never checks its token: it ends when released
        assert await executor.wait(job, 10.0, gone_soon()) == "done"  # its result stands, once it has one
        assert job.cancel.cancelled and job.stop[0] == "disconnect"  # but it was told to stop

    asyncio.run(main())


def test_the_timeout_expires_a_queued_job(executor):
    release = threading.Event()

    async def main():
        executor.submit(held(release))
        queued = executor.submit(lambda: "never")
        try:
            await executor.wait(queued, 0.05)
        finally:
            release.set()

    with pytest.raises(TaskTimeout):
        asyncio.run(main())
    assert executor.stats.expired == 1
