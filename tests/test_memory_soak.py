"""A finished task leaves no reference cycle behind: its arrays are freed when it is answered.

Memory over a long run (issue #21, ``bench/bench_soak.py``) grew ~95 MB per 1,000 mixed tasks
because every task's acceptance and its device job referred to each other (the job's closures
hold the acceptance, the acceptance its job), and a task stopped on the device left its
traceback's frames holding the jobs: each finished task's arrays -- megabytes -- waited for the
cyclic GC's next full pass, which with the few hundred thousand long-lived objects of a torch
process comes only every few thousand tasks. Here the cyclic GC is off while one task of each
kind goes through a real (in-process) server: synchronous, asynchronous, refused, cancelled while
queued, cancelled while running; then a collection that keeps what it finds must find none of
the tasks' objects. No timing, no RSS: the structure that held the memory."""

from __future__ import annotations

import contextlib
import gc
import io
import threading

import numpy as np
import pytest

from app.http import protocol
from app.main import create_app
from app.runtime.executor import Job
from app.settings import Settings
from app.tasks.work import Work
from learner.taskio import TaskArrays, task_to_npz_bytes

from .gates import Gate, gated_engines
from .helpers import small_task
from .server import InProcessServer, free_port, post_task, wait_for

try:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
except ImportError:  # uvicorn without httptools: rev88 serve keeps uvicorn's default protocol
    RequestResponseCycle = None
TRACKED = tuple(t for t in (TaskArrays, Work, Job, RequestResponseCycle, getattr(protocol, "ZeroCopyBody", None))
                if t is not None)

ASYNC = {"Prefer": "respond-async"}


def status(c, task_id: str) -> str:
    r = c.get(f"/tasks/{task_id}")
    assert r.status_code == 200, r.text
    return r.json()["status"]


def garbage_of_tasks() -> list[str]:
    """What a full collection finds unreachable among the tasks' own objects (kept, then dropped)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage if isinstance(o, TRACKED)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


@contextlib.contextmanager
def serving(app):
    """uvicorn in a thread of this process with the HTTP protocol ``rev88 serve`` runs
    (app/http/protocol.py: a large body read straight into one buffer)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           http=protocol.protocol_class()))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    srv = InProcessServer(app, server, thread, f"http://127.0.0.1:{port}")
    try:
        def ready():
            with contextlib.suppress(Exception), srv.client(timeout=2) as c:
                return c.get("/v2/health/ready").status_code == 200
            return False

        wait_for(ready, 120, 0.1, "the in-process server ready")
        yield srv
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.mark.skipif(protocol.protocol_class() is None, reason="rev88 serve's protocol needs httptools")
def test_finished_tasks_leave_no_reference_cycles(tmp_path):
    gate = Gate()
    settings = Settings(backend="cpu-fast", workers=1, queue_size=4, task_timeout_s=60.0,
                        data_dir=str(tmp_path / "data"))
    engines = gated_engines(gate)
    app = create_app(settings, engines=engines)
    body = task_to_npz_bytes(small_task(1000, 1000, seed=3))  # 0.66 MB: read straight into its buffer
    labelled = io.BytesIO()
    task = small_task(1000, 1000, seed=4)
    np.savez(labelled, train_images=task.train_images, train_labels=task.train_labels,
             test_images=task.test_images, test_labels=np.zeros(1000, dtype=np.int64))
    with serving(app) as server, server.client() as c:
        assert post_task(c, body).status_code == 200  # warm: caches, lazily built objects
        gc.collect()
        garbage_of_tasks()
        gc.disable()
        try:
            assert post_task(c, body).status_code == 200  # synchronous
            r = post_task(c, body, headers=ASYNC)  # asynchronous, polled to its end
            assert r.status_code == 202, r.text
            polled = r.json()["id"]
            assert post_task(c, labelled.getvalue()).status_code == 422  # refused

            gate.hold()
            running = post_task(c, body, headers=ASYNC).json()["id"]
            wait_for(lambda: engines("cpu-fast").waiting == 1, what="the task held at the gate")
            queued = post_task(c, body, headers=ASYNC).json()["id"]  # behind it: one worker
            assert c.post(f"/tasks/{queued}/cancel").status_code == 200  # never runs
            assert c.post(f"/tasks/{running}/cancel").status_code == 200  # stopped on the device
            gate.release()
            wait_for(lambda: status(c, polled) == "succeeded", what="the asynchronous task")
            for task_id in (running, queued):
                wait_for(lambda task_id=task_id: status(c, task_id) == "cancelled", what=f"{task_id} cancelled")
            # one more task, so that the worker's loop lets go of the last job it ran
            assert post_task(c, body).status_code == 200
            wait_for(lambda: not app.state.service.runner.pending and not app.state.service.runner.background,
                     what="nothing in flight")
            found = garbage_of_tasks()
        finally:
            gate.release()
            gc.enable()
    assert found == [], f"left for the cyclic GC: {sorted(set(found))} ({len(found)} objects)"


def test_what_lives_as_long_as_the_service_is_frozen_out_of_the_collector(tmp_path):
    """The app freezes what is alive once it has started (gc.freeze): the cyclic GC's full passes
    then walk only what came after, not the ~200,000 objects of torch, FastAPI and the learner."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    settings = Settings(backend="cpu-fast", workers=1, queue_size=4, data_dir=str(tmp_path / "data"))
    with serving(create_app(settings)) as server, server.client() as c:
        assert c.get("/v2/health/live").status_code == 200
        assert gc.get_freeze_count() > 10_000
