"""The OpenAPI document is the service's exact contract: schemathesis (every check, a fixed seed,
bounded examples) against a real server must find nothing -- no 5xx, no schema-valid request
refused, no response off its documented schema. And the contract's own details, read from the
document: config ranges from learner.config.BOUNDS, status enums, /metrics as text."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from learner.config import BOUNDS, FIELDS, INT_FIELDS
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import post_task, running_server

# Which answers are right for a schema-valid request that the schema cannot fully describe:
# any bytes are a schema-valid npz body, but only a real npz trains (400/413/415/422 name what
# is wrong with the rest); a cursor is opaque (only one a previous page returned is accepted); an
# evaluation's protocol applies only with measure, and its config must fit the task budget.
CONFIG = """
[[operations]]
include-name = "POST /tasks"
checks.positive_data_acceptance.expected-statuses = [200, 202, 400, 413, 415, 422, 503]

[[operations]]
include-name = "GET /tasks"
checks.positive_data_acceptance.expected-statuses = [200, 422]

[[operations]]
include-name = "GET /datasets"
checks.positive_data_acceptance.expected-statuses = [200, 422]

[[operations]]
include-name = "PUT /datasets/{{digest}}"
checks.positive_data_acceptance.expected-statuses = [200, 201, 400, 413, 415, 422, 503]

[[operations]]
include-name = "POST /datasets"
checks.positive_data_acceptance.expected-statuses = [200, 201, 400, 413, 415, 422, 503]

[[operations]]
include-name = "PUT /datasets/{{digest}}/labels"
checks.positive_data_acceptance.expected-statuses = [200, 201, 400, 404, 409, 413, 415, 422, 503]

[[operations]]
include-name = "POST /sweeps"
checks.positive_data_acceptance.expected-statuses = [202, 404, 409, 413, 422, 503]

[[operations]]
include-name = "GET /sweeps"
checks.positive_data_acceptance.expected-statuses = [200, 422]

[[operations]]
include-name = "POST /evaluations"
checks.positive_data_acceptance.expected-statuses = [202, 409, 413, 422, 503]

[[operations]]
include-name = "GET /evaluations"
checks.positive_data_acceptance.expected-statuses = [200, 422]

[parameters]
task_id = "{task_id}"
"""


def test_schemathesis_finds_nothing(tmp_path):
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if st is None:
        pytest.fail("schemathesis is not installed (it is in the test extra: pip install -e '.[test]')")
    # Evaluations are real: each accepted one trains its draws (10,000 x 10,000 tasks). The task
    # budget here admits a draw of one epoch at the default depth, no more, and the queue takes
    # the cells of the few the fuzzer gets accepted, so that the tasks it sends meanwhile are not
    # refused for a full queue (a 503).
    from learner.budget import estimate
    from learner.config import Config

    work = estimate(10000, 10000, Config(epochs=1)).work
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_MAX_TASK_WORK": str(work),
           "REV88_QUEUE_SIZE": "400"}
    with running_server(tmp_path, env=env) as server:
        with server.client() as c:  # one real task, so the {task_id} operations reach a task
            done = post_task(c, task_to_npz_bytes(small_task()), params={"epochs": 1})
            assert done.status_code == 200, done.text
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG.format(task_id=done.json()["id"]))
        run = subprocess.run(
            [st, "--config-file", str(config), "run", f"{server.url}/openapi.json", "--checks", "all",
             "--seed", "88", "--max-examples", "25", "--workers", "1", "--no-shrink"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert " passed" in run.stdout and "failures" not in run.stdout.split("SUMMARY")[-1].lower(), run.stdout[-3000:]
    logs = server.logs()  # no request of any shape reached a 500 (the access log's status, uvicorn's own)
    served = [json.loads(line) for line in logs.splitlines() if line.startswith("{") and '"msg": "request"' in line]
    assert served and all(line["status"] != 500 for line in served), [r for r in served if r["status"] == 500][:3]
    assert "Internal Server Error" not in logs and "Exception in ASGI application" not in logs, logs[-2000:]


def _document():
    from app.main import create_app
    from app.settings import Settings

    return create_app(Settings(backend="cpu")).openapi()


def test_config_fields_carry_their_ranges():
    params = {p["name"]: p["schema"] for p in _document()["paths"]["/tasks"]["post"]["parameters"]}
    for name in FIELDS:
        schema, (low, high) = params[name], BOUNDS[name]
        assert schema["type"] == ("integer" if name in INT_FIELDS else "number")
        assert schema.get("minimum", schema.get("exclusiveMinimum")) == low
        assert schema.get("maximum", schema.get("exclusiveMaximum")) == high
    assert params["depth"] == {"type": "integer", "minimum": 1, "maximum": 64}
    assert params["learning_rate"]["exclusiveMinimum"] == 0 and "minimum" not in params["learning_rate"]
    assert params["momentum"]["exclusiveMaximum"] == 1 and "maximum" not in params["momentum"]


def test_statuses_bodies_and_metrics_are_documented():
    doc = _document()
    status = next(p for p in doc["paths"]["/tasks"]["get"]["parameters"] if p["name"] == "status")
    enum = next(s["enum"] for s in status["schema"]["anyOf"] if "enum" in s)
    assert enum == ["queued", "running", "succeeded", "failed", "cancelled"]
    body = doc["paths"]["/tasks"]["post"]["requestBody"]["content"]
    assert {"application/octet-stream", "application/x-npz", "multipart/form-data"} <= set(body)
    assert body["multipart/form-data"]["schema"]["required"] == ["file"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "application/json" not in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    for path, item in doc["paths"].items():  # every documented error answer has its model
        for method, op in item.items():
            for code, response in op["responses"].items():
                if int(code) >= 400:
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.rsplit("/", 1)[-1] in ("ErrorBody", "Health", "Probe"), (method, path, code, ref)
