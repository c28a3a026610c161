"""Hostile byte streams against the service's HTTP shell, differential where it can be.

Two real servers on loopback run the same app (``create_app``, the cpu backend): one on the body
protocol ``rev88 serve`` runs (app/http/protocol.py), one on uvicorn's own httptools protocol.
The same raw bytes go to both (tests/rawhttp.py) and what comes back is compared: the statuses,
the framing (every byte belongs to exactly one well-framed response: no answer inside another),
and whether the connection lives on. Where the body protocol means to differ, the test says so
and checks its own behaviour: an answer given before its body was read closes the connection
(after a lingering read), a bad request's 400 comes after the answers pipelined before it,
uploads hold what has arrived, not what they declare.

After each case ``/health`` must show nothing stuck (no task in flight, no upload bytes held, no
reading thread busy), and the next task is answered right.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import numpy as np
import pytest

from app.http import body_reader
from app.http import protocol as body_protocol
from app.main import create_app
from app.settings import Settings
from learner.config import Config
from learner.result import run_task
from learner.taskio import task_to_npz_bytes

from .helpers import small_task
from .rawhttp import alive, chunked, exchange, parse_responses, request
from .server import inprocess_server, wait_for

pytestmark = pytest.mark.skipif(body_protocol.protocol_class() is None, reason=str(body_protocol.problem()))
stock = pytest.importorskip("uvicorn.protocols.http.httptools_impl").HttpToolsProtocol

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NPZ = {"Content-Type": "application/octet-stream", **AUTH}
MAX_BODY = 8 * 1024 * 1024
TASK = small_task(40, 5, seed=1)
BODY = task_to_npz_bytes(TASK)  # 2 kB: comes whole with its headers
LARGE = small_task(1500, 400, seed=2)
LARGE_BODY = task_to_npz_bytes(LARGE)  # 0.6 MB: read into one buffer (by a thread, on ours)
WIDE = small_task(40, 6000, seed=3)  # a large answer: 6,000 queries' scores
WIDE_BODY = task_to_npz_bytes(WIDE)
UPLOAD_TIMEOUT_S = 2.0


def _settings(tmp_path, name: str, **over) -> Settings:
    base = dict(backend="cpu", workers=1, data_dir=str(tmp_path / name), api_key=KEY, max_body_bytes=MAX_BODY,
                upload_buffer_bytes=2 * MAX_BODY, upload_timeout_s=UPLOAD_TIMEOUT_S, upload_min_rate=1 << 30,
                header_timeout_s=3.0)
    return Settings(**{**base, **over})


class Pair:
    """The two servers: ``ours`` (the body protocol) and ``stock`` (uvicorn's own)."""

    def __init__(self, ours, stock_server) -> None:
        self.ours, self.stock = ours, stock_server
        self.port = {"ours": _port(ours), "stock": _port(stock_server)}

    def both(self, parts, **kw):
        return {name: exchange(port, parts, **kw) for name, port in self.port.items()}


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    with inprocess_server(create_app(_settings(tmp, "ours")), http=body_protocol.protocol_class()) as ours, \
            inprocess_server(create_app(_settings(tmp, "stock")), http=stock) as plain:
        yield Pair(ours, plain)


def _expected(task, **config) -> str:
    return run_task(task, Config(**config) if config else Config(), "cpu").predictions_sha256


EXPECTED = {}


def expected(name: str) -> str:
    if name not in EXPECTED:
        EXPECTED[name] = _expected({"task": TASK, "large": LARGE, "wide": WIDE}[name])
    return EXPECTED[name]


def nothing_stuck(server) -> dict:
    """Until /health shows no task in flight, no upload bytes held and no reading thread busy;
    then the next task is answered right."""
    def quiet():
        doc = httpx.get(server.url + "/health", timeout=10).json()
        q, up = doc["queue"], doc["uploads"]
        return doc if (q["in_flight"] == 0 and q["running"] is None and up["held_bytes"] == 0
                       and up["in_progress"] == 0 and up["read_by_threads"] == 0) else None

    doc = wait_for(quiet, timeout=30, what="/health to show nothing stuck")
    r = httpx.post(server.url + "/tasks", content=BODY, headers=NPZ, timeout=60)
    assert r.status_code == 200 and r.json()["predictions_sha256"] == expected("task"), r.text
    return doc


def _task_answer(response) -> dict:
    assert response.status >= 200
    return json.loads(response.body)


# --------------------------------------------------------------------------- pipelining


def test_pipelined_requests_with_large_answers_read_slowly_come_back_whole_and_in_order(pair):
    big = request("POST", "/tasks?include=scores", WIDE_BODY, NPZ)
    small = request("POST", "/tasks", BODY, NPZ)
    parts = [big + small + big + request("GET", "/v2/health/live")]
    got = pair.both(parts, want=4, read_size=4096, read_pause=0.0005, rcvbuf=8192, timeout=120)
    for name, outcome in got.items():
        assert outcome.leftover == b"" and outcome.statuses == [200, 200, 200, 200], (name, outcome.statuses)
        first, second, third, live = outcome.responses
        for answer, which in ((first, "wide"), (second, "task"), (third, "wide")):
            doc = _task_answer(answer)  # a whole JSON document: nothing of another answer inside it
            assert doc["predictions_sha256"] == expected(which), name
        assert len(first.body) > 1_000_000  # (a large answer: the transport holds it while the next is made)
        assert live.body == b'{"status":"live"}'
        assert not outcome.closed
    nothing_stuck(pair.ours)


# --------------------------------------------------------------------------- declared, not sent


def test_headers_only_connections_declaring_large_bodies_lock_no_upload_out(pair):
    """Connections that declare the largest body and send two bytes hold two bytes: more of them
    than the upload budget could hold at their declared size leave every other upload its room."""
    holders = []
    try:
        for _ in range(2 * 2 + 3):  # the budget holds two bodies of the largest size: seven declare one
            for port in pair.port.values():
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                s.sendall(request("POST", "/tasks", b"PK", NPZ, length=MAX_BODY))
                holders.append(s)
        time.sleep(0.3)
        held = httpx.get(pair.ours.url + "/health", timeout=10).json()["uploads"]
        assert held["held_bytes"] < 1024 and held["in_progress"] == 7, held
        for name, port in pair.port.items():
            for body, which in ((BODY, "task"), (LARGE_BODY, "large")):
                outcome = exchange(port, [request("POST", "/tasks", body, NPZ)], want=1, timeout=60)
                assert outcome.statuses == [200], (name, outcome.responses)
                assert _task_answer(outcome.responses[0])["predictions_sha256"] == expected(which)
    finally:
        for s in holders:
            s.close()
    nothing_stuck(pair.ours)


# --------------------------------------------------------------------------- early answers


@pytest.mark.parametrize("case", ["401", "415", "422", "413"])
def test_an_answer_before_the_body_closes_the_connection_after_a_lingering_read(pair, case, monkeypatch):
    """The same status as uvicorn's own protocol gives; then, where uvicorn reads the unread body
    on (into nothing, with no limit on how long), the connection says ``connection: close``,
    reads what the client still sends only to throw it away, and closes."""
    monkeypatch.setattr(body_protocol, "LINGER_S", 1.0)
    body = LARGE_BODY * 5  # 3 MB behind the headers
    headers = {"401": {"Content-Type": "application/octet-stream"}, "415": {**AUTH, "Content-Type": "text/plain"},
               "422": NPZ, "413": NPZ}[case]
    path = "/tasks?epochs=many" if case == "422" else "/tasks"
    length = MAX_BODY + 1 if case == "413" else None
    head = request("POST", path, b"", headers, length=length if length else len(body))
    probe = request("GET", "/v2/health/live", headers=AUTH)
    parts = [head, 0.2, body, probe]
    ours = exchange(pair.port["ours"], parts, want=2, timeout=10, wait_close=4)
    plain = exchange(pair.port["stock"], parts, want=1 if case == "413" else 2, timeout=5)
    assert ours.statuses[:1] == plain.statuses[:1] == [int(case)], (ours.responses, plain.responses)
    assert ours.leftover == b"" and plain.leftover == b""
    assert ours.responses[0].headers.get("connection") == "close"
    assert ours.closed and len(ours.statuses) == 1  # nothing after the body was read as a request
    if case != "413":  # uvicorn reads the body on and answers the probe behind it
        assert plain.statuses == [int(case), 200]
    nothing_stuck(pair.ours)


def test_a_client_that_keeps_sending_after_an_early_answer_is_cut_off(pair, monkeypatch):
    monkeypatch.setattr(body_protocol, "LINGER_S", 1.0)
    port = pair.port["ours"]
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    t0 = time.monotonic()
    sock.sendall(request("POST", "/tasks", b"", {"Content-Type": "text/plain", **AUTH}, length=1 << 30))
    got, closed_at = b"", None
    try:
        while time.monotonic() - t0 < 10:
            sock.sendall(b"x" * 65536)
            time.sleep(0.02)
    except (BrokenPipeError, ConnectionResetError):
        closed_at = time.monotonic() - t0
    sock.settimeout(1)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (OSError, TimeoutError):
        pass
    sock.close()
    assert closed_at is not None and closed_at < 1.0 + 3.0, closed_at  # the lingering read has a limit
    nothing_stuck(pair.ours)


def test_expect_100_continue(pair):
    """The interim 100 when the app first reads the body, as uvicorn's; and an answer before it
    (401) closes the connection instead of waiting for a body the client will not send."""
    head = request("POST", "/tasks", b"", {**NPZ, "Expect": "100-continue"}, length=len(LARGE_BODY))
    got = pair.both([head, 0.3, LARGE_BODY], want=1, timeout=30)
    for name, outcome in got.items():
        assert [r.status for r in outcome.responses] == [100, 200], (name, outcome.responses)
        assert _task_answer(outcome.responses[1])["predictions_sha256"] == expected("large")
    unauth = request("POST", "/tasks", b"", {"Content-Type": "application/octet-stream", "Expect": "100-continue"},
                     length=len(LARGE_BODY))
    got = pair.both([unauth], want=1, timeout=10, wait_close=3)
    assert got["ours"].statuses == got["stock"].statuses == [401]
    assert got["ours"].closed  # (uvicorn's own keeps waiting, and would read a next request as this body)
    nothing_stuck(pair.ours)


# --------------------------------------------------------------------------- malformed framing


def test_junk_after_a_body_is_answered_400_after_the_request_before_it(pair):
    """uvicorn's own protocol writes its 400 at once and closes: the answer to the good request
    before the junk is lost. Here it comes first, then the 400, then the close."""
    got = pair.both([request("POST", "/tasks", BODY, NPZ) + b"NOT HTTP AT ALL\r\n\r\n"], want=2, timeout=30,
                    wait_close=3)
    ours = got["ours"]
    assert ours.statuses == [200, 400] and ours.closed and ours.leftover == b""
    assert _task_answer(ours.responses[0])["predictions_sha256"] == expected("task")
    assert got["stock"].statuses == [400] and got["stock"].closed  # (its 200 never comes)
    nothing_stuck(pair.ours)


def test_a_content_length_shorter_than_the_body(pair):
    got = pair.both([request("POST", "/tasks", BODY + b"XYZ", NPZ, length=len(BODY))], want=2, timeout=30,
                    wait_close=3)
    assert got["ours"].statuses == [200, 400] and got["ours"].closed
    assert got["stock"].statuses[-1:] == [400] and got["stock"].closed
    nothing_stuck(pair.ours)


@pytest.mark.parametrize("body", [BODY, LARGE_BODY], ids=["small", "large"])
def test_a_content_length_longer_than_the_body_times_out_408(pair, body):
    got = pair.both([request("POST", "/tasks", body, NPZ, length=len(body) + 10)], want=1,
                    timeout=UPLOAD_TIMEOUT_S + 10, wait_close=LINGER_OR_SOON)
    for name, outcome in got.items():
        assert outcome.statuses == [408] and outcome.leftover == b"", (name, outcome.responses)
        assert outcome.closed, name
    nothing_stuck(pair.ours)


LINGER_OR_SOON = body_protocol.LINGER_S + 2


def test_chunked_bodies(pair):
    for body, which in ((BODY, "task"), (LARGE_BODY, "large")):
        raw = request("POST", "/tasks", chunked(body, 7_001), {**NPZ, "Transfer-Encoding": "chunked"})
        got = pair.both([raw], want=1, timeout=60)
        for name, outcome in got.items():
            assert outcome.statuses == [200], (name, outcome.responses)
            assert _task_answer(outcome.responses[0])["predictions_sha256"] == expected(which)
    bad = request("POST", "/tasks", b"zz\r\nnot hex\r\n", {**NPZ, "Transfer-Encoding": "chunked"})
    got = pair.both([bad], want=1, timeout=30, wait_close=3)
    assert got["ours"].statuses == got["stock"].statuses == [400]
    assert got["ours"].closed and got["stock"].closed
    nothing_stuck(pair.ours)


def test_a_bad_chunk_pipelined_behind_other_requests_is_a_400_at_once(tmp_path):
    """A malformed chunked body behind a GET, two GETs, or a small upload (all in one send): its
    request never runs, and the 400 (naming the chunk) comes right after the answers before it,
    then the close. It does not wait for the upload deadline (an hour here: a body waited for would
    show as no answer at all), as it once did, answering 408 (uvicorn's own protocol answers the
    400 at once, before the answers owed)."""
    bad = request("POST", "/tasks", b"zz\r\nnot hex\r\n", {**NPZ, "Transfer-Encoding": "chunked"})
    live = request("GET", "/v2/health/live")
    settings = _settings(tmp_path, "bad-chunk", upload_timeout_s=3600.0)
    with inprocess_server(create_app(settings), http=body_protocol.protocol_class()) as server:
        for before in ([live], [live, live], [request("POST", "/tasks", BODY, NPZ)]):
            outcome = exchange(_port(server), [b"".join(before) + bad], want=len(before) + 1, timeout=60, wait_close=5)
            assert outcome.statuses == [200] * len(before) + [400], outcome.responses
            assert outcome.closed and outcome.leftover == b""
            assert b"chunk size" in outcome.responses[-1].body
            if before[0] != live:
                assert _task_answer(outcome.responses[0])["predictions_sha256"] == expected("task")
        nothing_stuck(server)


def test_http_1_0(pair):
    got = pair.both([request("POST", "/tasks", BODY, NPZ, version="1.0")], want=1, timeout=30, wait_close=3)
    for name, outcome in got.items():
        assert outcome.statuses == [200] and outcome.closed, (name, outcome.responses)
        assert _task_answer(outcome.responses[0])["predictions_sha256"] == expected("task")
    nothing_stuck(pair.ours)


# --------------------------------------------------------------------------- clients that go


def test_a_half_closed_client_is_treated_as_gone_as_by_uvicorn(pair):
    """A client that shuts its sending side after the request: asyncio's transport closes on the
    EOF (uvicorn's ``eof_received``), so the task is stopped as for a disconnect, on both."""
    got = pair.both([request("POST", "/tasks", LARGE_BODY, NPZ)], want=1, timeout=30, shut_wr=True)
    assert got["ours"].statuses == got["stock"].statuses == []
    assert got["ours"].closed and got["stock"].closed
    nothing_stuck(pair.ours)


@pytest.mark.parametrize("sent", [0.1, 0.5, 0.95])
def test_clients_that_vanish_mid_body_leave_nothing_behind(pair, sent):
    for body in (BODY, LARGE_BODY, LARGE_BODY * 8):
        cut = request("POST", "/tasks", body, NPZ)[: int(len(body) * sent)]
        got = pair.both([cut, 0.1], want=1, timeout=0.3)
        assert got["ours"].statuses == got["stock"].statuses == []
    nothing_stuck(pair.ours)


def test_a_connection_that_never_finishes_its_headers_is_closed(pair):
    outcome = exchange(pair.port["ours"], [b"POST /tasks HTTP/1.1\r\nHost: x\r\n"], want=1, timeout=8)
    assert outcome.closed and outcome.statuses == []  # (uvicorn's own waits for ever)


# --------------------------------------------------------------------------- the upload budget


def test_a_full_upload_budget_refuses_what_arrives_beyond_it_and_closes(tmp_path, monkeypatch):
    """Uploads hold what has arrived: with one body's room (the budget) nearly taken by a slow
    upload, a second large one is refused 503 (naming REV88_UPLOAD_BUFFER_BYTES) once its bytes
    do not fit, its connection closed; the slow one, and everything after, is answered right."""
    monkeypatch.setattr(body_protocol, "LINGER_S", 1.0)
    settings = _settings(tmp_path, "budget", max_body_bytes=2 * 1024 * 1024, upload_buffer_bytes=2 * 1024 * 1024,
                         upload_timeout_s=30.0)
    big = task_to_npz_bytes(small_task(4000, 10, seed=9))  # 1.3 MB
    assert len(big) < 2 * 1024 * 1024 < 2 * len(big)
    with inprocess_server(create_app(settings), http=body_protocol.protocol_class()) as server:
        port = _port(server)
        slow = socket.create_connection(("127.0.0.1", port), timeout=30)
        first = request("POST", "/tasks", big, NPZ)
        slow.sendall(first[: len(first) - 1000])
        wait_for(lambda: httpx.get(server.url + "/health").json()["uploads"]["held_bytes"] > len(big) - 70_000,
                 timeout=10, what="the slow upload's bytes held")
        outcome = exchange(port, [request("POST", "/tasks", big, NPZ)], want=1, timeout=30, wait_close=4)
        assert outcome.statuses == [503] and outcome.closed, outcome.responses
        assert "REV88_UPLOAD_BUFFER_BYTES" in json.loads(outcome.responses[0].body)["error"]
        assert outcome.responses[0].headers.get("retry-after")
        slow.sendall(first[len(first) - 1000 :])
        data = b""
        while not parse_responses(data)[0]:
            chunk = slow.recv(65536)
            assert chunk
            data += chunk
        (answer,), _ = parse_responses(data)
        assert answer.status == 200
        assert json.loads(answer.body)["predictions_sha256"] == run_task(small_task(4000, 10, seed=9), Config(),
                                                                         "cpu").predictions_sha256
        slow.close()
        nothing_stuck(server)
        assert body_reader.busy() == 0


def test_the_next_request_after_every_case_is_answered(pair):
    """(the server as a whole, after the cases above: live, and a task right on both)"""
    for server in (pair.ours, pair.stock):
        outcome, lives = alive(_port(server), [request("POST", "/tasks", BODY, NPZ)], want=1, timeout=60)
        assert lives and outcome.statuses == [200, 200]
        assert _task_answer(outcome.responses[0])["predictions_sha256"] == expected("task")
    assert np.isfinite(nothing_stuck(pair.ours)["uptime_s"])
