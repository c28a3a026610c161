"""The products' precision (issue #47): ``?precision=ieee|tf32x3`` (422 for anything else, and for
tf32x3 on a backend without it), said in every answer's metadata, and part of the launch key so
that tasks of different precisions never share a launch. The fused backend's own handling of a
precision (the kernel's ``tl.dot`` input precision, ``backend_details.precision``) is in
tests/test_fused.py; how a backend is put at a precision, with stand-ins, here."""

from __future__ import annotations

import types

import pytest

from app.errors import InvalidRequest
from app.tasks.device import at_precision, launch_key
from app.tasks.options import check_precision, parse_options
from app.tasks.runner import TaskRunner
from app.tasks.work import Work
from learner.config import make_config

from .helpers import small_task
from .server import post_task, running_server


def test_the_option_is_checked_before_the_body():
    assert parse_options([("precision", "ieee")], "cpu").precision == "ieee"
    assert parse_options([], "cpu").precision is None  # the backend's own
    with pytest.raises(InvalidRequest, match=r"precision must be one of ieee, tf32x3, got 'fp16'") as info:
        parse_options([("precision", "fp16")], "cpu")
    assert info.value.status == 422
    with pytest.raises(InvalidRequest, match="precision=tf32x3 is the fused backend's; backend 'cpu'"):
        parse_options([("precision", "tf32x3"), ("backend", "cpu")], "cpu")
    assert check_precision("tf32x3", "fused") == "tf32x3"
    with pytest.raises(InvalidRequest, match="given more than once"):
        parse_options([("precision", "ieee"), ("precision", "tf32x3")], "cpu")


def test_different_precisions_never_share_a_launch():
    task, config = small_task(19, 7), make_config({"batch_size": 8})
    key = launch_key(task, config, "fused", "tf32x3")
    assert key == launch_key(task, config.replace(seed=99), "fused", "tf32x3")  # seeds may differ
    assert key != launch_key(task, config, "fused", "ieee")
    assert key != launch_key(task, config, "fused")  # the backend's own precision: kept apart too
    # the runner's batch for a task carries its precision in the key and into the launch
    launched = []
    runner = types.SimpleNamespace(batch_max=8, energy=None, engines=None, launches=types.SimpleNamespace(
        run=lambda items, backend, precision: launched.append((backend, precision))))
    a, b = (TaskRunner.task_batch(runner, Work(task_id=p, task=task, config=config, backend="fused", precision=p))
            for p in ("ieee", "tf32x3"))
    assert a.key != b.key and a.key == launch_key(task, config, "fused", "ieee")
    a.run([])
    b.run([])
    assert launched == [("fused", "ieee"), ("fused", "tf32x3")]


def test_the_precision_is_kept_with_the_task():
    """An asynchronous task runs again after a restart (or on another replica) from its ledger row:
    its options keep the precision asked for."""
    acc = Work(task_id="t", task=None, config=make_config({}), backend="fused", precision="ieee")
    assert acc.options()["precision"] == "ieee"
    assert "precision" not in Work(task_id="u", task=None, config=make_config({}), backend="cpu").options()


def test_a_backend_at_a_precision():
    class Fused:
        name = "fused"

        def with_precision(self, precision):
            return ("view", precision)

    class Cpu:
        name = "cpu"

    cpu = Cpu()
    assert at_precision(Fused(), "tf32x3") == ("view", "tf32x3")
    assert at_precision(cpu, None) is cpu and at_precision(cpu, "ieee") is cpu
    with pytest.raises(ValueError, match="computes its products in fp32"):
        at_precision(cpu, "tf32x3")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("precision-server"), env={"REV88_BACKEND": "cpu"}) as srv:
        with srv.client() as c:
            yield c


def test_over_http(client):
    from learner.taskio import task_to_npz_bytes

    body = task_to_npz_bytes(small_task(19, 7))
    for params, words in ((("precision", "bf16"),), ["precision must be one of ieee, tf32x3"]), \
                         ((("precision", "tf32x3"),), ["fused backend's"]):
        r = post_task(client, body, params=dict(params))
        assert r.status_code == 422, r.text
        assert all(w in r.json()["error"] for w in words)
    ok = post_task(client, body, params={"precision": "ieee", "batch_size": "8"})
    plain = post_task(client, body, params={"batch_size": "8"})
    assert ok.status_code == plain.status_code == 200, (ok.text, plain.text)
    assert ok.json()["metadata"]["precision"] == plain.json()["metadata"]["precision"] == "ieee"
    assert ok.json()["predictions_sha256"] == plain.json()["predictions_sha256"]
