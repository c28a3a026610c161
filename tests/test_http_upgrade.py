"""A request that offers an Upgrade the service does not take (issue #57; all of them: it serves no
WebSocket and no h2c) is served as HTTP/1.1 with its body, as RFC 9110 §7.8 lets a server do.

``curl --http2`` on an http:// URL sends its POST as HTTP/1.1 with ``Connection: Upgrade,
HTTP2-Settings`` and ``Upgrade: h2c``; a WebSocket client sends ``Upgrade: websocket``. The parser
(llhttp) takes such a request for an upgrade, skips its body and stops after its headers; the
service then ran the route on an empty body (400 "not a zip"). Here, on a real server over raw
sockets (tests/rawhttp.py), each offer on each kind of body (raw, chunked, read into one buffer,
multipart, PUT /datasets, a sweep's JSON, no body at all) gets the same answer as the same request
without the offer, never a 101 or an ``Upgrade`` header, and the connection goes on to the next
request. Every offer here is checked first to be one the parser does take for an upgrade
(``taken_for_upgrade``), so that a case cannot pass by not offering one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import httptools
import httpx
import pytest

from app.http import protocol as body_protocol
from app.main import create_app
from app.settings import Settings
from learner.config import Config
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .rawhttp import Outcome, alive, chunked, exchange, request
from .server import inprocess_server

pytestmark = pytest.mark.skipif(body_protocol.protocol_class() is None, reason=str(body_protocol.problem()))

DRAW0_PREDICTIONS_SHA256 = "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
TASK = small_task(40, 5, seed=1)
BODY = task_to_npz_bytes(TASK)  # 2 kB
LARGE = small_task(1500, 400, seed=2)
LARGE_BODY = task_to_npz_bytes(LARGE)  # 0.6 MB: read into one buffer (body_protocol.ZERO_COPY_MIN_BYTES)
NPZ = [("Content-Type", "application/octet-stream")]
CHUNKED = [("Transfer-Encoding", "chunked")]
JSON = [("Content-Type", "application/json")]

OFFERS = {
    # what curl --http2 sends
    "h2c": [("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"), ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")],
    "websocket": [("Connection", "Upgrade"), ("Upgrade", "websocket"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                  ("Sec-WebSocket-Version", "13")],
    "any-token-any-case": [("cOnNeCtIoN", "keep-alive, UPGRADE"), ("UPGRADE", "Foo/2, TLS/1.0")],
    "connection-twice": [("Connection", "keep-alive"), ("Connection", "upgrade"), ("Upgrade", "WebSocket")],
}


def taken_for_upgrade(raw: bytes) -> bool:
    """Whether the parser the service runs on (httptools' llhttp) takes the request in ``raw`` for
    an upgrade: it stops after the headers, the body unread."""
    class Quiet:
        pass

    parser = httptools.HttpRequestParser(Quiet())
    try:
        parser.feed_data(raw)
    except httptools.HttpParserUpgrade:
        return True
    return False


def served(outcome: Outcome, statuses: list[int]) -> list:
    """The responses, checked: the ``statuses`` expected, well framed, nothing after them, and no
    upgrade accepted (no 101, no ``Upgrade`` header, no ``Connection: upgrade``)."""
    assert outcome.leftover == b"", outcome.leftover[:200]
    assert [r.status for r in outcome.responses] == statuses, [(r.status, r.body[:300]) for r in outcome.responses]
    for r in outcome.responses:
        assert "upgrade" not in r.headers and "upgrade" not in r.headers.get("connection", "").lower(), r.headers
    return outcome.responses


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # an upload deadline of an hour: a body the server waited for in vain would show as no answer
    # (the exchange's own timeout), never as a 408
    settings = Settings(backend="cpu", workers=1, data_dir=str(tmp_path_factory.mktemp("upgrade") / "data"),
                        upload_timeout_s=3600.0)
    with inprocess_server(create_app(settings), http=body_protocol.protocol_class()) as running:
        running.port = int(running.url.rsplit(":", 1)[1])
        yield running


def multipart(body: bytes, config: dict) -> tuple[bytes, str]:
    boundary = "rev88-upgrade-boundary"
    out = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"task.npz\"\r\n"
           "Content-Type: application/octet-stream\r\n\r\n").encode() + body + b"\r\n"
    out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"config\"\r\n\r\n{json.dumps(config)}\r\n"
            f"--{boundary}--\r\n").encode()
    return out, f"multipart/form-data; boundary={boundary}"


def upload(kind: str, offer: list[tuple[str, str]]) -> bytes:
    """POST /tasks, its body sent as ``kind`` says, with the headers of ``offer``."""
    if kind == "raw":
        return request("POST", "/tasks", BODY, NPZ + offer)
    if kind == "chunked":
        return request("POST", "/tasks", chunked(BODY, 501), NPZ + offer + CHUNKED)
    if kind == "large":  # read into one buffer, after an Expect: 100-continue (as curl sends a large one)
        return request("POST", "/tasks", LARGE_BODY, NPZ + offer + [("Expect", "100-continue")])
    if kind == "multipart":
        body, kind_header = multipart(BODY, {"epochs": 2})
        return request("POST", "/tasks", body, [("Content-Type", kind_header)] + offer)
    raise ValueError(kind)


EXPECTED = {}


def expected(kind: str) -> str:
    """The predictions' hash the upload of ``kind`` must answer (the learner run in process)."""
    if kind not in EXPECTED:
        task, config = {"raw": (TASK, {}), "chunked": (TASK, {}), "large": (LARGE, {}),
                        "multipart": (TASK, {"epochs": 2})}[kind]
        EXPECTED[kind] = run_task(task, Config(**config), "cpu").predictions_sha256
    return EXPECTED[kind]


def task_answer(response) -> dict:
    doc = json.loads(response.body)
    return {k: doc.get(k) for k in ("predictions_sha256", "scores_sha256")}


WITHOUT = {}


def answered_without_offer(server, kind: str) -> dict:
    if kind not in WITHOUT:
        outcome = exchange(server.port, [upload(kind, [])], want=1, timeout=60)
        final = [r for r in served(outcome, [100, 200] if kind == "large" else [200]) if r.status >= 200]
        WITHOUT[kind] = task_answer(final[0])
        assert WITHOUT[kind]["predictions_sha256"] == expected(kind)
    return WITHOUT[kind]


# --------------------------------------------------------------------------- POST /tasks


@pytest.mark.parametrize("offer", OFFERS)
@pytest.mark.parametrize("kind", ["raw", "chunked", "large", "multipart"])
def test_an_upload_that_offers_an_upgrade_is_answered_as_without_it(server, kind, offer):
    raw = upload(kind, OFFERS[offer])
    assert taken_for_upgrade(raw)
    outcome, lives = alive(server.port, [raw], want=1, timeout=60)  # then a GET on the same connection
    responses = served(outcome, [100, 200, 200] if kind == "large" else [200, 200])
    assert task_answer(responses[-2]) == answered_without_offer(server, kind)
    assert lives and not outcome.closed


def test_pipelined_requests_that_offer_upgrades_are_each_answered_in_order(server):
    """One send: uploads offering three different upgrades, with Content-Length, chunked and
    multipart bodies, then a GET offering one, then a plain upload: five answers, in order."""
    raw = (upload("raw", OFFERS["h2c"]) + upload("chunked", OFFERS["websocket"])
           + upload("multipart", OFFERS["any-token-any-case"])
           + request("GET", "/v2/health/live", headers=OFFERS["connection-twice"]) + upload("raw", []))
    outcome = exchange(server.port, [raw], want=5, timeout=120)
    first, second, third, live, last = served(outcome, [200, 200, 200, 200, 200])
    assert [task_answer(r)["predictions_sha256"] for r in (first, second, third, last)] == [
        expected("raw"), expected("chunked"), expected("multipart"), expected("raw")]
    assert live.body == b'{"status":"live"}' and not outcome.closed


@pytest.mark.parametrize("offer", ["h2c", "websocket"])
def test_an_http_1_0_upload_that_offers_an_upgrade_is_answered_and_closed(server, offer):
    raw = request("POST", "/tasks", BODY, NPZ + OFFERS[offer], version="1.0")
    assert taken_for_upgrade(raw)
    outcome = exchange(server.port, [raw], want=1, timeout=60, wait_close=5)
    (answer,) = served(outcome, [200])
    assert task_answer(answer)["predictions_sha256"] == expected("raw") and outcome.closed


def test_a_websocket_offer_is_ignored_even_where_uvicorn_has_a_websocket_protocol(tmp_path):
    """With a WebSocket library installed (uvicorn[standard]), uvicorn hands a connection that
    offers ``Upgrade: websocket`` to its WebSocket protocol. The service serves no WebSocket: the
    body protocol never does, whatever is installed. (``Taker`` stands in for such a library's
    protocol: it would answer 101.)"""
    import asyncio

    class Taker(asyncio.Protocol):
        def __init__(self, *args, **kwargs) -> None:
            self.transport = None

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                                 b"Content-Length: 0\r\n\r\n")

    settings = Settings(backend="cpu", workers=1, data_dir=str(tmp_path / "data"), upload_timeout_s=3600.0)
    with inprocess_server(create_app(settings), http=body_protocol.protocol_class(), ws=Taker) as running:
        port = int(running.url.rsplit(":", 1)[1])
        get = request("GET", "/v2/health/live", headers=OFFERS["websocket"])
        outcome = exchange(port, [upload("raw", OFFERS["websocket"]) + get], want=2, timeout=60)
        task, live = served(outcome, [200, 200])
        assert task_answer(task)["predictions_sha256"] == expected("raw") and live.body == b'{"status":"live"}'


# --------------------------------------------------------------------------- no body


@pytest.mark.parametrize("offer", OFFERS)
def test_a_get_that_offers_an_upgrade_is_answered_and_the_connection_goes_on(server, offer):
    get = request("GET", "/v2/health/live", headers=OFFERS[offer])
    assert taken_for_upgrade(get)
    outcome = exchange(server.port, [get, 0.1, get + get, 0.1, upload("raw", [])], want=4, timeout=60)
    *lives, task = served(outcome, [200, 200, 200, 200])
    assert all(r.body == b'{"status":"live"}' for r in lives) and not outcome.closed
    assert task_answer(task)["predictions_sha256"] == expected("raw")


# --------------------------------------------------------------------------- datasets, sweeps (JSON)


@pytest.mark.parametrize("offer", OFFERS)
def test_put_datasets_that_offers_an_upgrade_stores_the_body_as_without_it(server, offer):
    body = task_to_npz_bytes(small_task(30, 4, seed=100 + list(OFFERS).index(offer)))
    path = "/datasets/sha256:" + hashlib.sha256(body).hexdigest()
    put = request("PUT", path, body, NPZ + OFFERS[offer])
    assert taken_for_upgrade(put)

    def stored(raw: bytes) -> dict:
        (answer,) = served(exchange(server.port, [raw], want=1, timeout=60), [201])
        assert httpx.delete(server.url + path, timeout=30).status_code == 204
        doc = json.loads(answer.body)
        doc.pop("created_at")
        return doc

    plain = stored(request("PUT", path, body, NPZ))
    assert stored(put) == plain and plain["bytes"] == len(body)
    assert stored(request("PUT", path, chunked(body, 333), NPZ + OFFERS[offer] + CHUNKED)) == plain


def _sweep_answer(response) -> dict:
    doc = json.loads(response.body)
    return {k: v for k, v in doc.items() if k not in ("id", "location", "request_id")}


@pytest.mark.parametrize("offer", OFFERS)
def test_a_sweeps_json_that_offers_an_upgrade_is_read_as_without_it(server, offer):
    dataset = "sha256:" + hashlib.sha256(BODY).hexdigest()
    r = httpx.put(server.url + f"/datasets/{dataset}", content=BODY, headers=dict(NPZ), timeout=30)
    assert r.status_code in (200, 201), r.text
    good = json.dumps({"dataset": dataset, "grid": {"epochs": [1, 2]}, "seeds": [0]}).encode()
    bad = json.dumps({"dataset": dataset, "colour": "blue"}).encode()  # refused, naming "colour"
    for body, status in ((good, 202), (bad, 422)):
        (plain,) = served(exchange(server.port, [request("POST", "/sweeps", body, JSON)], want=1, timeout=60), [status])
        plain = _sweep_answer(plain)
        assert plain == {"status": "accepted", "cells": 2} if status == 202 else "colour" in plain["error"], plain
        for raw in (request("POST", "/sweeps", body, JSON + OFFERS[offer]),
                    request("POST", "/sweeps", chunked(body, 7), JSON + OFFERS[offer] + CHUNKED)):
            assert taken_for_upgrade(raw)
            (answer,) = served(exchange(server.port, [raw], want=1, timeout=60), [status])
            assert _sweep_answer(answer) == plain


# --------------------------------------------------------------------------- bodies that cannot be framed


@pytest.mark.parametrize("offer", ["h2c", "websocket"])
@pytest.mark.parametrize("case", ["bad-chunk", "not-chunked-last", "length-and-chunked"])
def test_a_body_that_cannot_be_framed_is_still_a_400_naming_it(server, offer, case):
    """As without the offer: 400 at once (the upload deadline is an hour), its reason named, and
    the connection closed."""
    body, headers, says = {
        "bad-chunk": (b"zz\r\nnot hex\r\n", CHUNKED, "chunk size"),
        "not-chunked-last": (b"hello", [("Transfer-Encoding", "gzip")], "Transfer-Encoding"),
        "length-and-chunked": (b"5\r\nhello\r\n0\r\n\r\n", [("Content-Length", "5"), *CHUNKED], "Content-Length"),
    }[case]
    for offer_headers in ([], OFFERS[offer]):
        raw = request("POST", "/tasks", body, NPZ + offer_headers + headers)
        outcome = exchange(server.port, [raw], want=1, timeout=60, wait_close=5)
        (answer,) = served(outcome, [400])
        assert says in answer.body.decode() and outcome.closed, answer.body


@pytest.mark.parametrize("offer", ["h2c", "websocket"])
def test_an_answer_before_the_body_is_as_without_the_offer(server, offer):
    """A refusal given before a large body was read (415: not an npz content type) says
    ``connection: close`` and the connection closes (after its lingering read), with or without
    the offer; a small body that came whole with its headers leaves the connection to the next
    request."""
    for body, lives in ((LARGE_BODY, False), (BODY, True)):
        got = []
        for offer_headers in ([], OFFERS[offer]):
            raw = request("POST", "/tasks", body, [("Content-Type", "text/plain")] + offer_headers)
            outcome, answered_next = alive(server.port, [raw], want=1, timeout=60)
            answer = served(outcome, [415, 200] if answered_next else [415])[0]
            got.append((answered_next, answer.headers.get("connection"), json.loads(answer.body)["error"]))
        assert got[0] == got[1] and got[0][0] is lives, got


# --------------------------------------------------------------------------- curl --http2 itself


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_readmes_upload_with_curl_http2_prints_the_same_answer(server, draw0_npz, tmp_path):
    """The README's upload, with and without ``--http2``: ``10000 37724115…`` both times (and
    curl's own trace shows it offered ``Upgrade: h2c`` and got HTTP/1.1 back)."""
    got = {}
    for flags in ([], ["--http2"]):
        out = tmp_path / f"result{len(flags)}.json"
        proc = subprocess.run(["curl", *flags, "-v", "-sS", "--fail-with-body", "-H", "Content-Type: application/octet-stream",
                               "--data-binary", f"@{draw0_npz}", server.url + "/tasks", "-o", str(out),
                               "-w", "%{http_code} %{http_version}"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and proc.stdout == "200 1.1", (proc.stdout, proc.stderr[-2000:])
        offered = "> Upgrade: h2c" in proc.stderr
        assert offered == bool(flags), proc.stderr[-2000:]
        doc = json.loads(out.read_text())
        got[bool(flags)] = (len(doc["predictions"]), doc["predictions_sha256"])
    assert got[True] == got[False] == (10000, DRAW0_PREDICTIONS_SHA256)
