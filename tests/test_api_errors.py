"""Errors that teach (issue #56), on a real server: a request that does not validate is told which
field is wrong and what it must be, in words (no "body", no pydantic's "Input should be", no
regular expression); a misspelt field is matched to the one meant; a digest without its
``sha256:`` prefix is shown the expected form and the digest meant; a path no route serves
answers a client with JSON and a hint, a browser with a page that leads on; an unknown task is
said to be missing from this server, not from "this replica's ledger"."""

from __future__ import annotations

import re

import httpx
import pytest

from app.api.errors import PATTERN_WORDS
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .server import NPZ, running_server

HEX = "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("errors-server"),
                        env={"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "1", "REV88_API_KEY": ""}) as srv:
        with srv.client() as c:
            yield c


def refused(r: httpx.Response, status: int = 422) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    for jargon in ("body ", "Input should", "Extra inputs", "Field required", "^", "[0-9a-f]{64}"):
        assert jargon not in error, (jargon, error)
    return error


@pytest.fixture(scope="module")
def dataset(client) -> str:
    body = task_to_npz_bytes(small_task(12, 5))
    r = client.post("/datasets", content=body, headers=NPZ)
    assert r.status_code in (200, 201), r.text
    return r.json()["digest"]


def test_a_field_of_the_wrong_kind_is_named_with_what_it_must_be(client, dataset):
    error = refused(client.post("/sweeps", json={"dataset": dataset, "grid": {"learning_rate": 0.1}}))
    assert error == "invalid request: grid.learning_rate must be a list, got 0.1"
    error = refused(client.post("/sweeps", json={"dataset": dataset, "grid": {"learning_rate": [0.1, "fast"]}}))
    assert error == 'invalid request: grid.learning_rate[1] must be a number, got "fast"'
    error = refused(client.post("/sweeps", json={"grid": {"learning_rate": [0.1]}}))
    assert error == "invalid request: dataset is required"
    # a union (seeds: a list, or {"start", "count"}): the member that got furthest speaks
    error = refused(client.post("/evaluations", json={"draws": "0", "seeds": {"start": 0, "count": "x"}}))
    assert error == 'invalid request: seeds.count must be a whole number, got "x"'
    error = refused(client.post("/evaluations", json={"draws": "0", "seeds": "all"}))
    assert error.startswith("invalid request: seeds must be a list or a JSON object") and '"all"' in error
    error = refused(client.post("/keys", json={"name": "x", "scopes": ["reed"]}))
    assert error == "invalid request: scopes[0] must be 'read', 'write' or 'admin', got \"reed\""
    error = refused(client.get("/tasks", params={"limit": "0"}))
    assert error == 'invalid request: query parameter limit must be at least 1, got "0"'
    error = refused(client.post("/sweeps", content=b"{not json", headers={"Content-Type": "application/json"}))
    assert error.startswith("invalid request: the request is not valid JSON (")


def test_a_misspelt_field_or_key_is_matched_to_the_one_meant(client, dataset):
    error = refused(client.post("/evaluations", json={"draws": "0", "confg": {}}))
    assert error == "invalid request: confg is not a field of this request (did you mean config?)"
    error = refused(client.post("/sweeps", json={"dataset": dataset, "seed": [1]}))
    assert "seed is not a field of this request (did you mean seeds?)" in error
    error = refused(client.post("/sweeps", json={"dataset": dataset, "zzz": 1}))
    assert "zzz is not a field of this request; its fields: dataset, config, grid, seeds" in error
    error = refused(client.post("/evaluations", json={"draws": "0", "config": {"epoch": 1}}))
    assert "epoch (did you mean epochs?)" in error
    error = refused(client.post("/tasks", params={"epoch": "1"}, content=task_to_npz_bytes(small_task()), headers=NPZ))
    assert "unknown config key(s): epoch (did you mean epochs?)" in error


def test_a_digest_without_its_prefix_is_shown_the_form_and_the_digest_meant(client):
    meant = f"did you mean sha256:{HEX}?"
    for r in (client.put(f"/datasets/{HEX}", content=b"x", headers=NPZ), client.get(f"/datasets/{HEX}"),
              client.post("/sweeps", json={"dataset": HEX})):
        error = refused(r)
        assert "sha256:<64 lowercase hex digits> (the SHA-256 of the npz bytes)" in error and error.endswith(meant)
    error = refused(client.post("/tasks", params={"dataset": HEX}))
    assert "sha256:<64 lowercase hex digits>" in error and error.endswith(meant)
    error = refused(client.get("/datasets/sha256:xyz"))
    assert error == ('invalid request: digest (in the path) must be sha256:<64 lowercase hex digits> '
                     '(the SHA-256 of the npz bytes), got "sha256:xyz"')


def test_every_pattern_of_the_api_has_its_words(client):
    """No refusal shows a regular expression: each pattern the OpenAPI document names is said in words."""
    spec = client.get("/openapi.json").json()
    patterns = set(re.findall(r'"pattern":\s*"((?:[^"\\]|\\.)*)"', httpx.Response(200, json=spec).text))
    assert patterns
    for escaped in patterns:
        pattern = escaped.encode().decode("unicode_escape")
        assert pattern in PATTERN_WORDS, f"no words for the pattern {pattern!r} (app/api/errors.py PATTERN_WORDS)"


def test_a_path_no_route_serves(client):
    r = client.get("/taks", headers={"Accept": "application/json"})
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["error"] == "Not Found" and "/docs" in body["hint"] and "GET /taks" in body["hint"]
    r = client.get("/taks", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})  # a browser's
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "No such page" in r.text and 'href="/"' in r.text and 'href="/docs"' in r.text
    assert client.post("/taks", headers={"Accept": "text/html"}).headers["content-type"].startswith("application/json")


def test_an_unknown_task_is_missing_from_this_server(client):
    error = refused(client.get("/tasks/no-such-task"), 404)
    assert error == "no task 'no-such-task' on this server (GET /tasks lists its tasks)"
