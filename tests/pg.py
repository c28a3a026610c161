"""A real PostgreSQL server for the tests: a throwaway cluster started from Debian's binaries,
or the server at ``REV88_TEST_DATABASE_URL``.

``PgCluster`` runs ``initdb`` and ``pg_ctl`` in a temporary folder (as the ``postgres`` user when
the tests run as root: ``initdb`` refuses root), on a unix socket in that folder and a free TCP
port on 127.0.0.1 only, with trust authentication (nothing else can reach it). It can be
stopped, started and restarted (the database-outage tests do). ``fsync=off`` by default: the
tests restart the server process, they never crash the machine, so nothing committed is lost
that way; the benchmark starts one with ``fsync=on``.

Fixtures (import them into a test module: ``from .pg import pg_server, pg_url  # noqa: F401``):

    pg_server   session: a running server (started once) or the external one; skips with a
                message saying how to get one when neither exists, and fails instead where
                REV88_TEST_REQUIRE names postgres (`make test` and CI set it: they cannot skip
                them silently; tests/helpers.py)
    pg_url      a fresh, empty database on it for one test (its URL)
    pg_cluster  a cluster of the test's own (for tests that stop or restart the server)
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from .helpers import unavailable

URL_ENV = "REV88_TEST_DATABASE_URL"
REQUIRED_ENV = "REV88_TEST_POSTGRES"
SKIP_MESSAGE = (
    "PostgreSQL tests skipped: no PostgreSQL server binaries found (Debian: apt-get install postgresql; "
    "looked in /usr/lib/postgresql/*/bin and PATH) and REV88_TEST_DATABASE_URL is not set"
)


def find_bindir() -> Path | None:
    """The newest /usr/lib/postgresql/N/bin with initdb, else the folder of initdb on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    """A throwaway PostgreSQL cluster (see the module docstring)."""

    def __init__(self, bindir: Path, fsync: bool = False, settings: dict[str, str] | None = None) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="rev88-pg-"))  # under /tmp: reachable by the postgres user
        self.data = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.log = self.root / "server.log"
        self.socket_dir.mkdir()
        self.as_postgres = os.geteuid() == 0
        self.settings = {
            "listen_addresses": "127.0.0.1", "port": str(self.port), "unix_socket_directories": str(self.socket_dir),
            "fsync": "on" if fsync else "off", "full_page_writes": "on" if fsync else "off",
            "max_connections": "200", "shared_buffers": "64MB", "log_min_messages": "warning",
            **(settings or {}),
        }
        if self.as_postgres:
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.socket_dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--locale=C", *([] if fsync else ["--no-sync"]))
        self.started = False

    def _run(self, tool: str, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / tool), *args]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr or out.stdout}\n{self.logs()}")
        return out

    def logs(self) -> str:
        try:
            return self.log.read_text()[-4000:]
        except OSError:
            return ""

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        options = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        self.started = True

    def stop(self, mode: str = "fast") -> None:
        if self.started:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)
            self.started = False

    def restart(self, down_s: float = 0.0, mode: str = "fast") -> None:
        self.stop(mode)
        time.sleep(down_s)
        self.start()

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(admin_url: str, prefix: str = "rev88_test") -> str:
    """A new, empty database on the server at ``admin_url``; its URL."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(admin_url)
    return urlunsplit(parts._replace(path="/" + name))


def drop_database(admin_url: str, url: str) -> None:
    import psycopg

    name = urlsplit(url).path.lstrip("/")
    with contextlib.suppress(psycopg.Error), psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _unavailable(reason: str):
    unavailable("postgres", reason)


def require_psycopg():
    """psycopg, imported for a test module; a skip without it, or a failure where the PostgreSQL
    tests are required (tests/helpers.py: REV88_TEST_REQUIRE)."""
    try:
        import psycopg
    except ImportError:
        _unavailable("PostgreSQL tests skipped: psycopg is not installed (pip install -e '.[test]')")
    return psycopg


class PgServer:
    """What the tests need of a server: an admin URL, fresh databases on it."""

    def __init__(self, admin_url: str, cluster: PgCluster | None) -> None:
        self.admin_url, self.cluster = admin_url, cluster

    def new_database(self) -> str:
        return create_database(self.admin_url)

    def drop(self, url: str) -> None:
        drop_database(self.admin_url, url)


@pytest.fixture(scope="session")
def pg_server():
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("PostgreSQL tests skipped: psycopg is not installed (pip install -e '.[test]')")
    external = os.environ.get(URL_ENV)
    if external:
        yield PgServer(external, None)
        return
    bindir = find_bindir()
    if bindir is None:
        _unavailable(SKIP_MESSAGE)
    cluster = PgCluster(bindir)
    try:
        cluster.start()
        yield PgServer(cluster.url, cluster)
    finally:
        cluster.destroy()


@pytest.fixture
def pg_url(pg_server):
    url = pg_server.new_database()
    yield url
    pg_server.drop(url)


@pytest.fixture
def pg_cluster(pg_server):
    """A cluster of this test's own, which it may stop and restart (needs the local binaries)."""
    bindir = find_bindir()
    if bindir is None:  # pg_server gave the external server: these tests must not restart it
        _unavailable("needs PostgreSQL server binaries to stop and restart a server of its own "
                    "(REV88_TEST_DATABASE_URL names a server the tests must not restart)")
    cluster = PgCluster(bindir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


def expire(url: str, task_id: str) -> None:
    """The task's lease past its expiry now, by the server's clock (what a replica that stopped
    renewing leaves behind), without waiting for it."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE rev88_tasks SET lease_expires_at = EXTRACT(EPOCH FROM clock_timestamp()) - 1"
                     " WHERE id = %s", (task_id,))
