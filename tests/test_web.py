"""The web page (app/web): its routes over plain HTTP, and the page itself in a real headless
browser (Debian's chromium driven by Playwright) against a real uvicorn server.

The browser test uploads tasks through the form (waiting, and async), sees them succeed in the
recent-tasks table, opens a task's page, downloads its predictions (.npy) and answer (.json)
through the page's links and checks them against ``learner.result.run_task`` on the same task.
Every page (the tasks, a task, a sweep, an evaluation's report, the leaderboard, the not-found
pages) is checked at 390 px and 1280 px for content that sticks out of its card
(``test_every_card_holds_its_content``). It skips only when chromium or the playwright package is missing; `.ci/run` installs chromium
and `make test` the package (the test extra), so CI runs it.

With REV88_WEB_SCREENSHOTS=<folder> the browser tests also save screenshots there
(desktop 1280x900 and phone 390x844, the index and a task page).
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.http.middleware import is_open
from learner.config import make_config
from learner.hashing import array_sha256
from learner.result import run_task
from learner.taskio import save_task, task_to_npz_bytes
from tests.conftest import ROOT, small_task
from tests.gates import FileGate
from tests.helpers import unavailable
from tests.server import post_task, running_server, wait_for

KEY = "web-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run"]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
BIG_SEED = 2**53 + 1  # not a float64: the page must carry it digit for digit


def chromium_path() -> str | None:
    for candidate in (os.environ.get("REV88_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One real server for this module: API key set, cpu-fast, one worker; its backend waits
    while ``server.gate`` is held (tests.gates.FileGate; released by default)."""
    tmp = tmp_path_factory.mktemp("web-server")
    gate = tmp / "gate"
    env = {"REV88_BACKEND": "cpu-fast", "REV88_API_KEY": KEY, "REV88_WORKERS": "1",
           "REV88_WEBHOOK_ALLOW_CIDRS": "127.0.0.2/32", "REV88_WEBHOOK_POLL_S": "0.2"}  # (receivers: 127.0.0.2)
    with running_server(tmp, env=env, gate=gate) as srv:
        srv.gate = FileGate(gate)
        yield srv
        srv.gate.release()


@pytest.fixture(scope="module")
def task_npz(tmp_path_factory) -> tuple[object, Path]:
    task = small_task(n=23, m=9, seed=3)
    path = tmp_path_factory.mktemp("web-task") / "small-task.npz"
    save_task(path, task)
    return task, path


# ---------------------------------------------------------------------------- plain HTTP


def test_pages_are_open_and_the_api_is_not(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        index = client.get("/")
        assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
        html = index.text
        for needle in ('id="task-form"', 'type="file"', 'id="backend"', 'value="async"', 'value="wait"',
                       'id="api-key"', 'id="tasks-table"', 'id="health"', 'id="cfg-epochs"', 'data-auth="required"',
                       '<option value="cpu-fast">'):
            assert needle in html, needle
        assert "script-src 'self'" in index.headers["content-security-policy"]

        page = client.get("/ui/tasks/0123abcd")
        assert page.status_code == 200 and 'data-task-id="0123abcd"' in page.text
        assert 'id="download-npy"' in page.text and "/tasks/0123abcd/predictions.npy" in page.text
        assert client.get("/ui/tasks/not.an%20id").status_code == 404

        js = client.get("/static/rev88.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "Bearer" in js.text
        css = client.get("/static/rev88.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert client.get("/static/nothing.js").status_code == 404

        # the API stays behind the key
        for path in ("/tasks", "/tasks/0123abcd", "/tasks/0123abcd/predictions.npy", "/docs", "/metrics"):
            assert client.get(path).status_code == 401, path
        assert client.get("/tasks", headers=AUTH).status_code == 200
        paths = client.get("/openapi.json", headers=AUTH).json()["paths"]
        assert "/tasks" in paths and not {"/", "/ui/tasks/{task_id}"} & set(paths)  # the page is not API
        assert client.get("/health").status_code == 200  # the probes were open before


def test_open_paths_are_exact():
    for path in ("/", "/ui/tasks/abc", "/static/rev88.js", "/health", "/v2/health/ready"):
        assert is_open(path), path
    for path in ("/tasks", "/tasks/abc", "/docs", "/openapi.json", "/metrics", "/ui/../tasks", "/static/../tasks",
                 "/ui/./tasks", "/static//tasks", "/static/..", "/ui\\..\\tasks", "/uix", "/static", "//tasks"):
        assert not is_open(path), path


def test_package_data_covers_the_web_files():
    """A regular (non-editable) install ships templates and static files: pyproject's
    [tool.setuptools.package-data] globs match every file of app/web but its Python."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["app.web"]
    web = ROOT / "app" / "web"
    files = [p.relative_to(web).as_posix() for p in web.rglob("*")
             if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
    assert files
    for name in files:
        assert any(fnmatch(name, g) for g in globs), f"app/web/{name} is not in package-data {globs}"


# ---------------------------------------------------------------------------- the real browser


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if executable is None:
        unavailable("browser", "Debian's chromium is not installed (apt-get install chromium; .ci/run does it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("browser", "the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def screenshot(page, name: str) -> None:
    folder = os.environ.get("REV88_WEB_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


class Page:
    """A browser page with its JavaScript errors collected (a failing test names them)."""

    def __init__(self, browser, viewport, **options):
        self.context = browser.new_context(viewport=viewport, accept_downloads=True, **options)
        self.context.set_default_timeout(30_000)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.on("console", lambda msg: msg.type == "error" and "Failed to load resource" not in msg.text
                     and self.errors.append(f"console: {msg.text}"))

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors


@pytest.fixture
def desktop(browser):
    page = Page(browser, DESKTOP)
    yield page.page
    page.close()


def no_sideways_scroll(page) -> None:
    width = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], f"the page scrolls sideways: {width[0]} px wide in a {width[1]} px window"


def upload(page, npz: Path, mode: str, config: dict[str, str]) -> str:
    page.set_input_files("#task-file", str(npz))
    for input_ in page.query_selector_all("fieldset.config input"):
        input_.fill("")
    for name, value in config.items():
        page.fill(f"#cfg-{name}", value)
    page.select_option("#backend", "cpu-fast")
    page.check(f"input[name=mode][value={mode}]")
    before = page.get_attribute("#submit-result", "data-task-id")
    page.click("#submit")
    page.wait_for_function(
        """before => { const r = document.querySelector('#submit-result');
                       return r.classList.contains('error') || (r.classList.contains('ok') && r.dataset.taskId !== before); }""",
        arg=before)
    result = page.locator("#submit-result")
    assert "ok" in result.get_attribute("class"), result.inner_text()
    return result.get_attribute("data-task-id")


def test_upload_through_the_form_and_download_the_predictions(server, browser, desktop, task_npz, tmp_path):
    task, npz = task_npz
    page = desktop
    page.goto(server.url + "/")
    # without the key the page says what is missing
    page.wait_for_selector("#tasks-message.error")
    assert "API key" in page.inner_text("#tasks-message")
    page.wait_for_selector("#health-status.status-ok")  # /health is open
    assert "cpu" in page.inner_text("#health-body")
    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_function("() => !document.querySelector('#tasks-message').classList.contains('error')")

    # mistakes are shown: one the page catches, one the server refuses (422, nothing trained)
    page.set_input_files("#task-file", str(npz))
    page.fill("#cfg-epochs", "2.5")
    page.click("#submit")
    page.wait_for_selector("#submit-result.error")
    assert "whole number" in page.inner_text("#submit-result")
    page.fill("#cfg-epochs", "5000")
    page.click("#submit")
    page.wait_for_function("() => /^422/.test(document.querySelector('#submit-result').textContent)")
    assert "epochs" in page.inner_text("#submit-result")

    # wait for the answer: epochs=3, seed=5
    waited = upload(page, npz, "wait", {"epochs": "3", "seed": "5"})
    assert "succeeded" in page.inner_text("#submit-result")
    # async, with a seed beyond float64's integers
    queued = upload(page, npz, "async", {"seed": str(BIG_SEED)})
    assert "accepted" in page.inner_text("#submit-result")
    for task_id in (waited, queued):
        page.wait_for_selector(f"#tasks-body tr[data-task-id='{task_id}'][data-status=succeeded]")
    row = page.locator(f"#tasks-body tr[data-task-id='{waited}']")
    assert row.locator("td[data-label=backend]").inner_text() == "cpu-fast"
    assert row.locator("td[data-label=train]").inner_text() == "23"
    assert row.locator("td[data-label=queries]").inner_text() == "9"
    screenshot(page, "index-desktop")

    expected = {
        waited: run_task(task, make_config({"epochs": 3, "seed": 5}), "cpu-fast"),
        queued: run_task(task, make_config({"seed": BIG_SEED}), "cpu-fast"),
    }
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        for task_id, result in expected.items():
            answer = client.get(f"/tasks/{task_id}").json()
            assert answer["predictions_sha256"] == result.predictions_sha256
            assert answer["metadata"]["backend"] == "cpu-fast"
        assert client.get(f"/tasks/{queued}").json()["metadata"]["config"]["seed"] == BIG_SEED

    # open the async task's page from the table
    page.click(f"#tasks-body tr[data-task-id='{queued}'] td[data-label=task] a")
    page.wait_for_url(f"**/ui/tasks/{queued}")
    page.wait_for_selector("#task-status.status-succeeded")
    want = expected[queued].predictions_sha256
    assert page.inner_text("#predictions-sha256") == want
    assert page.inner_text("[data-hash=predictions]") == want
    assert page.locator("#timing-chart .bar-row").count() >= 6
    assert page.locator("#timing-chart [data-phase=run]").count() == 1
    assert "energy" in page.inner_text("#energy-body").lower() or "no figure" in page.inner_text("#energy-body").lower()
    config_text = page.inner_text("#config-table")
    assert str(BIG_SEED) in config_text and "cpu-fast" in config_text
    assert page.locator("#prediction-histogram .column").count() == 10
    screenshot(page, "task-desktop")

    # the downloads, through the page's links (fetched with the key, saved by the browser)
    with page.expect_download() as info:
        page.click("#download-npy")
    download = info.value
    assert download.suggested_filename == f"rev88-{queued}.predictions.npy"
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    predictions = np.load(saved)
    assert predictions.dtype == np.int64 and predictions.shape == (9,)
    assert array_sha256(predictions) == want == expected[queued].predictions_sha256
    np.testing.assert_array_equal(predictions, expected[queued].predictions)

    with page.expect_download() as info:
        page.click("#download-json")
    saved_json = tmp_path / info.value.suggested_filename
    info.value.save_as(saved_json)
    answer = json.loads(saved_json.read_text())
    assert answer["id"] == queued and answer["status"] == "succeeded"
    assert answer["predictions_sha256"] == want and answer["predictions"] == predictions.tolist()


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def block_the_network(context) -> list[str]:
    """Every request of ``context`` to a host other than this machine aborted (as on an offline
    GPU node); returns the list the aborted URLs are appended to."""
    from urllib.parse import urlsplit

    blocked: list[str] = []

    def route(r):
        if urlsplit(r.request.url).hostname in LOOPBACK:
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    return blocked


def test_the_api_docs_render_with_the_network_blocked(server, browser):
    """/docs (Swagger UI) and /redoc (ReDoc) come whole from this server: with every request
    elsewhere aborted, Swagger UI lists every operation of /openapi.json and ReDoc renders them;
    neither page asked for anything off this machine."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        spec = client.get("/openapi.json").json()
        for path in ("/docs", "/redoc"):
            html = client.get(path)
            assert html.status_code == 200 and "connect-src 'self'" in html.headers["content-security-policy"]
            assert "http://" not in html.text and "https://" not in html.text, html.text  # (no CDN, no fonts)
        for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png"):
            assert httpx.get(f"{server.url}/static/api-docs/{name}").status_code == 200, name  # (open, as /static is)
    operations = [(method.upper(), path, op["summary"]) for path, item in spec["paths"].items()
                  for method, op in item.items() if method in ("get", "post", "put", "delete", "head", "patch")]
    assert len(operations) > 20
    docs = Page(browser, DESKTOP, extra_http_headers=AUTH)
    blocked = block_the_network(docs.context)
    page = docs.page
    try:
        page.goto(server.url + "/docs")
        page.wait_for_selector(".swagger-ui .opblock", timeout=60_000)
        shown = page.eval_on_selector_all(".swagger-ui .opblock", """bs => bs.map(b => [
            b.querySelector('.opblock-summary-method').textContent.trim(),
            b.querySelector('.opblock-summary-path').dataset.path])""")
        assert sorted(map(tuple, shown)) == sorted((m, p) for m, p, _ in operations)
        assert page.inner_text(".swagger-ui .info .title").startswith("rev88 service")
        screenshot(page, "api-docs")
        page.goto(server.url + "/redoc")
        page.wait_for_selector("[data-section-id^='tag/sweeps']", timeout=60_000)
        text = page.inner_text("body")
        for method, path, summary in operations:
            assert summary in text, (method, path, summary)
        assert blocked == [], blocked
        # The one off-site link in ReDoc's bundle, its menu's "Redocly" logo image, is refused by
        # the page's Content-Security-Policy before any request is made (ReDoc then hides it).
        refused = [e for e in docs.errors if "cdn.redoc.ly/redoc/logo-mini.svg" in e and "Content Security Policy" in e]
        docs.errors = [e for e in docs.errors if e not in refused]
    finally:
        docs.close()


def test_phone_sized_window(server, browser, task_npz):
    _, npz = task_npz
    phone = Page(browser, PHONE)
    page = phone.page
    try:
        page.goto(server.url + "/")
        page.fill("#api-key", KEY)
        page.click("#key-save")
        task_id = upload(page, npz, "wait", {"epochs": "2"})
        page.wait_for_selector(f"#tasks-body tr[data-task-id='{task_id}'][data-status=succeeded]")
        page.wait_for_selector("#health-status.status-ok")
        # the table collapses into one card per task: its header is hidden, each cell labelled
        assert not page.locator("#tasks-table thead").is_visible()
        no_sideways_scroll(page)
        screenshot(page, "index-phone")
        page.goto(f"{server.url}/ui/tasks/{task_id}")
        page.wait_for_selector("#task-status.status-succeeded")
        no_sideways_scroll(page)
        screenshot(page, "task-phone")
    finally:
        phone.close()


def test_task_page_follows_a_queued_task_and_cancels(server, desktop, task_npz):
    """While queued or running, the task page refreshes by itself; its Cancel button cancels."""
    _, npz = task_npz
    page = desktop
    body = npz.read_bytes()
    page.goto(server.url + "/")
    page.fill("#api-key", KEY)
    page.click("#key-save")
    server.gate.hold()
    try:
        with server.client(headers=AUTH) as client:
            held = post_task(client, body, headers={"Prefer": "respond-async"}).json()["id"]
            behind = post_task(client, body, params={"seed": "7"}, headers={"Prefer": "respond-async"}).json()["id"]
            wait_for(lambda: client.get(f"/tasks/{held}").json()["status"] == "running", 60, what="the held task running")
        page.goto(f"{server.url}/ui/tasks/{behind}")
        page.wait_for_selector("#task-status.status-queued")
        assert page.locator("#cancel").is_visible()
        assert "refreshes" in page.inner_text("#task-message")
        screenshot(page, "task-queued-desktop")
        page.click("#cancel")
        page.wait_for_selector("#task-status.status-cancelled")
        assert not page.locator("#cancel").is_visible() and not page.locator("#download-npy").is_visible()

        page.goto(f"{server.url}/ui/tasks/{held}")
        page.wait_for_selector("#task-status.status-running")
    finally:
        server.gate.release()
    page.wait_for_selector("#task-status.status-succeeded", timeout=60_000)  # no reload: the page polled
    assert page.locator("#download-npy").is_visible()


def test_the_task_page_shows_its_webhook_messages(server, desktop, task_npz):
    """A task sent with a webhook: its page lists the message, delivered, with its attempts; a
    task without one shows no webhook section."""
    from tests.receivers import Receiver

    _, npz = task_npz
    page = desktop
    with Receiver("127.0.0.2", plan=[500, 204]) as receiver, server.client(headers=AUTH) as client:
        hooked = post_task(client, npz.read_bytes(), params={"webhook": receiver.url, "seed": "11"},
                           headers={"Prefer": "respond-async"}).json()["id"]
        plain = post_task(client, npz.read_bytes(), params={"seed": "12"}, headers={"Prefer": "respond-async"}).json()["id"]
        page.goto(server.url + "/")
        page.fill("#api-key", KEY)
        page.click("#key-save")
        page.goto(f"{server.url}/ui/tasks/{hooked}")
        page.wait_for_selector("#task-status.status-succeeded", timeout=60_000)
        row = page.wait_for_selector("#webhooks-body tr[data-state=delivered]", timeout=60_000)  # (the page polls)
        text = row.inner_text()
        assert "task.succeeded" in text and receiver.url in text and "2 (last: 204)" in text, text
        assert len(receiver.requests) == 2
        screenshot(page, "task-webhooks-desktop")
        page.goto(f"{server.url}/ui/tasks/{plain}")
        page.wait_for_selector("#task-status.status-succeeded", timeout=60_000)
        assert not page.locator("#webhooks").is_visible()


def test_the_sweep_page_shows_its_cells_and_chart_and_the_task_list_links_to_it(server, desktop, tmp_path):
    """A sweep of two learning rates × two batch sizes × two seeds over a base config, on a
    labelled dataset: its page names it and shows its base config, seeds, backend and device;
    fills the cell table; draws one line per batch size, a point per learning rate (mean over the
    seeds), as wide as its card, with round y ticks, the two lines' error bars apart at each
    learning rate; the index lists the sweep with its status and counts, and the task list links
    each cell to it."""
    import hashlib
    import io

    task = small_task(n=40, m=10, seed=8)
    body = task_to_npz_bytes(task)
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    labels = io.BytesIO()
    np.save(labels, (np.arange(10) % 10).astype(np.int64))
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        assert c.put(f"/datasets/{digest}", content=body, headers={"Content-Type": "application/octet-stream"}).is_success
        assert c.put(f"/datasets/{digest}/labels", content=labels.getvalue(),
                     headers={"Content-Type": "application/octet-stream"}).is_success
        r = c.post("/sweeps", json={"dataset": digest, "name": "lr by batch", "config": {"epochs": 3, "momentum": 0.5},
                                    "grid": {"learning_rate": [0.05, 0.2], "batch_size": [8, 16]}, "seeds": [0, 1]})
        assert r.status_code == 202, r.text
        sweep_id = r.json()["id"]
    page = desktop
    page.goto(f"{server.url}/ui/sweeps/{sweep_id}")
    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#sweep-status.status-completed", timeout=60_000)
    assert page.locator("#cell-rows tr").count() == 8
    assert page.locator("#cell-rows tr[data-status=succeeded]").count() == 8
    assert page.inner_text("#sweep-name") == "Sweep “lr by batch”"
    shown = dict(zip(page.eval_on_selector_all("#sweep-facts dt", "ds => ds.map(d => d.textContent)"),
                     page.eval_on_selector_all("#sweep-facts dd", "ds => ds.map(d => d.textContent)")))
    assert shown["name"] == "lr by batch"
    assert shown["base config"] == "epochs=3 momentum=0.5 (the rest: the defaults)"
    assert shown["seeds"] == "0, 1 (2)" and shown["grid"] == "learning_rate: 0.05, 0.2; batch_size: 8, 16"
    assert shown["backend"] == "cpu-fast (the server's default)" and shown["device"] == "cpu"
    assert shown["cells"] == "8 of 8 finished (8 succeeded)"

    assert page.inner_text("#chart-title") == "accuracy by learning_rate"
    assert page.locator("#sweep-chart polyline").count() == 2  # one per batch size
    assert page.locator("#sweep-chart circle").count() == 4  # one per (batch size, learning rate)
    assert sorted(page.eval_on_selector_all("#sweep-chart circle", "cs => cs.map(c => c.dataset.n)")) == ["2"] * 4
    card, chart = page.evaluate("""() => [document.querySelector('#sweep-chart').clientWidth,
                                          document.querySelector('#sweep-chart svg').getBoundingClientRect().width]""")
    assert card > 1000 and abs(chart - card) <= 2, (card, chart)  # the card's width, not 660 px of it
    ticks = [float(t) for t in page.eval_on_selector_all("#sweep-chart .y-tick", "ts => ts.map(t => t.textContent)")]
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    assert len(ticks) >= 4 and len(steps) == 1, ticks  # evenly stepped
    step = steps.pop()
    assert round(step / 10 ** np.floor(np.log10(step)), 9) in (1, 2, 2.5, 5), step  # a round step
    assert page.eval_on_selector_all("#sweep-chart .x-tick", "ts => ts.map(t => t.textContent)") == ["0.05", "0.2"]
    at = page.eval_on_selector_all("#sweep-chart circle", "cs => cs.map(c => [c.dataset.x, Number(c.getAttribute('cx'))])")
    for x in ("0.05", "0.2"):
        xs = sorted(cx for value, cx in at if value == x)
        assert len(xs) == 2 and xs[1] - xs[0] >= 8, at  # the two lines' points and bars apart
    bars = page.eval_on_selector_all("#sweep-chart line.error-bar[data-x]", "ls => ls.map(l => Number(l.getAttribute('x1')))")
    assert len(set(bars)) == 4
    screenshot(page, "sweep")
    page.goto(server.url + "/")
    page.fill("#api-key", KEY)
    page.click("#key-save")
    listed = page.wait_for_selector(f"#sweeps-body tr[data-sweep-id='{sweep_id}'][data-status=completed]")
    assert listed.query_selector("td[data-label=cells]").inner_text() == "8 of 8 finished (8 succeeded)"
    assert listed.query_selector("td[data-label='grid × seeds']").inner_text() == "learning_rate (2) × batch_size (2) × 2 seeds"
    page.locator(f"#tasks-body a.sweep-link[title='{sweep_id}']").first.click()  # (a locator: the list re-renders)
    page.wait_for_selector("#sweep-status.status-completed")


def test_an_evaluations_report_and_the_leaderboard(server, desktop):
    """Three graded evaluations on this server over two draw sets (two over draws 0-1, one over
    draw 2) and one of another device (written into the server's store): the report page shows
    the draws, the totals, the band verdicts and the chart; the leaderboard ranks the two over
    draws 0-1 together and lists the one over draw 2 and the other device's apart, each ranked on
    its own, marks the Pareto front of accuracy against time, re-sorts, and shows an evaluation
    still running with its status and progress."""
    from tests.test_evaluations import insert_graded

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        ids = [c.post("/evaluations", json={"draws": draws, "config": config, "name": name}).json()["id"]
               for name, draws, config in (("one epoch", "0-1", {"epochs": 1}), ("default", "0-1", {}),
                                           ("draw 2 alone", "2", {"epochs": 1}))]
        docs = [wait_for(lambda i=i: (d := c.get(f"/evaluations/{i}").json())["status"] == "completed" and d, 300,
                         what="an evaluation") for i in ids]
    alone = docs.pop()
    port = server.url.rsplit(":", 1)[1]
    other = insert_graded(server.log.parent / f"data-{port}", "ev-elsewhere", 9990, 0.5)
    page = desktop
    page.goto(f"{server.url}/evaluations/{ids[0]}")  # a browser asks for HTML: the report page
    assert page.url.endswith(f"/evaluations/{ids[0]}/report")
    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#evaluation-status.status-completed", timeout=60_000)
    doc = docs[0]
    assert page.eval_on_selector_all("#draw-rows tr", "rs => rs.map(r => Number(r.dataset.correct))") == [
        row["correct"] for row in doc["draws"]]
    totals_text = page.inner_text("#totals")
    assert doc["totals"]["correct_over_total"] in totals_text and "95 % interval" in totals_text
    assert page.locator("#bands li").count() == 5
    page.wait_for_function("() => { const i = document.querySelector('#accuracy-chart'); "
                           "return !i.hidden && i.complete && i.naturalWidth > 0; }")
    assert page.inner_text("#evaluation-name") == "one epoch"
    screenshot(page, "evaluation")

    page.goto(f"{server.url}/ui/evaluations")
    page.wait_for_selector(".board-group[data-comparison] tbody tr")
    page.wait_for_function("() => document.querySelectorAll('.board-group').length === 3")
    labels = page.eval_on_selector_all(".board-group", "gs => gs.map(g => g.dataset.comparison)")
    assert labels[0] == doc["comparison"] and set(labels[1:]) == {alone["comparison"], other}  # most draws first
    assert doc["comparison"].endswith("draws 0-1") and alone["comparison"].endswith("draws 2")
    assert doc["comparison"].rsplit(" · ", 1)[0] == alone["comparison"].rsplit(" · ", 1)[0]  # one device, versions
    here = f".board-group[data-comparison='{doc['comparison']}']"
    best = max(docs, key=lambda d: d["totals"]["mean_accuracy"])
    assert page.eval_on_selector_all(f"{here} tbody tr", "rs => rs.map(r => [r.dataset.id, r.dataset.rank])") == [
        [best["id"], "1"], [next(d["id"] for d in docs if d is not best), "2"]]
    for label, evaluation_id in ((alone["comparison"], alone["id"]), (other, "ev-elsewhere")):  # ranked apart
        assert page.eval_on_selector_all(f".board-group[data-comparison='{label}'] tbody tr",
                                         "rs => rs.map(r => [r.dataset.id, r.dataset.rank])") == [[evaluation_id, "1"]]
    assert "2 draws each" in page.inner_text(f"{here} h3")
    assert page.inner_text("#leaderboard").count("ranked only against") == 1  # (said once, above the groups)
    points = [(d["time"]["ms_per_task"], d["totals"]["mean_accuracy"], d["id"]) for d in docs]
    front = {i for x, y, i in points if not any(x2 <= x and y2 >= y and (x2 < x or y2 > y) for x2, y2, _ in points)}
    marked = page.eval_on_selector_all(f"{here} circle", "cs => cs.map(c => [c.dataset.id, c.dataset.pareto])")
    assert sorted(marked) == sorted([i, "true" if i in front else "false"] for _, _, i in points)
    page.select_option("#board-sort", "time")
    fastest = min(docs, key=lambda d: d["time"]["ms_per_task"])["id"]
    page.wait_for_function(f"() => document.querySelector(\"{here} tbody tr\").dataset.id === '{fastest}'")
    screenshot(page, "leaderboard")

    server.gate.hold()  # an evaluation not graded yet: its status and its draws' progress
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
            waiting = c.post("/evaluations", json={"draws": "3-4", "config": {"epochs": 1}}).json()["id"]
            wait_for(lambda: c.get(f"/evaluations/{waiting}").json()["counts"]["running"] == 1, 60, what="a draw running")
        page.reload()
        row = page.wait_for_selector(f".board-group[data-comparison=''] tr[data-id='{waiting}'][data-status=running]")
        assert row.query_selector("td[data-label=status] .pill").inner_text() == "running"
        assert row.query_selector("[data-progress]").inner_text() == "0 of 2 finished · 1 running · 1 queued"
    finally:
        server.gate.release()
    page.wait_for_selector(f"tr[data-id='{waiting}'][data-status=completed]", timeout=60_000)  # (the page polls)
    page.goto(server.url + "/")  # the task list links a draw's task to its evaluation
    page.locator(f"#tasks-body a.evaluation-link[title='{ids[0]}']").first.click()
    page.wait_for_selector("#evaluation-status.status-completed")
    assert page.inner_text("#evaluation-name") == "one epoch"


def test_the_key_box_says_which_key_is_in_use_and_its_usage(server, desktop, task_npz):
    """A tenant's key typed into the page: the page names it, its scopes and today's usage, and
    the task list shows only that tenant's tasks."""
    _, npz = task_npz
    with httpx.Client(base_url=server.url, timeout=60) as c:
        made = c.post("/keys", json={"name": "web-tenant"}, headers=AUTH).json()
        tenant = {"Authorization": f"Bearer {made['key']}"}
        done = post_task(c, npz.read_bytes(), headers=tenant)
        assert done.status_code == 200, done.text
    page = desktop
    page.goto(server.url + "/")
    page.fill("#api-key", made["key"])
    page.click("#key-save")
    page.wait_for_selector("#key-state[data-key-name='web-tenant']")
    text = page.inner_text("#key-state")
    assert "key web-tenant (read, write)" in text and "today 1 task" in text, text
    page.wait_for_selector(f"#tasks-body tr[data-task-id='{done.json()['id']}']")
    assert page.locator("#tasks-body tr").count() == 1  # its own task only
    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#key-state[data-key-name='admin']")
    assert "admin" in page.inner_text("#key-state")


def test_an_evaluation_over_seeds_shows_a_row_per_draw_and_seed(server, desktop):
    """An evaluation with seeds: its report lists each draw at each seed, names the seeds, and its
    totals say how much the seeds' means vary; the leaderboard row names the seeds."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        ev = c.post("/evaluations", json={"draws": "2", "seeds": [0, 1], "config": {"epochs": 1},
                                          "name": "two seeds"}).json()["id"]
        doc = wait_for(lambda: (d := c.get(f"/evaluations/{ev}").json())["status"] == "completed" and d, 300,
                       what="the evaluation")
    page = desktop
    page.goto(f"{server.url}/evaluations/{ev}/report")
    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#evaluation-status.status-completed", timeout=60_000)
    assert page.eval_on_selector_all("#draw-rows tr td[data-label='draw']", "cs => cs.map(c => c.innerText)") == [
        "2 · seed 0", "2 · seed 1"]
    assert page.eval_on_selector_all("#draw-rows tr", "rs => rs.map(r => Number(r.dataset.correct))") == [
        row["correct"] for row in doc["draws"]]
    facts_text = page.inner_text("#evaluation-facts")
    assert "seeds\n0, 1" in facts_text and "· seeds 0-1" in facts_text, facts_text
    assert "2 seeds" in page.inner_text("#totals")
    page.goto(f"{server.url}/ui/evaluations")
    page.wait_for_selector(f"tr[data-id='{ev}']")
    assert "× seeds 0-1" in page.inner_text(f"tr[data-id='{ev}'] td[data-label='draws']")


# ---------------------------------------------------------------------------- every page at a phone's and a desktop's width

# What sticks out of a card: each visible element of a visible .card whose box reaches past the
# card's edges, or whose own content is wider than it (text running into its neighbour), but not
# what a table laid out as a table holds when its box scrolls sideways (a table scrolling inside
# its card is fine; one shown as a card per row is not exempt), nor the inside of an SVG chart
# (the chart itself is checked).
OVERFLOW_JS = """() => {
  const bad = [], tol = 1;
  const style = (e) => getComputedStyle(e);
  const shown = (e) => style(e).display !== "none" && style(e).visibility !== "hidden" && e.getClientRects().length > 0;
  const scrolls = (e) => ["auto", "scroll"].includes(style(e).overflowX);
  const name = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") + (e.dataset.label ? `[${e.dataset.label}]` : "")
    + ` "${(e.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 40)}"`;
  for (const card of document.querySelectorAll(".card")) {
    if (!shown(card)) continue;
    const box = card.getBoundingClientRect();
    if (card.scrollWidth > card.clientWidth + tol)
      bad.push(`${card.id}: its content is ${card.scrollWidth} px wide in ${card.clientWidth} px`);
    for (const e of card.querySelectorAll("*")) {
      let held = false;
      for (let p = e.parentElement; p && p !== card; p = p.parentElement) {
        if (p instanceof SVGElement || (p.tagName === "TABLE" && style(p).display === "table"
                                        && p.parentElement && scrolls(p.parentElement))) { held = true; break; }
      }
      if (held || !shown(e)) continue;
      const r = e.getBoundingClientRect();
      if (r.width > 0 && (r.left < box.left - tol || r.right > box.right + tol))
        bad.push(`${card.id}: ${name(e)} reaches ${Math.round(Math.max(box.left - r.left, r.right - box.right))} px past the card`);
      else if (!(e instanceof SVGElement) && !scrolls(e) && style(e).display !== "inline" && e.clientWidth > 0
               && e.scrollWidth > e.clientWidth + tol)
        bad.push(`${card.id}: ${name(e)} holds ${e.scrollWidth} px of content in ${e.clientWidth} px`);
    }
  }
  return bad;
}"""


def overflows(page) -> list[str]:
    return page.evaluate(OVERFLOW_JS)


@pytest.fixture(scope="module")
def filled(server):
    """What every page shows, on this module's server: a task; a sweep of 2 learning rates x 2 batch
    sizes x 2 seeds on a labelled dataset; a graded evaluation of draws 6-7 (10,000 queries a draw:
    the widest counts), alone in its group (a one-point chart: no other test grades these draws)."""
    import hashlib
    import io

    task = small_task(n=40, m=10, seed=21)
    body = task_to_npz_bytes(task)
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    labels = io.BytesIO()
    np.save(labels, (np.arange(10) % 10).astype(np.int64))
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        answer = post_task(c, body, params={"seed": "3"})
        assert answer.status_code == 200, answer.text
        assert c.put(f"/datasets/{digest}", content=body, headers={"Content-Type": "application/octet-stream"}).is_success
        assert c.put(f"/datasets/{digest}/labels", content=labels.getvalue(),
                     headers={"Content-Type": "application/octet-stream"}).is_success
        sweep = c.post("/sweeps", json={"dataset": digest, "name": "fit check", "config": {"epochs": 2},
                                        "grid": {"learning_rate": [0.05, 0.1], "batch_size": [8, 16]}, "seeds": [0, 1]})
        evaluation = c.post("/evaluations", json={"draws": "6-7", "config": {"epochs": 1, "depth": 3},
                                                  "name": "fits a phone"})
        assert sweep.status_code == 202 and evaluation.status_code == 202, (sweep.text, evaluation.text)
        ids = {"task": answer.json()["id"], "sweep": sweep.json()["id"], "evaluation": evaluation.json()["id"]}
        wait_for(lambda: c.get(f"/sweeps/{ids['sweep']}").json()["status"] == "completed", 300, what="the sweep")
        wait_for(lambda: c.get(f"/evaluations/{ids['evaluation']}").json()["status"] == "completed", 300,
                 what="the evaluation")
    return ids


def fit_pages(ids: dict[str, str]) -> list[tuple[str, str]]:
    """(path, a selector there once the page has drawn what it shows)"""
    return [("/", "#tasks-body tr[data-status=succeeded]"),
            (f"/ui/tasks/{ids['task']}", "#task-status.status-succeeded"),
            (f"/ui/sweeps/{ids['sweep']}", "#sweep-chart svg"),
            (f"/ui/evaluations/{ids['evaluation']}", "#accuracy-chart:not([hidden])"),
            ("/ui/evaluations", ".board-chart svg"),
            ("/ui/sweeps/sw-no-such-sweep", "#missing"),
            ("/no-such-page", "#missing")]


@pytest.mark.parametrize("size", ["phone", "desktop"])
def test_every_card_holds_its_content(server, browser, filled, size):
    """At 390 px and at 1280 px, on every page (the tasks, a task, a sweep, an evaluation's
    report, the leaderboard, the two not-found pages): no card's content reaches past the card or
    runs out of its own box, and the page never scrolls sideways."""
    viewer = Page(browser, PHONE if size == "phone" else DESKTOP)
    viewer.context.add_init_script(f"localStorage.setItem('rev88.apiKey', {json.dumps(KEY)})")
    page = viewer.page
    try:
        for path, drawn in fit_pages(filled):
            page.goto(server.url + path)
            page.wait_for_selector(drawn, state="attached", timeout=60_000)
            page.wait_for_timeout(300)  # (a chart drawn after the table, the health card after the tasks)
            assert overflows(page) == [], path
            no_sideways_scroll(page)
    finally:
        viewer.close()


def test_the_pages_say_their_units_and_a_missing_item_with_only_a_way_back(server, browser, filled):
    """The leaderboard's headers read as written ("mJ / task", never upper-cased into megajoules),
    its group sentence is said once, and a one-point chart names its point; an unknown sweep's page
    shows the message and the ways back, no CSV button, chart or cells; a browser asking for a
    path no route serves gets a page pointing to / and /docs."""
    viewer = Page(browser, PHONE)
    viewer.context.add_init_script(f"localStorage.setItem('rev88.apiKey', {json.dumps(KEY)})")
    page = viewer.page
    try:
        page.goto(server.url + "/ui/evaluations")
        page.wait_for_selector(f".board-group tr[data-id='{filled['evaluation']}']")
        headers = page.eval_on_selector_all(".board-group th", "ts => ts.map(t => [t.innerText, getComputedStyle(t).textTransform])")
        assert ["mJ / task", "none"] in headers and ["ms / task", "none"] in headers, headers
        assert page.inner_text("#leaderboard").count("ranked only against") == 1 and not page.inner_text("#board-message")
        group = page.locator(".board-group", has=page.locator(f"tr[data-id='{filled['evaluation']}']"))
        assert group.locator("circle").count() == 1
        assert "fits a phone:" in group.locator(".point-label").text_content()  # the lone point is named
        assert len(group.locator(".tick").all_text_contents()) == 4  # on a drawn scale, both axes with two ends

        page.goto(server.url + "/ui/sweeps/sw-no-such-sweep")
        page.wait_for_selector("#missing")
        assert page.inner_text("#missing h2") == "No such sweep" and "sw-no-such-sweep" in page.inner_text("#missing")
        for hidden in ("#download-csv", "#sweep-chart-card", "#cells", "#sweep"):
            assert not page.locator(hidden).is_visible(), hidden
        assert page.locator("#missing a[href='/']").count() == 1

        page.goto(server.url + "/tasks-please")
        assert page.inner_text("#missing h2") == "No such page"
        assert page.locator("#missing a[href='/']").count() == 1 and page.locator("#missing a[href='/docs']").count() == 1
    finally:
        viewer.close()
