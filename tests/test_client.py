"""``rev88.Client`` (and ``AsyncClient``) against real services: a module server (cpu backend, auth on)
for the draws, the answers and the errors; a server whose runs are held at a file gate
(tests/gates.py), one worker and a queue of one, for 503 + Retry-After, cancel and ``wait``."""

from __future__ import annotations

import asyncio
import email.utils
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import rev88
from learner.hashing import array_sha256
from learner.result import run_task
from learner.taskio import save_task, task_to_npz_bytes
from rev88 import (
    Answer,
    AsyncClient,
    BadAnswer,
    BadInput,
    Client,
    ClientError,
    ConnectionFailed,
    NotFinished,
    Refused,
    TaskFailed,
    TaskStatus,
    Unavailable,
)
from rev88.client import DEFAULT_RETRY_WAIT_S, MAX_RETRY_WAIT_S, retry_after_seconds

from .gates import FileGate
from .helpers import DRAW0_SEED, MNIST_DIR, ROOT, small_task
from .server import free_port, running_server, wait_for

API_KEY = "client-test-key"
DRAW0_PREDICTIONS_SHA256 = "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client-server")
    with running_server(tmp, env={"REV88_BACKEND": "cpu", "REV88_API_KEY": API_KEY}) as srv:
        yield srv


@pytest.fixture
def client(server):
    with Client(server.url, api_key=API_KEY, timeout=300) as c:
        yield c


def in_process_sha256(task, **config) -> str:
    from learner.config import make_config

    return run_task(task, make_config(config), "cpu").predictions_sha256


def leaky_npz(path: Path, task) -> Path:
    """A task npz that also carries query labels (which the service must refuse)."""
    np.savez(path, **task.as_dict(), test_labels=np.zeros(task.test_count, dtype=np.int64))
    return path


def test_importing_rev88_imports_neither_app_nor_torch():
    code = ("import sys, rev88; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('app', 'torch', 'fastapi', 'starlette', 'uvicorn')); print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert rev88.Client is Client


# --------------------------------------------------------------------------- the draws, hash for hash


@pytest.mark.slow
def test_draws_through_run_and_submit_equal_run_task(client, draw0, draw0_npz, draw0_cpu_result):
    from learner.evaluate import dataset_seed
    from learner.taskio import make_task

    task0, labels0 = draw0
    answer = client.run(draw0_npz, backend="cpu")  # a path: streamed from disk
    assert answer.predictions_sha256 == DRAW0_PREDICTIONS_SHA256 == draw0_cpu_result.predictions_sha256
    assert answer.predictions.dtype == np.int64 and answer.predictions.shape == (10_000,)
    assert int((answer.predictions == labels0).sum()) == 8_887
    assert answer.metadata["backend"] == "cpu" and answer.task_id
    task_id = client.submit(dict(task0.as_dict()), backend="cpu")  # a mapping: the client writes the npz
    waited = client.wait(task_id, timeout=300)
    assert isinstance(waited, Answer) and waited.task_id == task_id
    assert waited.predictions_sha256 == DRAW0_PREDICTIONS_SHA256
    assert np.array_equal(client.predictions(task_id), answer.predictions)

    task1, labels1 = make_task(MNIST_DIR, dataset_seed(1))
    assert DRAW0_SEED + 1 == dataset_seed(1)
    expected = in_process_sha256(task1)
    sync = client.run(task1, backend="cpu")  # a TaskArrays
    task_id = client.submit(task_to_npz_bytes(task1), backend="cpu")  # npz bytes
    waited = client.wait(task_id, timeout=300)
    assert sync.predictions_sha256 == waited.predictions_sha256 == expected != DRAW0_PREDICTIONS_SHA256
    assert array_sha256(waited.predictions) == expected
    assert sync.metadata["input_hashes"] == waited.metadata["input_hashes"] == task1.input_hashes()
    assert 8_000 < int((sync.predictions == labels1).sum()) < 10_000


# --------------------------------------------------------------------------- one small task


def test_answer_config_scores_get_and_predictions(client, tmp_path):
    task = small_task(23, 9, seed=5)
    seen: list[tuple[int, int]] = []
    path = tmp_path / "t.npz"
    save_task(path, task)
    answer = client.run(path, backend="cpu", include_scores=True, epochs=3, learning_rate=0.05,
                        progress=lambda sent, total: seen.append((sent, total)))
    size = path.stat().st_size
    assert seen[0] == (0, size) and seen[-1] == (size, size)
    assert [s for s, _ in seen] == sorted(s for s, _ in seen)
    assert answer.predictions_sha256 == in_process_sha256(task, epochs=3, learning_rate=0.05)
    assert answer.metadata["config"]["epochs"] == 3 and answer.metadata["config"]["learning_rate"] == 0.05
    assert answer.scores.dtype == np.float32 and answer.scores.shape == (9, 10)
    assert array_sha256(answer.scores) == answer.scores_sha256
    assert np.array_equal(answer.scores.argmax(axis=1), answer.predictions)
    assert {"queue_wait_ms", "parse_ms", "run_ms", "total_ms"} <= set(answer.timing)
    assert answer.energy is None or isinstance(answer.energy, dict)
    assert answer.document["id"] == answer.task_id and answer.status == "succeeded"

    got = client.get(answer.task_id)  # GET /tasks/{id}: the same answer, with its status
    assert isinstance(got, Answer) and got.document["status"] == "succeeded"
    assert got.predictions_sha256 == answer.predictions_sha256 and np.array_equal(got.scores, answer.scores)
    npy = client.predictions(answer.task_id)
    assert npy.dtype == np.int64 and np.array_equal(npy, answer.predictions)


def test_config_is_validated_by_the_service(client):
    with pytest.raises(Refused) as err:
        client.run(small_task(), epochz=3)
    assert err.value.status == 422 and "epochz" in err.value.message
    with pytest.raises(Refused) as err:
        client.run(small_task(), depth=0)
    assert err.value.status == 422 and "config.depth" in err.value.message
    assert err.value.document["error"] == err.value.message


# --------------------------------------------------------------------------- refusals


class Counting(httpx.MockTransport):
    """A transport that answers nothing useful and counts what reached it."""

    def __init__(self):
        self.requests: list[httpx.Request] = []
        super().__init__(lambda r: self.requests.append(r) or httpx.Response(500))


def test_a_mapping_with_query_labels_is_refused_before_any_request():
    task = small_task(19, 7, seed=2).as_dict()
    transport = Counting()
    with Client("http://127.0.0.1:1", transport=transport) as c:
        for bad, words in [({**task, "test_labels": np.zeros(7, dtype=np.int64)}, "query labels must never be sent"),
                           ({**task, "notes": np.zeros(1)}, "'notes'"),
                           ({k: v for k, v in task.items() if k != "test_images"}, "missing test_images"),
                           ({**task, "train_labels": np.array([None] * 19)}, "Python objects")]:
            for send in (c.run, c.submit):
                with pytest.raises(BadInput, match=words) as err:
                    send(bad)
                assert isinstance(err.value, (ClientError, ValueError)) and "nothing was sent" in str(err.value)
        with pytest.raises(BadInput, match="task file not found"):
            c.run("no/such/task.npz")
        with pytest.raises(BadInput, match="must be a number"):
            c.run(task, epochs=True)
        with pytest.raises(BadInput, match="not config fields"):
            c.run(task, include="scores")
        with pytest.raises(BadInput, match="a task id is required"):
            c.get(" ")
    assert transport.requests == []
    with pytest.raises(BadInput, match="http:// or https://"):
        Client("127.0.0.1:8000")


def test_a_leaky_npz_file_is_refused_with_the_services_422(client, tmp_path):
    path = leaky_npz(tmp_path / "leaky.npz", small_task(19, 7, seed=3))
    for send in (client.run, client.submit):
        with pytest.raises(Refused) as err:
            send(path)
        assert err.value.status == 422
        assert "test_labels" in err.value.message and "query/test labels" in err.value.message
        assert err.value.message == err.value.document["error"]
        assert "(422)" in str(err.value) and err.value.url == client.tasks_url


def test_unknown_id_is_404(client):
    for call in (client.get, client.wait, client.cancel, client.predictions):
        with pytest.raises(Refused) as err:
            call("no-such-task")
        assert err.value.status == 404 and "no-such-task" in err.value.message


def test_cancel_of_a_finished_task_is_409(client):
    answer = client.run(small_task(19, 7, seed=4))
    with pytest.raises(Refused) as err:
        client.cancel(answer.task_id)
    assert err.value.status == 409 and "already finished (succeeded)" in err.value.message


def test_a_missing_key_is_401_and_no_server_is_connection_failed(server):
    with Client(server.url) as c, pytest.raises(Refused) as err:
        c.page()
    assert err.value.status == 401
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Client(url) as c, pytest.raises(ConnectionFailed) as err:
        c.health()
    assert url in str(err.value) and err.value.status is None


def test_health(client):
    doc = client.health()
    assert doc["ready"] is True and doc["backend"] == "cpu"


# --------------------------------------------------------------------------- the ledger, page after page


def test_tasks_iterates_every_page(client):
    ids = [client.submit(small_task(19, 7, seed=60 + i), backend="cpu") for i in range(3)]
    for task_id in ids:
        client.wait(task_id, timeout=120)
    one_page = client.page(limit=500)
    assert one_page.next_cursor is None
    listed = [t.id for t in one_page.tasks]
    assert [i for i in listed if i in ids] == ids[::-1]  # newest first
    first = client.page(limit=1)
    assert len(first.tasks) == 1 and first.next_cursor is not None
    walked = list(client.tasks(limit=1))
    assert all(isinstance(t, TaskStatus) for t in walked)
    assert [t.id for t in walked] == listed
    assert [t.id for t in client.tasks(limit=2, cursor=first.next_cursor)] == listed[1:]
    succeeded = list(client.tasks(status="succeeded", limit=2))
    assert {t.id for t in succeeded} >= set(ids) and all(t.status == "succeeded" for t in succeeded)
    with pytest.raises(Refused) as err:
        list(client.tasks(status="done"))
    assert err.value.status == 422


# --------------------------------------------------------------------------- held runs: 503, cancel, wait


def test_503_retry_after_cancel_and_wait_on_a_held_server(tmp_path):
    gate = FileGate(tmp_path / "hold")
    env = {"REV88_BACKEND": "cpu", "REV88_WORKERS": "1", "REV88_QUEUE_SIZE": "1"}
    try:
        with running_server(tmp_path, env=env, gate=gate.path) as srv, Client(srv.url, timeout=120) as c:
            gate.hold()
            running = c.submit(small_task(19, 7, seed=71))
            wait_for(lambda: c.get(running).status == "running", 60, 0.05, "the first task to run")
            queued = c.submit(small_task(19, 7, seed=72))
            assert c.get(queued).status == "queued"
            # a synchronous task of another client takes the queue's one place (an asynchronous task
            # waits in the ledger and gives its place up to it): the queue is full of synchronous work
            held: list = []
            holder = threading.Thread(target=lambda: held.append(Client(srv.url, timeout=120).run(
                small_task(19, 7, seed=75))), daemon=True)
            holder.start()
            wait_for(lambda: (httpx.get(srv.url + "/health").json()["admission"]["device_queue"]["depth"] == 1
                              and any(r["synchronous"] == 1 for r in
                                      httpx.get(srv.url + "/health").json()["admission"]["tenants"].values())),
                     60, 0.05, "the synchronous task in the queue")

            with pytest.raises(NotFinished) as late:  # wait gives up; the task goes on
                c.wait(running, timeout=0.2)
            assert late.value.document["status"] == "running" and "still running after 0.2 s" in str(late.value)

            # full: a 503 with Retry-After, retried once after the wait it asks for, then Unavailable
            task = small_task(19, 7, seed=73)
            notices, waits = [], []
            with Client(srv.url, retries=1, max_wait=7.5, sleep=waits.append,
                        on_retry=lambda exc, wait, n: notices.append((exc, wait, n))) as busy:
                with pytest.raises(Unavailable) as full:
                    busy.run(task)
            assert full.value.status == 503 and "queue" in full.value.message
            assert full.value.retry_after is not None and full.value.retry_after >= 1
            ((first, wait, n),) = notices
            assert n == 1 and waits == [wait] == [min(first.retry_after, 7.5)]
            assert "still busy after 1 retries (503)" in str(full.value)

            # cancel the queued task: wait raises TaskFailed with its status document
            assert c.cancel(queued).status == "cancelled"
            with pytest.raises(TaskFailed) as failed:
                c.wait(queued, timeout=10)
            assert failed.value.task_status == "cancelled" and failed.value.document["status"] == "cancelled"
            assert failed.value.document["error"] and failed.value.status == failed.value.document["error"]["status"]
            filler = c.submit(small_task(19, 7, seed=74))  # the queue is full again

            def drain(seconds: float) -> None:  # the retry's wait: let the held runs go and the queue empty
                waits.append(seconds)
                gate.release()
                wait_for(lambda: c.get(filler).finished, 60, 0.05, "the queue to drain")

            waits.clear()
            with Client(srv.url, retries=3, sleep=drain, on_retry=lambda exc, wait, n: notices.append((exc, wait, n))
                        ) as patient:
                answer = patient.run(task)
            assert len(notices) == 2 and waits == [min(notices[1][0].retry_after, MAX_RETRY_WAIT_S)]
            assert answer.predictions_sha256 == in_process_sha256(task)
            assert isinstance(c.wait(running, timeout=60), Answer)
            holder.join(60)
            assert held and held[0].predictions_sha256 == in_process_sha256(small_task(19, 7, seed=75))
    finally:
        gate.release()


# --------------------------------------------------------------------------- AsyncClient


def test_async_client_shares_the_operations(server):
    task = small_task(19, 7, seed=81)
    expected = in_process_sha256(task)

    async def main():
        async with AsyncClient(server.url, api_key=API_KEY, timeout=120) as ac:
            answer = await ac.run(task_to_npz_bytes(task), backend="cpu", progress=lambda s, t: None)
            task_id = await ac.submit(task, backend="cpu")
            waited = await ac.wait(task_id, timeout=60)
            listed = [t.id async for t in ac.tasks(limit=1)]
            npy = await ac.predictions(task_id)
            with pytest.raises(Refused) as err:
                await ac.get("no-such-task")
            return answer, waited, listed, npy, err.value

    answer, waited, listed, npy, missing = asyncio.run(main())
    assert answer.predictions_sha256 == waited.predictions_sha256 == expected
    assert listed[0] == waited.task_id and answer.task_id in listed
    assert np.array_equal(npy, waited.predictions)
    assert missing.status == 404


# --------------------------------------------------------------------------- answers that do not add up


def test_an_answer_whose_predictions_do_not_hash_is_refused():
    preds = np.array([3, 1, 4], dtype=np.int64)
    good = {"id": "t", "predictions": preds.tolist(), "predictions_sha256": array_sha256(preds), "metadata": {}}
    assert np.array_equal(Answer(good).predictions, preds)
    with pytest.raises(BadAnswer, match="do not hash"):
        _ = Answer({**good, "predictions": [3, 1, 5]}).predictions
    with pytest.raises(BadAnswer, match="not all class numbers"):
        _ = Answer({**good, "predictions": [3, 1, 4.0]}).predictions
    with pytest.raises(BadAnswer, match="documented JSON"):
        Answer({"id": "t", "predictions": "314"})
    npy = httpx.MockTransport(lambda r: httpx.Response(200, content=b"\x93NUMPY", headers={"X-Predictions-SHA256": "0"}))
    with Client("http://svc", transport=npy) as c, pytest.raises(BadAnswer, match="not a .npy array"):
        c.predictions("t")


# --------------------------------------------------------------------------- the retry policy


def test_retry_policy():
    assert retry_after_seconds("3") == 3.0 and retry_after_seconds(" 2.5 ", 4) == 2.5
    assert retry_after_seconds("-3") == 0.0
    assert [retry_after_seconds(None, n) for n in range(4)] == [DEFAULT_RETRY_WAIT_S * 2**n for n in range(4)]
    assert retry_after_seconds("soon", 1) == retry_after_seconds("nan", 1) == 2 * DEFAULT_RETRY_WAIT_S
    assert retry_after_seconds(None, 40) == MAX_RETRY_WAIT_S and retry_after_seconds("100000") == MAX_RETRY_WAIT_S
    assert retry_after_seconds("100000", cap=7) == 7.0
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25.0 <= retry_after_seconds(soon) <= 30.0
    assert retry_after_seconds(email.utils.formatdate(time.time() - 100, usegmt=True)) == 0.0


def test_a_503_that_may_have_recorded_the_task_is_resent_only_with_an_idempotency_key():
    """The shared ledger lost its connection during the task's commit and could not read it
    back: ``"accepted": "unknown"``. Without an Idempotency-Key a resend might train it twice, so
    the client raises at once; with one, it retries as for any 503."""
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("Idempotency-Key"))
        if len(sent) in (1, 2):
            return httpx.Response(503, json={"error": "the task ledger is unavailable: ... unknown", "accepted": "unknown"},
                                  headers={"Retry-After": "0"})
        return httpx.Response(202, json={"id": "t1", "status": "queued"}, headers={"Location": "/tasks/t1"})

    task = small_task(20, 3, seed=1)
    with Client("http://svc", transport=httpx.MockTransport(answer), retries=3) as c:
        with pytest.raises(Unavailable, match="unknown"):
            c.submit(task)
        assert len(sent) == 1  # not resent
        assert c.submit(task, idempotency_key="k-1") == "t1"
        assert sent == [None, "k-1", "k-1"]  # with the key: retried
