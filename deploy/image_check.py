#!/usr/bin/env python3
"""Build the Dockerfile and run the image for real: `make image-check`.

What it does, in order (each step prints its figure; any failed check exits 1):

1. picks the engine: $ENGINE, else podman, else docker. With podman and no CONTAINERS_CONF,
   deploy/podman/containers.conf is used (the settings the project's build VM needs);
2. makes sure the Dockerfile's base image is there: present, else pulled, else (podman,
   no registry reachable) bootstrapped from Debian packages by deploy/bootstrap_base_image.sh;
3. builds the image (`--pull=never`; podman: `--format docker`, which HEALTHCHECK needs) and
   reports the build time and the image size;
4. makes MNIST-medium draw 0 on the host (`rev88 make-task`, bundled data) and trains it with
   `rev88 run --backend cpu`: the reference predictions hash;
5. runs the image as a user would, read-only (`--read-only --tmpfs /tmp`), port on loopback,
   waits for GET /v2/health/ready = 200 (the ready time), runs the image's own HEALTHCHECK;
6. posts the same task with ?backend=cpu and ?backend=cpu-fast: both hashes must equal the
   host's (cpu-fast proves the compiled kernel is in the installed package);
7. checks the server process is not root (/proc/1/status inside: real, effective, saved and
   filesystem uid all non-zero; `id -u` agrees) and that the root filesystem refuses writes;
8. starts a longer task (more epochs), sends SIGTERM (`stop --time GRACE`) while it runs, and
   checks that the task is still answered 200 and that the container exits 0 well within the
   grace period (compose.yaml's stop_grace_period); then starts the container again and
   stops it idle (exit 0 again, and the stop time without work to drain).

Figures go to stdout and to --output (JSON, default out/image-check.json). Not part of
`make test`: the build downloads several GB (PyPI's CUDA torch) and takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DRAW0_SEED = 2026091400
PORT_IN_CONTAINER = 8000


class CheckFailed(Exception):
    pass


LOG_PREFIX = "[image-check]"


def log(msg: str) -> None:
    print(f"{LOG_PREFIX} {msg}", flush=True)


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise CheckFailed(msg)
    log(f"ok: {msg}")


def sh(*argv: str, check_rc: bool = True, capture: bool = True, timeout: float | None = None,
       env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), text=True, capture_output=capture, timeout=timeout, env=env)
    if check_rc and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip()[-2000:] if capture else ""
        raise CheckFailed(f"{' '.join(argv)} exited {proc.returncode}: {detail}")
    return proc


def pick_engine() -> str:
    engine = os.environ.get("ENGINE") or next((e for e in ("podman", "docker") if shutil.which(e)), None)
    if not engine:
        raise CheckFailed("no container engine: install podman (or docker), or set ENGINE")
    if Path(engine).name == "podman" and not os.environ.get("CONTAINERS_CONF"):
        os.environ["CONTAINERS_CONF"] = str(DEPLOY / "podman" / "containers.conf")
        log(f"CONTAINERS_CONF={os.environ['CONTAINERS_CONF']}")
    return engine


def is_podman(engine: str) -> bool:
    return Path(engine).name == "podman"


def base_image() -> str:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            return words[1]
    raise CheckFailed("Dockerfile has no FROM")


def image_present(engine: str, name: str) -> bool:
    return sh(engine, "image", "inspect", name, check_rc=False).returncode == 0


def ensure_base(engine: str, how: str) -> str:
    name = base_image()
    if how in ("auto", "present") and image_present(engine, name):
        log(f"base image {name}: present")
        return "present"
    if how == "present":
        raise CheckFailed(f"base image {name} is not present (--base present)")
    if how in ("auto", "pull"):
        log(f"base image {name}: pulling")
        if sh(engine, "pull", name, check_rc=False, capture=False, timeout=900).returncode == 0:
            return "pulled"
        if how == "pull":
            raise CheckFailed(f"could not pull {name}")
        log("pull failed (no registry reachable?): bootstrapping the offline stand-in")
    if not is_podman(engine):
        raise CheckFailed("the offline base image bootstrap needs podman (deploy/bootstrap_base_image.sh)")
    sh("bash", str(DEPLOY / "bootstrap_base_image.sh"), capture=False,
       env={**os.environ, "ENGINE": engine, "FORCE": "1" if how == "bootstrap" else ""})
    return "bootstrapped (deploy/bootstrap_base_image.sh)"


def git_context(ref: str, work: Path) -> Path:
    """The committed tree at REF as a build context (what a clean clone would build)."""
    context = work / "context"
    context.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True)
    if archive.returncode != 0:
        raise CheckFailed(f"git archive {ref}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(context)], input=archive.stdout, check=True)
    return context


def build(engine: str, tag: str, build_args: list[str], no_cache: bool, context: Path) -> float:
    argv = [engine, "build", "--pull=never", "-t", tag, "-f", str(context / "Dockerfile")]
    if is_podman(engine):
        argv += ["--format", "docker"]  # HEALTHCHECK is a docker-format field
    if no_cache:
        argv.append("--no-cache")
    for arg in build_args:
        argv += ["--build-arg", arg]
    argv.append(str(context))
    log(" ".join(argv))
    start = time.monotonic()
    sh(*argv, capture=False)
    return time.monotonic() - start


def image_size_bytes(engine: str, tag: str) -> int:
    return int(sh(engine, "image", "inspect", tag, "--format", "{{.Size}}").stdout.strip())


def host_reference(rev88: str, work: Path, source: Path | None = None) -> tuple[Path, str, float]:
    """Draw 0 made and trained on the host (cpu backend). With SOURCE (a git-archive tree),
    the host runs that tree's code (python -m rev88, PYTHONPATH=SOURCE), the same commit as
    the image, instead of the installed package."""
    task, labels, run = work / "task.npz", work / "labels.npy", work / "run.json"
    cmd, env = [rev88], None
    if source is not None:
        cmd = [str(Path(rev88).with_name("python")), "-m", "rev88"]
        env = {**os.environ, "PYTHONPATH": str(source)}
    sh(*cmd, "make-task", "--dataset-seed", str(DRAW0_SEED), "--output", str(task), "--labels-output", str(labels),
       env=env)
    start = time.monotonic()
    sh(*cmd, "run", "--input", str(task), "--backend", "cpu", "--output", str(run), env=env)
    seconds = time.monotonic() - start
    return task, json.loads(run.read_text())["predictions_sha256"], seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/octet-stream")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_ready(base: str, engine: str, name: str, started: float, limit_s: float) -> float:
    while time.monotonic() - started < limit_s:
        try:
            status, _ = http("GET", base + "/v2/health/ready", timeout=2)
            if status == 200:
                return time.monotonic() - started
        except (OSError, urllib.error.URLError):
            pass
        state = sh(engine, "inspect", name, "--format", "{{.State.Status}}", check_rc=False).stdout.strip()
        if state in ("exited", "stopped", "dead"):
            raise CheckFailed(f"container {state} before it was ready:\n" + logs(engine, name))
        time.sleep(0.25)
    raise CheckFailed(f"not ready after {limit_s:.0f} s:\n" + logs(engine, name))


def logs(engine: str, name: str) -> str:
    proc = sh(engine, "logs", "--tail", "40", name, check_rc=False)
    return (proc.stdout or "") + (proc.stderr or "")


def post_task(base: str, task: bytes, query: str, timeout: float = 600) -> dict:
    status, body = http("POST", f"{base}/tasks?{query}", task, timeout=timeout)
    if status != 200:
        raise CheckFailed(f"POST /tasks?{query}: {status} {body[:500]!r}")
    return json.loads(body)


def proc1_uids(engine: str, name: str) -> list[int]:
    status = sh(engine, "exec", name, "cat", "/proc/1/status").stdout
    match = re.search(r"^Uid:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", status, re.M)
    if not match:
        raise CheckFailed("no Uid line in /proc/1/status")
    return [int(v) for v in match.groups()]


def in_flight(base: str) -> float:
    _, body = http("GET", base + "/metrics", timeout=5)
    match = re.search(r"^rev88_tasks_in_flight\s+(\S+)", body.decode(), re.M)
    return float(match[1]) if match else 0.0


def stop_grace_s() -> int:
    text = (DEPLOY / "compose.yaml").read_text()
    match = re.search(r"^\s*stop_grace_period:\s*(\d+)s\s*$", text, re.M)
    return int(match[1]) if match else 45


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="rev88:0.1.0", help="image tag to build and run [rev88:0.1.0]")
    parser.add_argument("--base", choices=("auto", "present", "pull", "bootstrap"), default="auto",
                        help="where the FROM image comes from [auto: present, else pull, else bootstrap]")
    parser.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-cache", action="store_true", help="build every layer afresh")
    parser.add_argument("--skip-build", action="store_true", help="run the image already tagged --tag")
    parser.add_argument("--git-ref", metavar="REF",
                        help="build (and run on the host) the committed tree at REF (git archive) "
                             "instead of the working tree")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--drain-epochs", type=int, default=4,
                        help="epochs of the (cpu backend) task that is running when SIGTERM arrives: "
                             "it must finish within the 30 s drain [4]")
    parser.add_argument("--rev88", default=str(Path(sys.executable).with_name("rev88")),
                        help="the host's rev88 command [the one beside this Python]")
    parser.add_argument("--output", type=Path, default=ROOT / "out" / "image-check.json")
    args = parser.parse_args(argv)

    figures: dict = {"tag": args.tag}
    engine = pick_engine()
    figures["engine"] = sh(engine, "--version").stdout.strip()
    log(figures["engine"])
    name = f"rev88-image-check-{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix="rev88-image-check-"))
    context = None
    try:
        if not args.skip_build:
            figures["base_image"] = f"{base_image()}: {ensure_base(engine, args.base)}"
            context = git_context(args.git_ref, work) if args.git_ref else None
            figures["build_context"] = f"git archive {args.git_ref}" if args.git_ref else "working tree"
            if args.git_ref:
                figures["build_commit"] = sh("git", "-C", str(ROOT), "rev-parse", args.git_ref).stdout.strip()
            figures["build_s"] = round(build(engine, args.tag, args.build_arg, args.no_cache, context or ROOT), 1)
            figures["build_args"] = args.build_arg
            figures["build_no_cache"] = args.no_cache
            log(f"build: {figures['build_s']} s")
        size = image_size_bytes(engine, args.tag)
        figures["image_size_bytes"] = size
        figures["image_size"] = f"{size / 1e9:.2f} GB"
        log(f"image size: {figures['image_size']} ({size} bytes)")

        if args.git_ref and context is None:
            context = git_context(args.git_ref, work)
        task, host_sha, host_s = host_reference(args.rev88, work, context if args.git_ref else None)
        figures["host_predictions_sha256"] = host_sha
        figures["host_run_s"] = round(host_s, 2)
        log(f"host rev88 run --backend cpu: {host_sha} ({host_s:.1f} s)")
        body = task.read_bytes()

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        grace = stop_grace_s()
        figures["stop_grace_s"] = grace
        started = time.monotonic()
        sh(engine, "run", "-d", "--name", name, "--read-only", "--tmpfs", "/tmp",
           "-p", f"127.0.0.1:{port}:{PORT_IN_CONTAINER}", "--stop-timeout", str(grace), args.tag)
        figures["ready_s"] = round(wait_ready(base, engine, name, started, args.ready_timeout), 2)
        log(f"ready (GET /v2/health/ready = 200) {figures['ready_s']} s after `run`")
        status, health = http("GET", base + "/health")
        health = json.loads(health)
        figures["health_backend"] = health.get("backend") or health.get("device")
        if is_podman(engine):
            rc = sh(engine, "healthcheck", "run", name, check_rc=False).returncode
            check(rc == 0, "the image's HEALTHCHECK passes (podman healthcheck run)")
        else:
            figures["docker_health"] = sh(engine, "inspect", name, "--format", "{{.State.Health.Status}}",
                                          check_rc=False).stdout.strip()

        for backend in ("cpu", "cpu-fast"):
            start = time.monotonic()
            answer = post_task(base, body, f"backend={backend}")
            wall = time.monotonic() - start
            sha = answer["predictions_sha256"]
            figures[f"container_{backend}_predictions_sha256"] = sha
            figures[f"container_{backend}_wall_s"] = round(wall, 2)
            figures[f"container_{backend}_run_ms"] = answer.get("timing", {}).get("run_ms")
            check(sha == host_sha, f"POST /tasks?backend={backend}: predictions_sha256 {sha} equals the host's "
                                   f"({wall:.2f} s wall)")

        uids = proc1_uids(engine, name)
        figures["proc1_uids"] = uids
        check(all(u != 0 for u in uids), f"PID 1 runs as uid {uids[0]} (real, effective, saved, fs: {uids})")
        id_u = int(sh(engine, "exec", name, "id", "-u").stdout.strip())
        figures["exec_id_u"] = id_u
        check(id_u == uids[0] and id_u != 0, f"`exec id -u` = {id_u}")
        wrote_root = sh(engine, "exec", name, "sh", "-c", "touch /opt/rev88/.w", check_rc=False).returncode
        wrote_tmp = sh(engine, "exec", name, "sh", "-c", "touch /tmp/.w && rm /tmp/.w", check_rc=False).returncode
        check(wrote_root != 0 and wrote_tmp == 0, "root filesystem is read-only, /tmp is writable")

        # SIGTERM while a task runs: it must still be answered, then the process exits 0.
        result: dict = {}

        def long_task() -> None:
            try:
                result["answer"] = post_task(base, body, f"backend=cpu&epochs={args.drain_epochs}")
                result["answered_at"] = time.monotonic()
            except Exception as exc:  # reported below
                result["error"] = repr(exc)

        worker = threading.Thread(target=long_task)
        worker.start()
        deadline = time.monotonic() + 30
        while in_flight(base) < 1 and time.monotonic() < deadline and worker.is_alive():
            time.sleep(0.05)
        check(worker.is_alive(), "a task is in flight when SIGTERM is sent")
        start = time.monotonic()
        sh(engine, "stop", "--time", str(grace), name, timeout=grace + 30)
        stop_s = time.monotonic() - start
        worker.join(60)
        figures["stop_s"] = round(stop_s, 2)
        exit_code = int(sh(engine, "inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip())
        figures["exit_code"] = exit_code
        log(f"stop with a task in flight: {stop_s:.2f} s, exit code {exit_code}")
        check("answer" in result, f"the in-flight task was answered 200 during the drain ({result.get('error', 'ok')})")
        figures["drained_task_run_ms"] = result["answer"].get("timing", {}).get("run_ms")
        after = figures["drained_task_answered_after_sigterm_s"] = round(result["answered_at"] - start, 2)
        check(after > 0, f"the task was answered {after} s after `stop` began (it ran during the drain)")
        check(exit_code == 0, f"exit code {exit_code} after SIGTERM")
        check(stop_s < grace, f"exited in {stop_s:.2f} s, within the {grace} s grace period (no SIGKILL)")

        # And an idle stop: start the same container again, wait until ready, SIGTERM.
        started = time.monotonic()
        sh(engine, "start", name)
        figures["restart_ready_s"] = round(wait_ready(base, engine, name, started, args.ready_timeout), 2)
        start = time.monotonic()
        sh(engine, "stop", "--time", str(grace), name, timeout=grace + 30)
        figures["idle_stop_s"] = round(time.monotonic() - start, 2)
        idle_code = int(sh(engine, "inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip())
        figures["idle_exit_code"] = idle_code
        check(idle_code == 0 and figures["idle_stop_s"] < grace,
              f"restarted (ready in {figures['restart_ready_s']} s), idle stop: {figures['idle_stop_s']} s, "
              f"exit code {idle_code}")
        figures["passed"] = True
    except CheckFailed as exc:
        figures["passed"] = False
        figures["failure"] = str(exc)
        log(f"FAILED: {exc}")
    finally:
        if sh(engine, "container", "exists", name, check_rc=False).returncode == 0 or not is_podman(engine):
            tail = logs(engine, name)
            if tail.strip():
                figures["container_log_tail"] = tail.strip().splitlines()[-12:]
        sh(engine, "rm", "-f", name, check_rc=False)
        shutil.rmtree(work, ignore_errors=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2) + "\n")
    log(f"figures: {args.output}")
    print(json.dumps({k: v for k, v in figures.items() if k != "container_log_tail"}, indent=2))
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
