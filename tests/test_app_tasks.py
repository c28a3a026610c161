"""POST /tasks end to end on a real uvicorn server (cpu backend): the MNIST draw-0 task
against `rev88 run`, scores and npz answers, multipart, config overrides, divergence,
request ids, the energy measurement on CPU, and the OpenAPI docs."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from learner.config import make_config
from learner.hashing import array_sha256
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import ROOT, post_task, running_server, wait_for

TIMING_KEYS = {"queue_wait_ms", "parse_ms", "run_ms", "total_ms"}
RUN_VARYING = {"preparation_seconds", "training_prediction_seconds", "run_count"}  # differ run to run


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tasks-server"), env={"REV88_BACKEND": "cpu"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def small_bytes() -> bytes:
    return task_to_npz_bytes(small_task(19, 7, seed=5))


def test_draw0_matches_rev88_run_byte_for_byte(client, draw0_npz, tmp_path):
    """Same npz, same backend: the service and `rev88 run` agree on every prediction and hash."""
    out = tmp_path / "cli.json"
    cli = subprocess.run(
        [sys.executable, "-m", "rev88", "run", "--input", str(draw0_npz), "--backend", "cpu",
         "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert cli.returncode == 0, cli.stderr
    cli_doc = json.loads(out.read_text())
    cli_predictions = np.load(out.with_name("cli.predictions.npy"))

    r = post_task(client, draw0_npz.read_bytes(), params={"backend": "cpu"})
    assert r.status_code == 200, r.text
    answer = r.json()
    predictions = np.asarray(answer["predictions"], dtype=np.int64)

    assert predictions.tobytes() == cli_predictions.astype(np.int64).tobytes()
    assert answer["predictions_sha256"] == cli_doc["predictions_sha256"] == array_sha256(predictions)
    assert answer["scores_sha256"] == cli_doc["scores_sha256"]
    assert answer["predictions_sha256"] == "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
    labels = np.load(draw0_npz.with_name("labels.npy"))
    assert int((predictions == labels).sum()) == 8887 and labels.size == 10_000

    service_meta = {k: v for k, v in answer["metadata"].items() if k not in RUN_VARYING}
    cli_meta = {k: v for k, v in cli_doc["metadata"].items() if k not in RUN_VARYING}
    assert service_meta == cli_meta

    assert answer["device"] == "cpu" and answer["metadata"]["backend"] == "cpu"
    assert answer["versions"] == answer["metadata"]["versions"]
    assert set(answer["timing"]) >= TIMING_KEYS
    t = answer["timing"]
    assert all(t[k] >= 0 for k in TIMING_KEYS)
    assert t["run_ms"] == pytest.approx(answer["metadata"]["training_prediction_seconds"] * 1000, abs=1e-3)
    assert t["total_ms"] >= t["run_ms"] and t["run_clock"] == "perf_counter"
    # the phases add up to at most the total (the parse, by the task's own job here, is not device time)
    assert t["parse_ms"] > 0 and t["device_ms"] >= t["run_ms"]
    phases = t["receive_ms"] + t["parse_ms"] + t["queue_wait_ms"] + t["device_ms"]
    assert phases <= t["total_ms"] + 0.01
    assert answer["energy"] is None and "CPU" in answer["energy_reason"]
    assert len(answer["id"]) == 32 and "scores" not in answer


def test_include_scores_hash_to_scores_sha256(client, small_bytes):
    r = post_task(client, small_bytes, params={"include": "scores"})
    assert r.status_code == 200, r.text
    answer = r.json()
    scores = np.asarray(answer["scores"], dtype=np.float32)  # float32 -> JSON -> float32 is exact
    assert scores.shape == (7, 10)
    assert array_sha256(scores) == answer["scores_sha256"]
    assert scores.argmax(axis=1).tolist() == answer["predictions"]


def test_accept_npz_returns_predictions_and_scores(client, small_bytes):
    as_json = post_task(client, small_bytes).json()
    r = post_task(client, small_bytes, headers={"Accept": "application/x-npz"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-npz"
    with np.load(io.BytesIO(r.content), allow_pickle=False) as npz:
        assert sorted(npz.files) == ["predictions", "scores"]
        predictions, scores = npz["predictions"], npz["scores"]
    assert predictions.dtype == np.int64 and scores.dtype == np.float32 and scores.shape == (7, 10)
    assert array_sha256(predictions) == r.headers["x-predictions-sha256"] == as_json["predictions_sha256"]
    assert array_sha256(scores) == r.headers["x-scores-sha256"] == as_json["scores_sha256"]
    assert predictions.tolist() == as_json["predictions"]
    # JSON stays the answer when JSON is preferred
    r = post_task(client, small_bytes, headers={"Accept": "application/json, application/x-npz;q=0.5"})
    assert r.headers["content-type"].startswith("application/json")


def test_query_config_overrides_match_in_process_run(client):
    task = small_task(40, 9, seed=6)
    r = post_task(client, task_to_npz_bytes(task), params={"batch_size": "7", "epochs": "1", "learning_rate": "0.05"})
    assert r.status_code == 200, r.text
    answer = r.json()
    config = make_config({"batch_size": 7, "epochs": 1, "learning_rate": 0.05})
    assert answer["metadata"]["config"] == config.as_dict()
    expected = run_task(task, config, "cpu")
    assert answer["predictions_sha256"] == expected.predictions_sha256
    assert answer["scores_sha256"] == expected.scores_sha256


def test_multipart_file_and_config_field(client):
    task = small_task(30, 5, seed=7)
    r = client.post(
        "/tasks",
        files={"file": ("task.npz", task_to_npz_bytes(task), "application/octet-stream")},
        data={"config": json.dumps({"epochs": 1, "seed": 3})},
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    config = make_config({"epochs": 1, "seed": 3})
    assert answer["metadata"]["config"] == config.as_dict()
    assert answer["predictions_sha256"] == run_task(task, config, "cpu").predictions_sha256


def test_compressed_npz_is_accepted_as_x_npz(client):
    task = small_task(19, 7, seed=8)
    r = post_task(client, task_to_npz_bytes(task, compressed=True), headers={"Content-Type": "application/x-npz"})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"]["input_hashes"]["train_labels"] == array_sha256(task.train_labels)


def test_divergence_is_422_and_the_service_keeps_serving(client, small_bytes):
    r = post_task(client, small_bytes, params={"learning_rate": "1e9"})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["type"] == "TrainingDivergedError"
    assert body["error"].startswith("training diverged at epoch ") and "non-finite" in body["error"]
    assert isinstance(body["epoch"], int) and isinstance(body["step"], int)  # stopped where it was found
    good = post_task(client, small_bytes)
    assert good.status_code == 200, good.text
    assert len(good.json()["predictions"]) == 7


def test_request_id_echoed_or_created(client, small_bytes, server):
    r = post_task(client, small_bytes, headers={"X-Request-ID": "trace-abc.123"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-abc.123" and r.json()["request_id"] == "trace-abc.123"
    r = client.get("/v2/health/live")
    created = r.headers["x-request-id"]
    assert len(created) == 32 and int(created, 16) >= 0
    r = client.get("/v2/health/live", headers={"X-Request-ID": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"
    # JSON logs: every line an object; the task's lines carry the request id (the log's own thread
    # writes them: app/http/logs.py, so they may come a moment after the answers)

    def lines_of_the_task() -> list[dict]:
        lines = [json.loads(line) for line in server.logs().splitlines() if line.startswith("{")]
        return [rec for rec in lines if rec.get("request_id") == "trace-abc.123"]

    wait_for(lambda: {rec["msg"] for rec in lines_of_the_task()} >= {"request", "task answered"}, 30,
             what="the task's log lines")
    mine = lines_of_the_task()
    assert any(rec.get("status") == 200 and rec.get("path") == "/tasks" for rec in mine)


def test_measure_energy_on_cpu_answers_energy_null_with_reason(client):
    task = small_task(19, 7, seed=9)
    params = {"measure": "energy", "trials": "1", "target_seconds": "0.1", "settle_seconds": "0",
              "idle_seconds": "0"}
    r = post_task(client, task_to_npz_bytes(task), params=params)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["measure"] == "energy"
    assert answer["energy"] is None
    assert "CPU" in answer["energy_reason"]
    assert answer["protocol"] == {"trials": 1, "target_seconds": 0.1, "settle_seconds": 0.0, "idle_seconds": 0.0}
    measurement = answer["measurement"]
    assert measurement["energy"] is None and measurement["backend"] == "cpu"
    assert answer["predictions_sha256"] == run_task(task, backend="cpu").predictions_sha256
    assert measurement["timing"]["wall_ms_per_task"]["median"] > 0


def test_docs_and_openapi_without_auth(client):
    r = client.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()
    spec = client.get("/openapi.json").json()
    post = spec["paths"]["/tasks"]["post"]
    assert set(post["requestBody"]["content"]) == {"application/octet-stream", "application/x-npz", "multipart/form-data"}
    names = {p["name"] for p in post["parameters"]}
    assert {"backend", "include", "measure", "batch_size", "learning_rate"} <= names
    assert {"/health", "/v2/health/live", "/v2/health/ready", "/metrics"} <= set(spec["paths"])
    assert client.get("/metrics").status_code == 200  # no key needed with auth off
