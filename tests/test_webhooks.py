"""Signed webhooks (issue #34): real servers, real receivers, the reference verifier.

Every receiver listens on a loopback address (tests/receivers.py): 127.0.0.2 stands for a public
target (``REV88_WEBHOOK_ALLOW_CIDRS=127.0.0.2/32``), 127.0.0.3 and ``localhost`` for refused
ones. Nothing here sends traffic outside 127.0.0.0/8. Signatures are checked with PyPI's
``standardwebhooks`` (the specification's own library) as well as ``rev88.webhooks.verify``.
"""

from __future__ import annotations

import datetime
import json
import signal
import socket
import time

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from app.main import create_app
from app.settings import Settings, SettingsError
from app.webhooks import targets
from learner.taskio import task_to_npz_bytes
from rev88.webhooks import WebhookVerificationError, verify

from . import pg
from .gates import FileGate, Gate, gated_engines
from .helpers import small_task
from .receivers import Receiver
from .server import inprocess_server, post_task, wait_for

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)

BODY = task_to_npz_bytes(small_task(40, 6, seed=44))
ASYNC = {"Prefer": "respond-async"}
FAST = dict(webhook_allow_cidrs="127.0.0.2/32", webhook_retry_schedule=(0.0, 0.2, 0.2, 0.2), webhook_poll_s=0.1)
FINISHED = ("succeeded", "failed", "cancelled")
ADMIN_KEY = "admin-key-for-webhook-tests"


def serve(**settings):
    base = dict(backend="cpu", workers=1, **FAST)
    base.update(settings)
    return inprocess_server(create_app(Settings(**base)))


def submit(c: httpx.Client, url: str, events: str | None = None, headers=None, **params) -> str:
    query = {"webhook": url, **({"webhook_events": events} if events else {}), **params}
    r = post_task(c, BODY, params=query, headers={**ASYNC, **(headers or {})})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def log_of(c: httpx.Client, task_id: str, headers=None) -> dict:
    r = c.get(f"/tasks/{task_id}/deliveries", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def settled(c: httpx.Client, path: str, count: int = 1, timeout: float = 60, headers=None) -> list[dict]:
    """The first ``count`` messages of a delivery log once none is waiting or pending."""
    def done():
        messages = c.get(path, headers=headers).json()["messages"]
        return messages if len(messages) >= count and all(
            m["state"] not in ("waiting", "pending") for m in messages) else None

    return wait_for(done, timeout, 0.05, f"the deliveries of {path}")


def task_doc(c: httpx.Client, task_id: str, headers=None) -> dict:
    return wait_for(lambda: (d := c.get(f"/tasks/{task_id}", headers=headers).json())["status"] in FINISHED and d,
                    60, 0.05, f"task {task_id}")


# --------------------------------------------------------------------------- signatures, bodies


def test_a_task_webhook_verifies_with_the_reference_library(store):
    with Receiver() as r, serve(**store) as server, server.client() as c:
        secret = c.get("/webhooks/secret").json()["key"]
        assert secret.startswith("whsec_") and c.get("/webhooks/secret").json()["key"] == secret  # made once
        task_id = submit(c, r.url, "started,completed")
        doc = task_doc(c, task_id)
        got = r.wait_for(2)
        bodies = {}
        for q in got:
            payload = Webhook(secret).verify(q.body, q.headers)  # the reference library
            assert verify(q.headers, q.body, secret) == payload  # and ours
            assert q.headers["content-type"] == "application/json" and q.path == "/hook"
            bodies[payload["type"]] = payload
            assert payload["data"]["id"] == task_id and len(q.body) < 2000  # thin: no predictions
            assert "predictions" not in payload["data"] and "scores" not in payload["data"]
        assert set(bodies) == {"task.started", "task.succeeded"}
        done = bodies["task.succeeded"]["data"]
        assert done["status"] == "succeeded" and done["predictions_sha256"] == doc["predictions_sha256"]
        listed = c.get("/tasks").json()["tasks"][0]  # (the list's summary has the ledger's run_ms column)
        assert done["links"]["self"] == f"/tasks/{task_id}" and done["timing"]["run_ms"] == listed["run_ms"]
        assert bodies["task.started"]["data"]["status"] == "running"
        assert len({q.headers["webhook-id"] for q in got}) == 2  # one id per message
        messages = settled(c, f"/tasks/{task_id}/deliveries", 2)
        assert {m["state"] for m in messages} == {"delivered"}
        assert all(m["attempts"][0]["status_code"] == 204 and m["attempts"][0]["address"] == "127.0.0.2"
                   for m in messages)
        metrics = c.get("/metrics").text
        assert 'rev88_webhook_deliveries_total{outcome="delivered"} 2.0' in metrics
        assert "rev88_webhook_oldest_pending_seconds" in metrics


def test_our_verifier_refuses_what_was_not_signed():
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    from app.webhooks.signing import headers as sign

    body = b'{"type":"task.succeeded"}'
    now = int(time.time())
    h = sign([secret], "msg_1", now, body)
    assert verify(h, body, secret) == {"type": "task.succeeded"}
    Webhook(secret).verify(body, h)
    for bad_headers, bad_body, match in (
            (h, body + b" ", "no v1 signature"),
            ({**h, "webhook-id": "msg_2"}, body, "no v1 signature"),
            (sign([secret], "msg_1", now - 600, body), body, "from now"),
            ({k: v for k, v in h.items() if k != "webhook-signature"}, body, "webhook-signature header is missing"),
            ({**h, "webhook-timestamp": "soon"}, body, "not whole seconds")):
        with pytest.raises(WebhookVerificationError, match=match):
            verify(bad_headers, bad_body, secret)
    with pytest.raises(WebhookVerificationError, match="no v1 signature"):
        verify(h, body, "whsec_" + "A" * 32)
    assert verify(h, body, ["whsec_" + "A" * 32, secret])  # a list: either may have signed it


SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the Standard Webhooks specification's example
OTHER_SECRET = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="  # base64 of bytes 0..31


@pytest.mark.parametrize("secrets_, message_id, timestamp, body, signature", [
    # the specification's own example (https://www.standardwebhooks.com)
    ([SPEC_SECRET], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}',
     "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="),
    # two secrets (a rotation's overlap), a body with UTF-8 and a byte that is not UTF-8: the
    # header app/webhooks/signing.py wrote by hand before it used standardwebhooks (commit 9020c3e)
    ([SPEC_SECRET, OTHER_SECRET], "msg_2", 1797000000, '{"type":"task.succeeded","name":"Zürich ✓"}'.encode() + b"\xff",
     "v1,oQ4UXCgT2XfEwcWpnTBQsrdtIqs1EUgsXem+FTLf6zc= v1,5QIYo4sQ7kiYVIDyfjJcUw2ni27dlTEB7fvFfvkXeiM="),
])
def test_signatures_are_the_same_bytes_as_before(secrets_, message_id, timestamp, body, signature):
    from app.webhooks.signing import headers as sign

    assert sign(secrets_, message_id, timestamp, body) == {
        "webhook-id": message_id, "webhook-timestamp": str(timestamp), "webhook-signature": signature}


def test_our_verifier_and_the_reference_library_agree_both_ways():
    """standardwebhooks signs, rev88.webhooks.verify (standard library only) accepts; the service
    signs (with standardwebhooks), the library's verify accepts; a change to the id, the
    timestamp or one byte of the body is refused by both."""
    import random

    from standardwebhooks.webhooks import WebhookVerificationError as ReferenceError_

    from app.webhooks.signing import headers as sign
    from app.webhooks.signing import new_secret

    rng = random.Random(45)
    now = int(time.time())
    for i in range(40):
        secret = new_secret() if i % 2 else SPEC_SECRET
        doc = {"n": i, "text": "".join(rng.choice("aé✓\\\" ") for _ in range(rng.randrange(0, 300)))}
        body = json.dumps(doc, ensure_ascii=False).encode()
        message_id, stamp = f"msg_{rng.getrandbits(64):x}", now - rng.randrange(0, 200)
        when = datetime.datetime.fromtimestamp(stamp, tz=datetime.UTC)
        theirs = {"webhook-id": message_id, "webhook-timestamp": str(stamp),
                  "webhook-signature": Webhook(secret).sign(message_id, when, body)}
        ours = sign([secret], message_id, stamp, body)
        assert ours == theirs
        assert verify(theirs, body, secret) == doc
        assert Webhook(secret).verify(body, ours) == verify(ours, body, secret)
        flipped = bytearray(body)
        flipped[rng.randrange(len(body))] ^= 0x01
        for bad_headers, bad_body in (({**ours, "webhook-id": message_id + "x"}, body),
                                      ({**ours, "webhook-timestamp": str(stamp - 1)}, body),
                                      (ours, bytes(flipped))):
            with pytest.raises(WebhookVerificationError):
                verify(bad_headers, bad_body, secret)
            with pytest.raises(ReferenceError_):
                Webhook(secret).verify(bad_body, bad_headers)
    # a body that is not UTF-8 (or not JSON) is signed byte for byte; both check the signature
    body = b"\xff\xfe not json"
    h = sign([SPEC_SECRET], "msg_raw", now, body)
    Webhook(SPEC_SECRET).verify(body, h, json_parse=False)
    with pytest.raises(WebhookVerificationError, match="signed but is not JSON"):  # the signature matched
        verify(h, body, SPEC_SECRET)


def test_our_verifier_needs_only_the_standard_library():
    """rev88/webhooks.py, loaded on its own by a Python without site-packages (-S -I: no
    standardwebhooks, no httpx, not even the rev88 package), verifies a message the service signed."""
    import subprocess
    import sys
    from pathlib import Path

    from app.webhooks.signing import headers as sign

    body = b'{"type":"task.succeeded"}'
    h = sign([SPEC_SECRET], "msg_alone", int(time.time()), body)
    path = Path(__file__).resolve().parents[1] / "rev88" / "webhooks.py"
    code = ("import importlib.util, json, sys\n"
            f"spec = importlib.util.spec_from_file_location('alone', {str(path)!r})\n"
            "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
            f"print(json.dumps(mod.verify({h!r}, {body!r}, {SPEC_SECRET!r})))\n"
            "assert 'standardwebhooks' not in sys.modules and 'httpx' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-S", "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"type": "task.succeeded"}


def test_a_rotated_secret_signs_beside_the_new_one_during_the_overlap():
    with Receiver() as r, serve() as server, server.client() as c:
        old = c.get("/webhooks/secret").json()["key"]
        rotated = c.post("/webhooks/secret/rotate").json()
        new = rotated["key"]
        assert new != old and rotated["previous_valid_until"] > time.time() + 3600
        submit(c, r.url)
        q = r.wait_for(1)[0]
        assert len(q.headers["webhook-signature"].split()) == 2
        for secret in (old, new):
            Webhook(secret).verify(q.body, q.headers)
            verify(q.headers, q.body, secret)


# --------------------------------------------------------------------------- retries


def test_retries_keep_one_id_and_one_body_then_deliver():
    with Receiver(plan=[500, "drop", (302, {"Location": "http://127.0.0.2:9/elsewhere"}), 204]) as r, serve() as server, \
            server.client() as c:
        task_id = submit(c, r.url)
        got = r.wait_for(4)
        assert len({q.headers["webhook-id"] for q in got}) == 1 and len({q.body for q in got}) == 1
        assert all(q.path == "/hook" for q in got)  # the 302 was not followed
        [m] = settled(c, f"/tasks/{task_id}/deliveries")
        assert m["state"] == "delivered" and m["attempt_count"] == 4 and m["id"] == got[0].headers["webhook-id"]
        outcomes = [(a["outcome"], a["status_code"]) for a in m["attempts"]]
        assert outcomes == [("retry", 500), ("retry", None), ("retry", 302), ("delivered", 204)]
        assert "answered 500" in m["attempts"][0]["error"] and m["attempts"][1]["error"]  # the connection's error
        assert "redirects are not followed" in m["attempts"][2]["error"]
        assert all(a["next_at"] is not None for a in m["attempts"][:3])


def test_a_schedule_that_runs_out_fails_and_a_redelivery_starts_it_again():
    with Receiver(plan=[503, 503, 503, 204]) as r, serve(webhook_retry_schedule=(0.0, 0.1, 0.1)) as server, \
            server.client() as c:
        task_id = submit(c, r.url)
        [m] = settled(c, f"/tasks/{task_id}/deliveries")
        assert m["state"] == "failed" and m["attempt_count"] == 3 and "every attempt" in m["next"]
        assert len(r.requests) == 3
        again = c.post(f"/tasks/{task_id}/deliveries/redeliver")
        assert again.status_code == 202 and again.json() == {"redelivered": [m["id"]]}
        got = r.wait_for(4)
        assert got[3].headers["webhook-id"] == m["id"] and got[3].body == got[0].body
        [m] = settled(c, f"/tasks/{task_id}/deliveries")
        assert m["state"] == "delivered" and [a["n"] for a in m["attempts"]] == [1, 2, 3, 4]


def test_retry_after_of_a_429_is_honoured():
    with Receiver(plan=[(429, {"Retry-After": "1"}), 204]) as r, \
            serve(webhook_retry_schedule=(0.0, 0.05)) as server, server.client() as c:
        submit(c, r.url)
        first, second = r.wait_for(2)
        assert second.at - first.at >= 0.95  # not the schedule's 0.05 s


def test_an_attempt_that_hangs_times_out_and_is_retried():
    with Receiver(plan=["hang", 204]) as r, serve(webhook_timeout_s=0.5) as server, server.client() as c:
        task_id = submit(c, r.url)
        first, second = r.wait_for(2)
        assert first.headers["webhook-id"] == second.headers["webhook-id"]
        [m] = settled(c, f"/tasks/{task_id}/deliveries")
        assert "timed out after 0.5 s" in m["attempts"][0]["error"] and m["state"] == "delivered"


def test_at_most_64_kib_of_an_answer_is_read():
    """A receiver that answers 200 and then streams without end: the attempt reads 64 KiB,
    hangs up and is delivered, well within its timeout (not timed out)."""
    with Receiver(plan=["endless"]) as r, serve(webhook_timeout_s=10) as server, server.client() as c:
        task_id = submit(c, r.url)
        [m] = settled(c, f"/tasks/{task_id}/deliveries")
        [attempt] = m["attempts"]
        assert m["state"] == "delivered" and attempt["status_code"] == 200 and attempt["error"] is None
        assert attempt["duration_ms"] < 5000
        wait_for(lambda: r.endless_sent, 30, 0.05, "the receiver to notice the hang-up")
        print(f"the receiver got {r.endless_sent[0] / 1024:.0f} KiB out (socket buffers included) before the hang-up")


def test_410_stops_deliveries_to_that_url_for_that_tenant(store):
    with Receiver(plan=[410, 204]) as r, serve(**store) as server, server.client() as c:
        first = submit(c, r.url)
        [m] = settled(c, f"/tasks/{first}/deliveries")
        assert m["state"] == "stopped" and m["attempts"][0]["status_code"] == 410
        assert [s["url"] for s in c.get("/webhooks/stopped").json()["stopped"]] == [r.url]
        second = submit(c, r.url)
        [m2] = settled(c, f"/tasks/{second}/deliveries")
        assert m2["state"] == "stopped" and m2["attempts"][0]["status_code"] is None
        assert "410 Gone" in m2["attempts"][0]["error"] and len(r.requests) == 1  # nothing sent
        assert c.delete("/webhooks/stopped", params={"url": r.url}).status_code == 204
        assert c.delete("/webhooks/stopped", params={"url": r.url}).status_code == 404
        third = submit(c, r.url)
        [m3] = settled(c, f"/tasks/{third}/deliveries")
        assert m3["state"] == "delivered" and len(r.requests) == 2


# --------------------------------------------------------------------------- the SSRF guard


def test_refused_targets_are_a_422_naming_webhook_and_get_nothing():
    with Receiver("127.0.0.3") as refused, Receiver("127.0.0.1") as local, serve() as server, server.client() as c:
        port = refused.port
        for url in (refused.url, f"http://localhost:{local.port}/hook", f"http://[::ffff:127.0.0.3]:{port}/",
                    f"http://[::1]:{port}/", f"http://0.0.0.0:{port}/", "http://10.0.0.1/", "http://169.254.169.254/",
                    "http://100.64.0.1/", "ftp://127.0.0.2/", "http://user:pw@127.0.0.2/", "http://127.0.0.2/#x",
                    "javascript:alert(1)", f"http://2130706435:{port}/"):  # (127.0.0.3 as one number)
            r = post_task(c, BODY, params={"webhook": url}, headers=ASYNC)
            assert r.status_code == 422 and r.json()["field"] == "webhook", (url, r.text)
        bad_events = post_task(c, BODY, params={"webhook": "http://127.0.0.2:1/", "webhook_events": "finished"})
        assert bad_events.status_code == 422 and bad_events.json()["field"] == "webhook_events"
        events_only = post_task(c, BODY, params={"webhook_events": "completed"})
        assert events_only.status_code == 422 and events_only.json()["field"] == "webhook_events"
        for path, body in (("/sweeps", {"dataset": "sha256:" + "0" * 64}), ("/evaluations", {"draws": "0"})):
            r = c.post(path, json={**body, "webhook": refused.url})
            assert r.status_code == 422 and r.json()["field"] == "webhook", r.text
            r = c.post(path, json={**body, "webhook": "http://127.0.0.2:1/", "webhook_events": ["started"]})
            assert r.status_code == 422 and r.json()["field"] == "webhook_events", r.text
        assert c.get("/tasks").json()["tasks"] == []  # nothing recorded
        time.sleep(0.5)
        assert refused.requests == [] and local.requests == []


def test_a_name_that_resolves_elsewhere_at_the_attempt_is_not_sent(monkeypatch):
    """The host is resolved again before each attempt and the request goes to the address checked
    then: a name that pointed at an allowed address at submission and at a refused one later
    (DNS rebinding) gets nothing."""
    answers = {"now": "127.0.0.2"}
    real = socket.getaddrinfo

    def fake(host, port, *args, **kw):
        if host == "hooks.example.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers["now"], port))]
        return real(host, port, *args, **kw)

    monkeypatch.setattr(targets.socket, "getaddrinfo", fake)
    with Receiver("127.0.0.2", plan=[204]) as allowed, Receiver("127.0.0.3") as refused, \
            serve(webhook_retry_schedule=(0.3, 0.2)) as server, server.client() as c:
        assert allowed.port != refused.port or True
        url = f"http://hooks.example.test:{allowed.port}/hook"
        gate = c.get("/webhooks/secret")  # (the secret exists before the first attempt)
        assert gate.status_code == 200
        task_id = submit(c, url)
        answers["now"] = "127.0.0.3"  # the name moves before the first attempt (0.3 s after the event)
        [m] = settled(c, f"/tasks/{task_id}/deliveries")
        assert m["state"] == "failed" and all("not sent" in a["error"] and "127.0.0.3" in a["error"]
                                              for a in m["attempts"])
        assert allowed.requests == [] and refused.requests == []


def test_the_address_rules():
    allow = targets.parse_allow("127.0.0.2/32, 2001:db8::/64")
    for ok in ("127.0.0.2", "8.8.8.8", "2606:4700::1111", "2001:db8::5"):
        targets.check_address(ok, allow)
    for bad in ("127.0.0.1", "127.0.0.3", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
                "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1", "::ffff:10.0.0.1",
                "::ffff:127.0.0.2", "64:ff9b::a00:1", "2002:a00:1::", "192.0.2.1", "198.18.0.1", "240.0.0.1"):
        with pytest.raises(targets.TargetRefused):
            targets.check_address(bad, allow)
    with pytest.raises(ValueError, match="REV88_WEBHOOK_ALLOW_CIDRS"):
        targets.parse_allow("10.0.0.0/33")


def test_bad_webhook_settings_stop_startup_naming_the_variable():
    for env, name in (({"REV88_WEBHOOK_RETRY_SCHEDULE": "0,x"}, "REV88_WEBHOOK_RETRY_SCHEDULE"),
                      ({"REV88_WEBHOOK_RETRY_SCHEDULE": "0,-5"}, "REV88_WEBHOOK_RETRY_SCHEDULE"),
                      ({"REV88_WEBHOOK_ALLOW_CIDRS": "10.0.0.0/8,nope"}, "REV88_WEBHOOK_ALLOW_CIDRS"),
                      ({"REV88_WEBHOOK_TIMEOUT_S": "0"}, "REV88_WEBHOOK_TIMEOUT_S"),
                      ({"REV88_WEBHOOK_CONCURRENCY": "0"}, "REV88_WEBHOOK_CONCURRENCY")):
        with pytest.raises(SettingsError, match=name):
            Settings.from_env(env)
    assert Settings.from_env({"REV88_WEBHOOK_RETRY_SCHEDULE": "0, 1,2.5"}).webhook_retry_schedule == (0, 1, 2.5)


# --------------------------------------------------------------------------- other subjects, tenants


def test_a_synchronous_task_sweeps_and_evaluations_send_their_completion(store):
    with Receiver() as r, serve(**store) as server, server.client() as c:
        secret = c.get("/webhooks/secret").json()["key"]
        sync = post_task(c, BODY, params={"webhook": r.url})
        assert sync.status_code == 200, sync.text
        sync_id = sync.json()["id"]
        assert c.get(f"/tasks/{sync_id}").json()["status"] == "succeeded"  # recorded, not deferred
        put = c.post("/datasets", content=BODY, headers={"content-type": "application/octet-stream"})
        assert put.status_code in (200, 201), put.text
        digest = put.json()["digest"]
        on_dataset = c.post("/tasks", params={"dataset": digest, "webhook": r.url, "webhook_events": "started,completed"})
        assert on_dataset.status_code == 200, on_dataset.text
        on_dataset_id = on_dataset.json()["id"]
        assert c.get(f"/tasks/{on_dataset_id}").json()["status"] == "succeeded"  # recorded, not deferred
        sweep = c.post("/sweeps", json={"dataset": digest, "grid": {"epochs": [1, 2]}, "webhook": r.url,
                                        "webhook_events": "completed"})
        assert sweep.status_code == 202, sweep.text
        sweep_id = sweep.json()["id"]
        [m] = settled(c, f"/sweeps/{sweep_id}/deliveries")
        assert m["state"] == "delivered" and m["type"] == "sweep.completed"
        messages = settled(c, f"/tasks/{on_dataset_id}/deliveries", count=2)
        assert sorted(m["type"] for m in messages) == ["task.started", "task.succeeded"], messages
        assert {m["state"] for m in messages} == {"delivered"}, messages
        by_type = {}
        for q in r.wait_for(4):
            payload = Webhook(secret).verify(q.body, q.headers)
            by_type.setdefault(payload["type"], []).append(payload["data"])
        assert sorted(t["id"] for t in by_type["task.succeeded"]) == sorted([sync_id, on_dataset_id])
        assert [t["id"] for t in by_type["task.started"]] == [on_dataset_id]
        [completed] = by_type["sweep.completed"]
        assert completed["id"] == sweep_id and completed["counts"]["succeeded"] == 2
        assert c.post(f"/sweeps/{sweep_id}/deliveries/redeliver").status_code == 202
        assert r.wait_for(5)[4].headers["webhook-id"] == m["id"]
        # a task without a webhook: an empty log, and nothing to redeliver
        plain = post_task(c, BODY, headers=ASYNC).json()["id"]
        assert log_of(c, plain)["messages"] == []
        nothing = c.post(f"/tasks/{plain}/deliveries/redeliver")
        assert nothing.status_code == 409 and "without a webhook" in nothing.json()["error"]
        assert c.get("/tasks/nope/deliveries").status_code == 404
        assert c.get("/sweeps/sw-nope/deliveries").status_code == 404


def test_an_evaluation_sends_evaluation_completed(tmp_path):
    with Receiver() as r, serve(data_dir=str(tmp_path / "data")) as server, server.client() as c:
        secret = c.get("/webhooks/secret").json()["key"]
        ev = c.post("/evaluations", json={"draws": "2", "config": {"epochs": 1}, "webhook": r.url})
        assert ev.status_code == 202, ev.text
        ev_id = ev.json()["id"]
        [m] = settled(c, f"/evaluations/{ev_id}/deliveries", timeout=180)
        assert m["state"] == "delivered" and m["type"] == "evaluation.completed"
        data = Webhook(secret).verify(r.wait_for(1)[0].body, r.requests[0].headers)["data"]
        doc = c.get(f"/evaluations/{ev_id}").json()
        assert data["id"] == ev_id and data["status"] == doc["status"] and data["correct"] == doc["totals"]["correct"]


def test_tenants_have_their_own_secrets_and_see_only_their_own_deliveries():
    with Receiver() as r, serve(api_key=ADMIN_KEY) as server, server.client() as c:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

        def key(name, **body):
            return {"Authorization": "Bearer " + c.post("/keys", json={"name": name, **body}, headers=admin).json()["key"]}

        alice, bob, reader = key("alice"), key("bob"), key("reader", scopes=["read"])
        sa = c.get("/webhooks/secret", headers=alice).json()["key"]
        sb = c.get("/webhooks/secret", headers=bob).json()["key"]
        assert sa != sb
        refused = c.get("/webhooks/secret", headers=reader)
        assert refused.status_code == 403 and "write scope" in refused.json()["error"]
        task_id = submit(c, r.url, headers=alice)
        q = r.wait_for(1)[0]
        Webhook(sa).verify(q.body, q.headers)
        with pytest.raises(WebhookVerificationError):
            verify(q.headers, q.body, sb)
        assert c.get(f"/tasks/{task_id}/deliveries", headers=bob).status_code == 404
        assert c.post(f"/tasks/{task_id}/deliveries/redeliver", headers=bob).status_code == 404
        assert c.get(f"/tasks/{task_id}/deliveries", headers=admin).status_code == 200
        settled(c, f"/tasks/{task_id}/deliveries", headers=alice)


def test_a_started_event_of_a_task_cancelled_before_it_ran_is_skipped():
    gate = Gate()
    app = create_app(Settings(backend="cpu", workers=1, **FAST), engines=gated_engines(gate))
    try:
        with Receiver() as r, inprocess_server(app) as server, server.client() as c:
            gate.hold()  # (after the warm-up) the first task runs and waits; the second waits in the queue
            first = submit(c, r.url, "started,completed")
            second = submit(c, r.url, "started,completed")
            wait_for(lambda: c.get(f"/tasks/{first}").json()["status"] == "running", 30, 0.05, "first running")
            assert c.post(f"/tasks/{second}/cancel").status_code == 200
            gate.release()
            task_doc(c, first)
            messages = settled(c, f"/tasks/{second}/deliveries", 2)
            by_event = {m["event"]: m for m in messages}
            assert by_event["started"]["state"] == "skipped" and "without starting" in by_event["started"]["last_error"]
            assert by_event["completed"]["type"] == "task.cancelled" and by_event["completed"]["state"] == "delivered"
    finally:
        gate.release()


# --------------------------------------------------------------------------- replicas


def test_kill_9_after_completion_another_replica_delivers_the_same_message(tmp_path, pg_url):
    """Replica a records the task's end and starts the delivery; the receiver holds that request;
    a is killed (SIGKILL). Replica b, on the same ledger, claims the message once a's lease on it
    has expired and delivers it: the same webhook-id, the same body, signed with the same secret."""
    from .test_replicas import replica

    gate = FileGate(tmp_path / "hold")
    env = {"REV88_WEBHOOK_ALLOW_CIDRS": "127.0.0.2/32", "REV88_WEBHOOK_TIMEOUT_S": "2",
           "REV88_WEBHOOK_POLL_S": "0.2", "REV88_WEBHOOK_RETRY_SCHEDULE": "0,0.2,0.2"}
    with Receiver(plan=["hang", 204]) as r:
        with replica(tmp_path, pg_url, gate, "a", **env) as a, a.client() as ca:
            secret = ca.get("/webhooks/secret").json()["key"]
            task_id = submit(ca, r.url)
            held = r.wait_for(1)[0]  # a's attempt, never answered
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait()
        t_killed = time.monotonic()
        with replica(tmp_path, pg_url, gate, "b", **env) as b, b.client() as cb:
            assert cb.get(f"/tasks/{task_id}").json()["status"] == "succeeded"
            second = r.wait_for(2, timeout=60)[1]
            waited = time.monotonic() - t_killed
            assert second.headers["webhook-id"] == held.headers["webhook-id"] and second.body == held.body
            Webhook(secret).verify(second.body, second.headers)
            [m] = settled(cb, f"/tasks/{task_id}/deliveries")
            assert m["state"] == "delivered" and [a_["outcome"] for a_ in m["attempts"]] == ["delivered"]
            assert cb.get("/webhooks/secret").json()["key"] == secret
            time.sleep(1.0)
            assert len(r.requests) == 2  # delivered once; nothing more
            print(f"delivered by the other replica {waited:.1f} s after the kill (lease: timeout 2 s + 10 s)")


def test_the_client_and_rev88_submit_ask_for_webhooks(tmp_path, capsys):
    from rev88 import Client
    from rev88.cli import main as rev88

    task_file = tmp_path / "task.npz"
    task_file.write_bytes(BODY)
    with Receiver() as r, serve() as server, Client(server.url) as client:
        secret = client.webhook_secret()["key"]
        task_id = client.submit(BODY, webhook=r.url, webhook_events=["started", "completed"])
        client.wait(task_id)
        types = sorted(verify(q.headers, q.body, secret)["type"] for q in r.wait_for(2))
        assert types == ["task.started", "task.succeeded"]
        log = wait_for(lambda: (d := client.deliveries(task_id)) and all(
            m["state"] == "delivered" for m in d["messages"]) and d, 30, 0.05, "delivered")
        assert len(log["messages"]) == 2 and sorted(client.redeliver(task_id)) == sorted(m["id"] for m in log["messages"])
        assert rev88(["submit", str(task_file), "--url", server.url, "--async", "--webhook", r.url]) == 0
        cli_id = capsys.readouterr().out.strip().splitlines()[-1]
        wait_for(lambda: any(verify(q.headers, q.body, secret)["data"]["id"] == cli_id for q in r.requests),
                 30, 0.05, "the CLI task's webhook")
        assert rev88(["submit", str(task_file), "--url", server.url, "--async", "--webhook",
                      "http://127.0.0.3/hook"]) == 2
        assert "only public addresses" in capsys.readouterr().err
        rotated = client.rotate_webhook_secret()
        assert rotated["key"] != secret and rotated["previous_valid_until"] is not None


def test_the_async_client_reads_the_secret_and_the_log():
    import asyncio

    from rev88 import AsyncClient

    with Receiver() as r, serve() as server:
        async def go():
            async with AsyncClient(server.url) as client:
                secret = (await client.webhook_secret())["key"]
                task_id = await client.submit(BODY, webhook=r.url)
                await client.wait(task_id)
                verify(r.wait_for(1)[0].headers, r.requests[0].body, secret)
                for _ in range(200):
                    log = await client.deliveries(task_id)
                    if log["messages"][0]["state"] == "delivered":
                        break
                    await asyncio.sleep(0.05)
                assert log["messages"][0]["state"] == "delivered"
                assert await client.redeliver(task_id) == [log["messages"][0]["id"]]
                assert (await client.rotate_webhook_secret())["key"] != secret

        asyncio.run(go())


def test_the_outbox_keeps_one_schema_and_filters_by_tenant_in_the_store(tmp_path):
    """Each engine's migration is the outbox's own table text (no drift between the engines'
    copies); a tenant's read or redelivery of a subject's messages is filtered in the SQL."""
    from app.ledger.outbox import POSTGRES_SCHEMA, SQLITE_SCHEMA, open_outbox
    from app.ledger.postgres import MIGRATIONS_DIR
    from app.ledger.store import Ledger

    migration = (MIGRATIONS_DIR / "0005_webhooks.sql").read_text()
    assert migration.split("\n", 1)[1] == POSTGRES_SCHEMA.lstrip()
    sqlite_migration = (MIGRATIONS_DIR / "sqlite" / "0003_webhooks.sql").read_text()
    assert sqlite_migration.split("\n", 2)[2] == SQLITE_SCHEMA.lstrip()
    ledger = Ledger(tmp_path / "data")
    outbox = open_outbox(ledger)
    hook = {"url": "http://127.0.0.2:9/hook", "events": ["completed"]}
    record, _ = ledger.create(task_id="t1", kind="task", mode="async", backend="cpu", config={},
                              options={"owner": "alice", "webhook": hook}, train_count=1, test_count=1,
                              body_sha256="0" * 64, body_bytes=1, body=b"x")
    [(message, _)] = outbox.messages_of("t1", "alice")
    assert message.owner == "alice" and message.state == "waiting"
    assert outbox.messages_of("t1", "bob") == [] and len(outbox.messages_of("t1")) == 1
    assert outbox.promote_many([(message.id, "task.succeeded", b"{}", 0.0)]) == 1
    assert outbox.redeliver("t1", "bob") == [] and outbox.redeliver("t1", "alice") == [message.id]
    ledger.close()


def test_many_subjects_at_once_each_get_their_own_message_through_few_delivery_slots(store):
    """Three sweeps finishing in one launch (their completions promoted in one round) and six tasks'
    webhooks, through two delivery slots: every message is delivered, each sweep's body is its own
    sweep's (its id and counts) and each task's its own task's (its predictions' hash)."""
    gate = Gate()
    settings = dict(backend="cpu-fast", workers=1, batch_max=8, batch_wait_ms=100, queue_size=32,
                    webhook_concurrency=2, **FAST, **store)
    with Receiver() as r, inprocess_server(create_app(Settings(**settings),
                                                      engines=gated_engines(gate, batching=True))) as server, \
            server.client() as c:
        secret = c.get("/webhooks/secret").json()["key"]
        put = c.post("/datasets", content=BODY, headers={"content-type": "application/octet-stream"})
        digest = put.json()["digest"]
        gate.hold()
        try:
            _device_held(c)
            sweeps = {}
            for seeds in ([1], [2, 3], [4, 5, 6]):
                s = c.post("/sweeps", json={"dataset": digest, "seeds": seeds, "webhook": r.url,
                                            "webhook_events": "completed"})
                assert s.status_code == 202, s.text
                sweeps[s.json()["id"]] = len(seeds)
            wait_for(lambda: c.get("/health").json()["admission"]["device_queue"]["depth"] == 6, 30, 0.02,
                     "the sweeps' six cells queued together")
        finally:
            gate.release()
        tasks = [submit(c, r.url, "completed", seed=str(10 + i)) for i in range(6)]
        payloads = [Webhook(secret).verify(q.body, q.headers) for q in r.wait_for(9, timeout=60)]
        assert server.app.state.service.executor.stats.largest_launch >= 6  # (one launch: the sweeps ended together)
        hashes = {t: task_doc(c, t)["predictions_sha256"] for t in tasks}
    by_type: dict[str, dict[str, dict]] = {}
    for p in payloads:
        by_type.setdefault(p["type"], {})[p["data"]["id"]] = p["data"]
    assert set(by_type["sweep.completed"]) == set(sweeps)
    for sweep_id, cells in sweeps.items():
        data = by_type["sweep.completed"][sweep_id]
        assert data["counts"] == {**data["counts"], "succeeded": cells}, data
    assert set(by_type["task.succeeded"]) == set(tasks) and len(set(hashes.values())) == len(tasks)
    for task_id, data in by_type["task.succeeded"].items():
        assert data["predictions_sha256"] == hashes[task_id], data


def _device_held(c: httpx.Client) -> None:
    """A task without a webhook on the device, held at the gate: what is sent next queues behind it
    and goes in one launch once the gate opens, however slowly it was sent."""
    held = post_task(c, BODY, headers=ASYNC).json()["id"]
    wait_for(lambda: c.get(f"/tasks/{held}").json()["status"] == "running", 60, 0.02, "a task held on the device")


def test_every_delivery_slot_comes_back_after_messages_delivered_together():
    """Two messages claimed together (their tasks ended in one launch) and delivered: both of
    the two delivery slots are free again -- the next two messages, whose receiver does not answer
    yet, are both attempted at once, not one after the other."""
    gate = Gate()
    settings = dict(backend="cpu-fast", workers=1, batch_max=8, batch_wait_ms=100, webhook_concurrency=2,
                    webhook_timeout_s=60.0, **FAST)
    with Receiver(plan=[204, 204, "hang"]) as r, inprocess_server(
            create_app(Settings(**settings), engines=gated_engines(gate, batching=True))) as server, \
            server.client() as c:
        gate.hold()
        try:
            _device_held(c)
            first = [submit(c, r.url, "completed", seed=str(s)) for s in (1, 2)]
            wait_for(lambda: c.get("/health").json()["admission"]["device_queue"]["depth"] == 2, 30, 0.02,
                     "two tasks queued together")
        finally:
            gate.release()
        for task_id in first:
            [m] = settled(c, f"/tasks/{task_id}/deliveries")
            assert m["state"] == "delivered", m
        assert server.app.state.service.executor.stats.largest_launch == 2
        second = [submit(c, r.url, "completed", seed=str(s)) for s in (3, 4)]
        held = r.wait_for(4, timeout=20)  # (two slots: both attempts in flight while neither is answered)
        r.release()
        assert {json.loads(q.body)["data"]["id"] for q in held[2:]} == set(second)
        for task_id in second:
            [m] = settled(c, f"/tasks/{task_id}/deliveries")
            assert m["state"] == "delivered", m
