"""Health, live, ready and metrics shapes; auth on (a real server with REV88_API_KEY) and
off; settings from the environment."""

from __future__ import annotations

import pytest

from app.runtime.devices import plan
from app.settings import Settings, SettingsError
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import post_task, running_server

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

GPU_FIELDS = {
    "name", "uuid", "driver", "cuda_version", "temperature_c", "power_w", "power_limit_w", "energy_counter_mj",
    "graphics_clock_mhz", "memory_clock_mhz", "memory_used_bytes", "memory_total_bytes", "utilization_percent",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"REV88_BACKEND": "cpu", "REV88_API_KEY": KEY}
    with running_server(tmp_path_factory.mktemp("auth-server"), env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------- auth


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready", "/health"])
def test_health_probes_need_no_key(client, path):
    assert client.get(path).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/tasks"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/nope")],
)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": KEY}])
def test_every_other_route_needs_the_bearer_key(client, method, path, headers):
    r = client.request(method, path, headers={"Content-Type": "application/octet-stream", **headers}, content=b"x")
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["error"].startswith("unauthorized")
    assert r.headers["x-request-id"]


def test_with_the_key_tasks_metrics_and_docs_work(client):
    r = post_task(client, task_to_npz_bytes(small_task(19, 7, seed=21)), headers=AUTH)
    assert r.status_code == 200, r.text
    assert client.get("/metrics", headers=AUTH).status_code == 200
    assert client.get("/docs", headers=AUTH).status_code == 200
    assert client.get("/openapi.json", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


# --------------------------------------------------------------------------- health shapes


def test_live_and_ready(client):
    assert client.get("/v2/health/live").json() == {"status": "live"}
    assert client.get("/v2/health/ready").json() == {"status": "ready"}


def test_health_document(client):
    r = client.get("/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["ready"] is True
    assert h["device"] == "cpu" and h["backend"] == "cpu"
    if has_gpu():
        assert set(h["gpu"]) == GPU_FIELDS
    else:  # no NVML here: null and why, never made-up numbers
        assert h["gpu"] is None
        assert isinstance(h["gpu_reason"], str) and h["gpu_reason"]
        assert h["energy"]["per_request"] is False and h["energy"]["reason"]

    learner = h["learner"]
    assert learner["validated"] is True
    assert learner["validation"] == {"passed": True, "device": "cpu", "checks": 4}
    assert "cpu" in learner["warm_backends"]
    assert learner["backends"]["cpu"]["backend"] == "cpu" and learner["backends"]["cpu"]["threads"] >= 1
    assert learner["cached_graphs"] == []  # the cpu backend captures no graphs
    # measured at the warm-up: whether a launch's hashes go sixteen side by side here, and how fast
    from learner.hashing import lanes_speedup

    lanes = learner["sha256_lanes"]  # (the server's own measurement: this process's differs a little)
    assert set(lanes) == {"used", "speedup_vs_hashlib"} and lanes["used"] == (lanes["speedup_vs_hashlib"] > 1.0)
    assert lanes["used"] == (lanes_speedup() > 1.0), lanes
    from learner.permutations import fast

    assert learner["fast_permutations"] is fast()  # (checked against numpy once a process: the same here)
    assert learner["warmup"]["backend"] == "cpu" and len(learner["warmup"]["predictions_sha256"]) == 64

    queue = h["queue"]
    expected = plan("cpu")  # one worker per usable core; queue max(8, 4 x workers)
    assert queue["depth"] == 0 and queue["capacity"] == expected.queue_size and queue["running"] is None
    assert [w["device"] for w in queue["workers"]] == expected.devices
    assert queue["accepting"] is True and queue["accepted"] >= 1  # the warm-up at least
    assert h["uptime_s"] > 0 and h["started_at"].endswith("+00:00")
    assert h["limits"] == {"queue_size": expected.queue_size, "max_body_bytes": 64 * 1024 * 1024,
                           "task_timeout_s": 300.0, "drain_timeout_s": 30.0, "max_task_work": 50_000_000,
                           "max_task_bytes": 1 << 30, "batch_max": 1, "workers": len(expected.devices)}
    assert h["auth"] is True
    assert {"rev88", "python", "torch", "numpy", "cuda"} <= set(h["versions"])


# --------------------------------------------------------------------------- metrics


def test_metrics_names(client):
    r = post_task(client, task_to_npz_bytes(small_task(19, 7, seed=22)), headers=AUTH)
    assert r.status_code == 200
    assert post_task(client, b"not a zip", headers=AUTH).status_code == 400
    r = client.get("/metrics", headers=AUTH)
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "rev88_tasks_total", "rev88_request_seconds_bucket", "rev88_parse_seconds_bucket",
        "rev88_queue_wait_seconds_bucket", "rev88_run_seconds_bucket", "rev88_queue_depth",
        "rev88_tasks_in_flight", "rev88_device_busy", "rev88_ready",
    ):
        assert f"\n{name}" in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("rev88_")}
    assert values['rev88_tasks_total{outcome="ok"}'] >= 1
    assert values['rev88_tasks_total{outcome="bad_archive"}'] >= 1
    assert values['rev88_request_seconds_count{route="/tasks"}'] >= 2
    assert values["rev88_run_seconds_count"] >= 1
    assert values["rev88_queue_depth"] == 0 and values["rev88_ready"] == 1
    if not has_gpu():  # GPU metrics exist only where NVML does
        assert "rev88_gpu_power_watts" not in text and "rev88_gpu_energy_joules_total" not in text


# --------------------------------------------------------------------------- settings


def test_settings_defaults_and_environment():
    assert Settings.from_env({}) == Settings()
    s = Settings.from_env({
        "REV88_HOST": "0.0.0.0", "REV88_PORT": "9000", "REV88_BACKEND": "CPU", "REV88_QUEUE_SIZE": "3",
        "REV88_MAX_BODY_BYTES": "1000", "REV88_TASK_TIMEOUT_S": "2.5", "REV88_DRAIN_TIMEOUT_S": "4",
        "REV88_API_KEY": "zz-key-99", "REV88_LOG_LEVEL": "DEBUG", "REV88_THREADS": "2",
    })
    assert (s.host, s.port, s.backend, s.queue_size, s.max_body_bytes) == ("0.0.0.0", 9000, "cpu", 3, 1000)
    assert (s.task_timeout_s, s.drain_timeout_s, s.api_key, s.log_level, s.threads) == (2.5, 4.0, "zz-key-99", "debug", 2)
    assert "zz-key-99" not in repr(s)  # the key never shows in logs or reprs
    assert Settings.from_env({"REV88_API_KEY": ""}).api_key is None


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"REV88_PORT": "http"}, "REV88_PORT must be an integer"),
        ({"REV88_PORT": "70000"}, "REV88_PORT must be in 1..65535"),
        ({"REV88_BACKEND": "tpu"}, "REV88_BACKEND must be one of"),
        ({"REV88_QUEUE_SIZE": "0"}, "REV88_QUEUE_SIZE must be >= 1"),
        ({"REV88_MAX_BODY_BYTES": "-1"}, "REV88_MAX_BODY_BYTES must be >= 1"),
        ({"REV88_TASK_TIMEOUT_S": "inf"}, "REV88_TASK_TIMEOUT_S must be a finite number"),
        ({"REV88_DRAIN_TIMEOUT_S": "soon"}, "REV88_DRAIN_TIMEOUT_S must be a number"),
        ({"REV88_API_KEY": "  "}, "REV88_API_KEY is only whitespace"),
        ({"REV88_LOG_LEVEL": "loud"}, "REV88_LOG_LEVEL must be one of"),
        ({"REV88_THREADS": "0"}, "REV88_THREADS must be >= 1"),
    ],
)
def test_bad_settings_name_the_variable(env, words):
    with pytest.raises(SettingsError, match=words):
        Settings.from_env(env)
