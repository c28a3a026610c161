#!/usr/bin/env python3
"""The many-replica Compose stack, run for real with faults: `make compose-check` (issue #35).

compose.yaml + compose.cpu.yaml + compose.replicas.yaml: PostgreSQL and two rev88 replicas on
the shared ledger (127.0.0.1:8000 and :8001), as project ``rev88-check`` (a user's ``rev88``
project and its volumes are never touched). Steps, each printed as it passes:

 1. images: the base (pulled, or bootstrapped: deploy/bootstrap_base_image.sh), rev88:0.1.0
    (the Dockerfile, built when missing or with --build), and the ledger's PostgreSQL: the
    official postgres:15-bookworm if the engine has or can pull it, else rev88-postgres:15
    built from deploy/postgres/Containerfile (Debian's package; REV88_POSTGRES_IMAGE);
 2. from a clean state (``down -v`` of the project first), ``up -d``; both replicas ready, both
    report the ledger in PostgreSQL;
 3. draw 0 through each replica: predictions_sha256 equal to ``rev88 run --backend cpu`` here;
 4. an asynchronous task submitted on one replica is read, listed and cancelled through the other;
 5. draw 0 with eight seeds, asynchronous, on the torch cpu backend, sent to one replica; it is
    killed (SIGKILL) while it holds leases: the other finishes every task, each with the host's
    hash, those the killed one had started run again (attempts >= 2); the killed one restarted
    (the other is paused while the tasks are sent, so that the first one claims them);
 6. PostgreSQL restarted under load (tasks sent to both replicas meanwhile): 503s while it is
    down, then 202s again; every task that was accepted finishes with the host's hash;
 7. ``down -v``: no container, volume or network of the project left.

Figures to stdout and --output (default out/compose-check.json); exit 1 on any failure. Not part
of `make test` (it builds images for minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import image_check as ic  # noqa: E402  (the helpers of deploy/image_check.py)

ic.LOG_PREFIX = "[compose-check]"
ROOT = ic.ROOT
PROJECT = "rev88-check"
FILES = [str(ic.DEPLOY / name) for name in ("compose.yaml", "compose.cpu.yaml", "compose.replicas.yaml")]
PORTS = {"rev88": 8000, "rev88-b": 8001}
REV88_IMAGE = "rev88:0.1.0"
OFFICIAL_POSTGRES = "docker.io/library/postgres:15-bookworm"
LOCAL_POSTGRES = "rev88-postgres:15"
FINISHED = ("succeeded", "failed", "cancelled")
EPOCHS = 3  # the synthetic tasks' config (a second or so each on cpu-fast): sent as ?epochs=
TASKS = f"/tasks?epochs={EPOCHS}"


def compose_command() -> list[str]:
    if os.environ.get("COMPOSE"):
        return shlex.split(os.environ["COMPOSE"])
    beside = Path(sys.executable).with_name("podman-compose")
    found = shutil.which("podman-compose") or (str(beside) if beside.exists() else None)
    if found:
        return [found]
    if shutil.which("docker") and ic.sh("docker", "compose", "version", check_rc=False).returncode == 0:
        return ["docker", "compose"]
    raise ic.CheckFailed("no compose command: pip install podman-compose, or set COMPOSE='docker compose'")


class Stack:
    def __init__(self, compose: list[str], engine: str) -> None:
        self.compose, self.engine = compose, engine

    def run(self, *argv: str, check_rc: bool = True, capture: bool = True, timeout: float | None = 600):
        files = [a for f in FILES for a in ("-f", f)]
        return ic.sh(*self.compose, "-p", PROJECT, *files, *argv, check_rc=check_rc, capture=capture,
                     timeout=timeout)

    def containers(self, service: str | None = None, all_: bool = True) -> list[str]:
        argv = [self.engine, "ps", "--filter", f"label=com.docker.compose.project={PROJECT}", "--format", "{{.Names}}"]
        if all_:
            argv.insert(2, "-a")
        if service:
            argv[3:3] = ["--filter", f"label=com.docker.compose.service={service}"]
        return ic.sh(*argv, check_rc=False).stdout.split()

    def one(self, service: str) -> str:
        names = self.containers(service)
        ic.check(len(names) == 1, f"one {service} container: {names}")
        return names[0]

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        out = {"containers": self.containers()}
        out["volumes"] = ic.sh(self.engine, "volume", "ls", "--filter", label, "--format", "{{.Name}}",
                               check_rc=False).stdout.split()
        out["networks"] = [n for n in ic.sh(self.engine, "network", "ls", "--format", "{{.Name}}",
                                            check_rc=False).stdout.split() if n.startswith(PROJECT)]
        return out


def base_url(service: str) -> str:
    return f"http://127.0.0.1:{PORTS[service]}"


def get_json(url: str, timeout: float = 10) -> tuple[int, dict]:
    status, body = ic.http("GET", url, timeout=timeout)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {"raw": body[:200].decode("utf-8", "replace")}


def post(url: str, body: bytes | None, headers: dict[str, str], timeout: float = 600) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body if body is not None else b"", method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw[:200].decode("utf-8", "replace")}


NPZ = {"Content-Type": "application/octet-stream"}
ASYNC = {**NPZ, "Prefer": "respond-async"}


def wait_ready(service: str, limit_s: float) -> float:
    started = time.monotonic()
    url = base_url(service) + "/v2/health/ready"
    while time.monotonic() - started < limit_s:
        try:
            if ic.http("GET", url, timeout=2)[0] == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.25)
    raise ic.CheckFailed(f"{service} not ready within {limit_s:g} s")


def finished(service: str, task_id: str, limit_s: float = 180) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            status, doc = get_json(f"{base_url(service)}/tasks/{task_id}")
            if status == 200 and doc.get("status") in FINISHED:
                return doc
        except OSError:
            pass
        time.sleep(0.2)
    raise ic.CheckFailed(f"task {task_id} not finished through {service} within {limit_s:g} s")


def small_tasks(count: int, seed0: int, n: int = 2000, m: int = 500) -> list[tuple[bytes, str]]:
    """(npz bytes, the host's predictions_sha256 on cpu) of synthetic tasks big enough to take a
    second or so on cpu-fast (the learner here, the same code as the image's)."""
    import numpy as np

    from learner.config import make_config
    from learner.result import run_task
    from learner.taskio import task_to_npz_bytes, validate_task

    out = []
    for i in range(count):
        rng = np.random.default_rng(seed0 + i)
        task = validate_task(rng.random((n, 1, 9, 9), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64),
                             rng.random((m, 1, 9, 9), dtype=np.float32))
        out.append((task_to_npz_bytes(task), run_task(task, make_config({"epochs": EPOCHS}), "cpu").predictions_sha256))
    return out


def draw0_seeds(draw0: bytes, seeds) -> list[tuple[int, str]]:
    """(seed, the host's predictions_sha256 on cpu) of draw 0 trained with each seed."""
    from learner.config import make_config
    from learner.result import run_task
    from learner.taskio import load_task

    task = load_task(draw0)
    return [(seed, run_task(task, make_config({"seed": seed}), "cpu").predictions_sha256) for seed in seeds]


def metric(service: str, name: str) -> float | None:
    _, raw = ic.http("GET", base_url(service) + "/metrics", timeout=5)
    for line in raw.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def ensure_images(engine: str, args, figures: dict, work: Path) -> str:
    """The three images; returns the PostgreSQL image compose is to use."""
    figures["base_image"] = ic.ensure_base(engine, "auto")  # present, pulled, or bootstrapped offline
    base = ic.base_image()
    if args.build or not ic.image_present(engine, REV88_IMAGE):
        figures["rev88_build_s"] = round(ic.build(engine, REV88_IMAGE, [], False, ROOT), 1)
    postgres = args.postgres_image
    if postgres == "auto":
        if ic.image_present(engine, OFFICIAL_POSTGRES) or ic.sh(
                engine, "pull", OFFICIAL_POSTGRES, check_rc=False, timeout=120).returncode == 0:
            postgres = OFFICIAL_POSTGRES
        else:
            postgres = LOCAL_POSTGRES
    if postgres == LOCAL_POSTGRES and (args.build or not ic.image_present(engine, LOCAL_POSTGRES)):
        started = time.monotonic()
        extra = ["--format", "docker"] if ic.is_podman(engine) else []
        ic.sh(engine, "build", "--pull=never", *extra, "-f", str(ic.DEPLOY / "postgres" / "Containerfile"),
              "--build-arg", f"BASE_IMAGE={base}", "-t", LOCAL_POSTGRES, str(ROOT), capture=False, timeout=1800)
        figures["postgres_build_s"] = round(time.monotonic() - started, 1)
    figures["postgres_image"] = postgres
    ic.log(f"images: {REV88_IMAGE}, {postgres} (base {base})")
    return postgres


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--rev88", default=str(Path(sys.executable).with_name("rev88")))
    parser.add_argument("--build", action="store_true", help="rebuild the images even when present")
    parser.add_argument("--postgres-image", default="auto",
                        help=f"auto (the official image if present or pullable, else {LOCAL_POSTGRES}), or a name")
    parser.add_argument("--output", type=Path, default=ROOT / "out" / "compose-check.json")
    args = parser.parse_args(argv)

    compose = compose_command()
    podman = "podman" in Path(compose[0]).name or os.environ.get("ENGINE", "").endswith("podman")
    if podman:
        os.environ.setdefault("CONTAINERS_CONF", str(ic.DEPLOY / "podman" / "containers.conf"))
        os.environ.setdefault("BUILDAH_FORMAT", "docker")
    engine = "podman" if podman else "docker"
    stack = Stack(compose, engine)
    figures: dict = {"compose": " ".join(compose), "checked": []}
    t_all = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rev88-compose-check-"))

    def passed(what: str) -> None:
        figures["checked"].append(what)
        ic.log(f"checked: {what}")

    up = False
    try:
        version = ic.sh(*compose, "version", check_rc=False)
        figures["compose_version"] = (version.stdout or version.stderr).strip().splitlines()[:2]
        postgres = ensure_images(engine, args, figures, work)
        os.environ["REV88_POSTGRES_IMAGE"] = postgres
        os.environ["REV88_DB_PASSWORD"] = os.environ.get("REV88_DB_PASSWORD") or secrets.token_urlsafe(16)
        config = stack.run("config").stdout
        ic.check("nvidia" not in config, "the merged config has no GPU device reservation")
        for port in PORTS.values():
            try:
                ic.http("GET", f"http://127.0.0.1:{port}/v2/health/live", timeout=1)
                raise ic.CheckFailed(f"something already answers on 127.0.0.1:{port}; stop it first")
            except OSError:
                pass

        task, host_sha, _ = ic.host_reference(args.rev88, work)
        draw0 = task.read_bytes()
        burst = small_tasks(4, 100)
        seeded = draw0_seeds(draw0, range(8))
        load = small_tasks(6, 200, n=300, m=60)

        # 2. clean state, up, ready
        stack.run("down", "-v", check_rc=False)
        started = time.monotonic()
        stack.run("up", "-d", capture=False)
        up = True
        for service in PORTS:
            wait_ready(service, args.ready_timeout)
        figures["up_to_both_ready_s"] = round(time.monotonic() - started, 2)
        for service in PORTS:
            _, health = get_json(base_url(service) + "/health")
            ic.check((health.get("ledger") or {}).get("engine") == "postgresql",
                     f"{service} keeps its ledger in the postgres service")
        passed(f"clean up -d: both replicas ready {figures['up_to_both_ready_s']} s after it, ledger in PostgreSQL")

        # 3. a task through each replica
        figures["draw0"] = {}
        for service in PORTS:
            t = time.monotonic()
            status, answer = post(base_url(service) + "/tasks", draw0, NPZ)
            ic.check(status == 200, f"draw 0 through {service}: {status} {str(answer)[:200]}")
            figures["draw0"][service] = {"wall_s": round(time.monotonic() - t, 2),
                                         "backend": answer.get("metadata", {}).get("backend"),
                                         "predictions_sha256": answer["predictions_sha256"]}
            ic.check(answer["predictions_sha256"] == host_sha, f"{service}'s draw-0 hash equals the host's {host_sha}")
        passed("draw 0 through each replica: the host's predictions_sha256")

        # 4. submitted on one, read, listed and cancelled through the other
        a, b = "rev88", "rev88-b"
        status, accepted = post(base_url(a) + TASKS, burst[0][0], ASYNC)
        ic.check(status == 202, f"asynchronous task on {a}: {status}")
        first = accepted["id"]
        doc = finished(b, first)
        ic.check(doc["status"] == "succeeded" and doc["predictions_sha256"] == burst[0][1],
                 f"task {first} read through {b}: succeeded with the host's hash")
        _, listed = get_json(base_url(b) + "/tasks?limit=20")
        ic.check(first in [t["id"] for t in listed["tasks"]], f"{b} lists the task {a} accepted")
        cancelled = None
        for _ in range(5):  # a task still queued or running when the cancel arrives
            ids = [post(base_url(a) + TASKS, body, ASYNC)[1]["id"] for body, _ in burst[1:4]]
            status, doc = post(f"{base_url(b)}/tasks/{ids[-1]}/cancel", None, {})
            for i in ids:
                finished(a, i)
            if status == 200:
                cancelled = ids[-1]
                break
        ic.check(cancelled is not None, "a cancel through the other replica reached an unfinished task")
        ic.check(finished(a, cancelled)["status"] == "cancelled", f"task {cancelled}: cancelled, as {a} reads it")
        passed(f"async on {a}: read, listed and cancelled through {b}")

        # 5. kill -9 of a replica holding leases: draw 0 with 8 seeds on the torch cpu backend
        # (about a second each), all sent to a while b is paused (else b may claim every one first)
        other = stack.one(b)
        paused = ic.sh(engine, "pause", other, check_rc=False).returncode == 0
        if not paused:  # (no cgroup freezer: stopped instead, and started again below)
            ic.sh(engine, "stop", other)
        ids = {post(f"{base_url(a)}/tasks?backend=cpu&seed={seed}", draw0, ASYNC)[1]["id"]: sha
               for seed, sha in seeded}
        deadline = time.monotonic() + 60
        held = 0.0
        while time.monotonic() < deadline and held < 2:
            held = metric(a, "rev88_leases_held") or 0.0
            time.sleep(0.02)
        ic.check(held > 0, f"{a} holds leases before the kill ({held:g})")
        victim = stack.one(a)
        t_kill = time.monotonic()
        ic.sh(engine, "kill", "--signal", "KILL", victim)
        ic.sh(engine, "unpause" if paused else "start", other)
        if not paused:
            wait_ready(b, args.ready_timeout)
        docs = {i: finished(b, i, 240) for i in ids}
        _, page = get_json(base_url(b) + "/tasks?limit=100")  # (summaries carry attempts; answers do not)
        attempts = {t["id"]: t.get("attempts", 0) for t in page["tasks"]}
        rerun = sum(1 for i in ids if attempts.get(i, 0) >= 2)
        figures["kill"] = {"leases_held_at_kill": held, "all_finished_after_s": round(time.monotonic() - t_kill, 2),
                           "tasks": len(ids), "run_again_after_the_kill": rerun}
        ic.check(all(d["status"] == "succeeded" and d["predictions_sha256"] == ids[i] for i, d in docs.items()),
                 f"every one of the {len(ids)} tasks finished on {b} with the host's hash")
        ic.check(rerun >= 1, f"{rerun} task(s) the killed replica had started ran again on {b} (attempts >= 2)")
        ic.sh(engine, "start", victim, check_rc=False)
        wait_ready(a, args.ready_timeout)
        passed(f"kill -9 of {a} holding {held:g} lease(s): {b} finished all {len(ids)} tasks, {rerun} of them run "
               f"again once their leases expired ({figures['kill']['all_finished_after_s']} s), {a} started again")

        # 6. PostgreSQL restarted under load
        outcomes: list[tuple[float, str, int, str | None, str]] = []
        stop = threading.Event()

        def sender() -> None:
            k = 0
            while not stop.is_set():
                service = (a, b)[k % 2]
                body, sha = load[k % len(load)]
                try:
                    status, doc = post(base_url(service) + TASKS, body, ASYNC, timeout=30)
                except OSError as exc:
                    status, doc = -1, {"error": str(exc)}
                outcomes.append((time.monotonic(), service, status, doc.get("id") if status == 202 else None, sha))
                k += 1
                time.sleep(0.1)

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        time.sleep(3)
        pg = stack.one("postgres")
        t_restart = time.monotonic()
        ic.sh(engine, "restart", "--time", "10", pg)
        restart_s = time.monotonic() - t_restart
        time.sleep(10)
        stop.set()
        thread.join(60)
        accepted = [(svc, i, sha) for _, svc, s, i, sha in outcomes if s == 202]
        refused = [s for _, _, s, _, _ in outcomes if s != 202]
        after = [s for t, _, s, _, _ in outcomes if t > t_restart + 8]
        figures["postgres_restart"] = {"requests": len(outcomes), "accepted": len(accepted),
                                       "refused": {str(s): refused.count(s) for s in sorted(set(refused))},
                                       "restart_call_s": round(restart_s, 2)}
        ic.check(503 in refused, "503s while PostgreSQL was down")
        ic.check(bool(after) and after[-1] == 202, "202s again after PostgreSQL came back")
        for k, (service, task_id, sha) in enumerate(accepted):
            doc = finished((a, b)[k % 2], task_id, 240)  # (read through either replica)
            ic.check(doc["status"] == "succeeded" and doc["predictions_sha256"] == sha,
                     f"accepted task {task_id} ({service}): {doc['status']}, the host's hash")
        passed(f"PostgreSQL restarted under load: {len(accepted)} accepted, refusals {figures['postgres_restart']['refused']},"
               " every accepted task succeeded")

        # 7. down -v, nothing left
        t = time.monotonic()
        stack.run("down", "-v", capture=False)
        up = False
        figures["down_s"] = round(time.monotonic() - t, 2)
        left = figures["left_after_down"] = stack.leftovers()
        ic.check(not any(left.values()), f"down -v left nothing: {left}")
        passed("down -v: no container, volume or network of the project left")
        figures["passed"] = True
    except (ic.CheckFailed, KeyError, OSError) as exc:
        figures["passed"] = False
        figures["failure"] = f"{type(exc).__name__}: {exc}"
        ic.log(f"FAILED: {figures['failure']}")
        if up:
            for name in stack.containers():
                tail = ic.sh(engine, "logs", "--tail", "30", name, check_rc=False)
                ic.log(f"--- {name}:\n{(tail.stdout or '') + (tail.stderr or '')}")
    finally:
        if up:
            stack.run("down", "-v", check_rc=False)
        shutil.rmtree(work, ignore_errors=True)
    figures["wall_s"] = round(time.monotonic() - t_all, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
