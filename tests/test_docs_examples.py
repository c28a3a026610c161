"""The docs cannot drift from the service: the examples of docs/sweeps.md, docs/evaluations.md
and the "Try it" blocks of docs/tenants.md and docs/webhooks.md run as written against a real
server, and every status the route tables of the first two list is the API models' own.

An example is a fenced block right after the line ``<!-- runs in tests/test_docs_examples.py -->``
(an HTML comment: a reader of the rendered page does not see it). A page's examples run in
order, as one bash script (``bash -eu``: a failing command fails the test) in an empty folder,
with this checkout's ``rev88`` and ``python`` first on PATH, against a real ``uvicorn`` server on
loopback (cpu-fast, no API key); the only change made to them is the server's address, which
replaces ``http://127.0.0.1:8000`` (and a webhook receiver's ``127.0.0.1:8001``, a free port
on loopback). Each comment line ``# → TEXT`` in a block is output the example promises: its lines
must appear in the script's output in that order, ``…`` standing for any text.

A page whose examples need a server started another way says so in a block right after
``<!-- the server of this page's examples: tests/test_docs_examples.py starts it so -->``: one
line, ``NAME=value ... make serve``; the test starts its server with those variables.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.server import running_server

MARK = "<!-- runs in tests/test_docs_examples.py -->"
SERVER_MARK = "<!-- the server of this page's examples: tests/test_docs_examples.py starts it so -->"
DOCS = {"sweeps.md": "/sweeps", "evaluations.md": "/evaluations"}  # each page's routes
TRY_IT = ("tenants.md", "webhooks.md")  # pages whose "Try it" needs a server of its own
DOCS_URL = "http://127.0.0.1:8000"
RECEIVER = "127.0.0.1:8001"  # a webhook receiver the examples start
PROMISE = "# → "

STATUS_WORD = r"`(?:accepted|queued|running|succeeded|failed|cancelled|completed)`"
STATUS_RUN = re.compile(rf"{STATUS_WORD}(?:(?:,\s+or\s+|,\s+|\s+or\s+){STATUS_WORD})*")
ROUTE_ROW = re.compile(r"^\|\s*`(GET|POST|PUT|DELETE|HEAD|PATCH) (/[^`?\s]*)`\s*\|(.*)\|\s*$")


def fenced_blocks(text: str) -> list[tuple[bool, str]]:
    """Every fenced block of a page, in order: (marked as an example, its text)."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            out.append((i > 0 and lines[i - 1].strip() == MARK, "\n".join(lines[i + 1 : j])))
            i = j
        i += 1
    return out


def examples(page: str) -> list[str]:
    return [block for marked, block in fenced_blocks((ROOT / "docs" / page).read_text()) if marked]


def server_variables(page: str) -> dict[str, str]:
    """The variables the page's server block starts ``make serve`` with."""
    import shlex

    lines = (ROOT / "docs" / page).read_text().splitlines()
    at = lines.index(SERVER_MARK)
    assert lines[at + 1].startswith("```"), f"docs/{page}: no block after the server mark"
    words = shlex.split(lines[at + 2])
    assert lines[at + 3].startswith("```"), f"docs/{page}: the server block is one line"
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    assert [w for w in words if "=" not in w] == ["make", "serve"], f"docs/{page}: {lines[at + 2]!r}"
    return env


def promised(script: str) -> list[re.Pattern]:
    """The ``# → TEXT`` lines as patterns of a whole output line (``…``: any text)."""
    return [re.compile(".*".join(re.escape(part) for part in line.strip()[len(PROMISE):].split("…")))
            for line in script.splitlines() if line.strip().startswith(PROMISE)]


def assert_in_order(patterns: list[re.Pattern], output: str) -> None:
    lines = [line.strip() for line in output.splitlines()]
    at = 0
    for pattern in patterns:
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        assert at < len(lines), f"the example promises a line {pattern.pattern!r} (after the ones before it); " \
                                f"its output:\n{output}"
        at += 1


@pytest.mark.parametrize("page", DOCS)
def test_the_page_opens_with_a_runnable_example(page):
    blocks = fenced_blocks((ROOT / "docs" / page).read_text())
    assert blocks and blocks[0][0], f"docs/{page}'s first code block is not a runnable example ({MARK})"
    assert len(examples(page)) >= 2  # the CLI's and curl's
    for block in examples(page):
        assert DOCS_URL in block and "localhost" not in block  # (the one address the test replaces)
        assert promised(block), "an example says what it prints"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("docs-server"),
                        env={"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "2", "REV88_API_KEY": ""}) as srv:
        yield srv


def run_examples(page: str, url: str, folder: Path) -> str:
    from tests.server import free_port

    script = "\n".join(examples(page)).replace(DOCS_URL, url).replace(RECEIVER, f"127.0.0.1:{free_port()}")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("REV88_API_KEY", None)
    proc = subprocess.run(["bash", "-eu", "-c", script], cwd=folder, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)  # (one stream: in the order printed)
    assert proc.returncode == 0, f"docs/{page}'s examples failed ({proc.returncode}):\n{script}\n---\n{proc.stdout}"
    assert_in_order(promised(script), proc.stdout)
    return proc.stdout


def test_the_sweeps_examples_run_as_written(server, tmp_path):
    run_examples("sweeps.md", server.url, tmp_path)
    table = (tmp_path / "table.csv").read_text().splitlines()
    assert len(table) == 1 + 12 and all(",succeeded," in row for row in table[1:])
    assert all(row.split(",")[7] == "64" for row in table[1:])  # the base config's batch_size
    assert len((tmp_path / "lr.csv").read_text().splitlines()) == 1 + 6


def test_the_evaluations_examples_run_as_written(server, tmp_path):
    run_examples("evaluations.md", server.url, tmp_path)
    assert (tmp_path / "report" / "summary.json").is_file() and (tmp_path / "ev.json").is_file()


@pytest.mark.parametrize("page", TRY_IT)
def test_the_try_it_blocks_run_as_written(page, tmp_path):
    """The page's "Try it": its server started as the page says (its variables; cpu-fast, two
    workers), then its examples in order, each promised line in the output."""
    text = (ROOT / "docs" / page).read_text()
    try_it = text.split("## Try it", 1)[1].split("\n## ", 1)[0]
    assert SERVER_MARK in try_it and MARK in try_it, f"docs/{page} has no Try it with its server and an example"
    env = {"REV88_BACKEND": "cpu-fast", "REV88_WORKERS": "2", "REV88_API_KEY": "", **server_variables(page)}
    with running_server(tmp_path, env=env) as srv:
        folder = tmp_path / "examples"
        folder.mkdir()
        run_examples(page, srv.url, folder)
    assert (folder / "task.npz").is_file()


def test_the_promises_are_checked():
    """A promised line missing from the output, or out of order, fails."""
    patterns = promised("# → sweep sw-… completed: 12 succeeded\n# → done")
    assert_in_order(patterns, "noise\nsweep sw-1 completed: 12 succeeded\nmore\ndone\n")
    for output in ("sweep sw-1 completed: 11 succeeded\ndone", "done\nsweep sw-1 completed: 12 succeeded"):
        with pytest.raises(AssertionError):
            assert_in_order(patterns, output)


# --------------------------------------------------------------------------- the statuses


def route_rows(page: str) -> dict[tuple[str, str], str]:
    """(method, path with {} for each placeholder) -> the text of its row in the page's tables."""
    rows = {}
    for line in (ROOT / "docs" / page).read_text().splitlines():
        m = ROUTE_ROW.match(line)
        if m:
            rows[(m[1], re.sub(r"<[^>]+>", "{}", m[2]))] = m[3]
    return rows


def status_sets(schema, components: dict) -> set[frozenset[str]]:
    """Every set of values a ``status`` field (or a ``counts`` key) can take in ``schema``."""
    out: set[frozenset[str]] = set()
    seen: set[str] = set()

    def walk(node, key=None):
        if isinstance(node, list):
            for item in node:
                walk(item, key)
            return
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            if name not in seen:
                seen.add(name)
                walk(components[name])
            return
        values = node.get("enum") or ([node["const"]] if "const" in node else None)
        if key == "status" and values:
            out.add(frozenset(values))
        if (node.get("propertyNames") or {}).get("enum"):
            out.add(frozenset(node["propertyNames"]["enum"]))
        for name, value in (node.get("properties") or {}).items():
            walk(value, name)
        for part in ("items", "additionalProperties"):
            walk(node.get(part))
        for part in ("anyOf", "oneOf", "allOf"):
            walk(node.get(part), key)

    walk(schema)
    return out


def answered_statuses(operation: dict, components: dict) -> set[frozenset[str]]:
    out: set[frozenset[str]] = set()
    for code, response in operation.get("responses", {}).items():
        if str(code).startswith("2"):
            for content in (response.get("content") or {}).values():
                out |= status_sets(content.get("schema"), components)
    return out


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from app.main import create_app
    from app.settings import Settings

    return create_app(Settings(data_dir=str(tmp_path_factory.mktemp("spec")))).openapi()


@pytest.mark.parametrize("page", DOCS)
def test_every_status_a_route_answers_is_listed_where_it_is_documented(page, spec):
    """Each route of the page's prefix has a row in its tables; in it, each set of values its
    answer's ``status`` fields (and ``counts`` keys) take in the OpenAPI schema (the API models'
    Literal enums) is listed whole, as a run like `queued`, `running` or `completed`, and every
    status the row names belongs to one of those sets."""
    rows = route_rows(page)
    components = spec["components"]["schemas"]
    routes = {(method.upper(), re.sub(r"\{[^}]+\}", "{}", path)): op for path, item in spec["paths"].items()
              if path.startswith(DOCS[page]) for method, op in item.items()}
    assert routes
    missing = sorted(set(routes) - set(rows))
    assert not missing, f"docs/{page} has no row for {missing}"
    stale = sorted(r for r in rows if r[1].startswith(DOCS[page]) and r not in routes)
    assert not stale, f"docs/{page} documents routes the service does not have: {stale}"
    for route, operation in routes.items():
        want = answered_statuses(operation, components)
        runs = {frozenset(re.findall(r"`(\w+)`", run)) for run in STATUS_RUN.findall(rows[route])}
        assert want <= runs, f"docs/{page}, {route}: lists {sorted(map(sorted, runs))}, the API answers " \
                             f"{sorted(map(sorted, want))}"
        strays = [sorted(run) for run in runs if not any(run <= w for w in want)]
        assert not strays, f"docs/{page}, {route}: names statuses the route never answers: {strays}"
    assert frozenset({"accepted"}) in answered_statuses(routes[("POST", DOCS[page])], components)


# --------------------------------------------------------------------------- the README's Python example


def readme_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "from rev88 import Client" in b]
    return block


def editable_install() -> bool:
    """Whether this environment's rev88 is an editable install (`make serve`'s and `make test`'s)."""
    import importlib.metadata
    import json

    for dist in importlib.metadata.distributions(name="rev88"):  # (the checkout's rev88.egg-info has none)
        direct = dist.read_text("direct_url.json")
        if direct:
            return bool(json.loads(direct).get("dir_info", {}).get("editable"))
    return False


def test_the_readmes_python_example_runs_in_the_clone_and_elsewhere_not_beside_a_rev88_folder(tmp_path):
    """The README's snippet, saved as example.py beside task.npz and labels.npy (draw 0), against
    a real server on the cpu backend: in a clone's folder (whose rev88/ is the package) and in a
    folder of its own it prints the README's `8887 / 10000 37724115…`; in a folder that holds a
    folder named rev88 (a clone) it fails as the README warns."""
    import numpy as np

    from learner.taskio import make_task, save_task
    from tests.helpers import MNIST_DIR

    task, labels = make_task(MNIST_DIR, 2026091400)
    clone, own, holder = tmp_path / "clone", tmp_path / "own", tmp_path / "holder"
    clone.mkdir()
    (clone / "rev88").symlink_to(ROOT / "rev88", target_is_directory=True)  # (a clone's root: its package folder)
    own.mkdir()
    (holder / "rev88" / "rev88").mkdir(parents=True)  # a clone named rev88, beside the script
    with running_server(tmp_path, env={"REV88_BACKEND": "cpu", "REV88_WORKERS": "1", "REV88_API_KEY": ""}) as srv:
        for folder in (clone, own, holder):
            save_task(folder / "task.npz", task)
            np.save(folder / "labels.npy", labels)
            (folder / "example.py").write_text(readme_python().replace(DOCS_URL, srv.url))
        for folder in (clone, own):
            proc = subprocess.run([sys.executable, "example.py"], cwd=folder, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == "8887 / 10000 " + "37724115cb2d3242eb4a4f76d3a879ac92d729939320e5f6f2bd046bd631f200"
        proc = subprocess.run([sys.executable, "example.py"], cwd=holder, capture_output=True, text=True, timeout=600)
    if editable_install():  # (a regular install is found past the folder: the script runs)
        assert proc.returncode != 0 and "cannot import name 'Client'" in proc.stderr, (proc.stdout, proc.stderr)
    else:
        assert proc.returncode == 0, proc.stderr
