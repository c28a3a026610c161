#!/usr/bin/env python3
"""Bring up compose.yaml + compose.cpu.yaml and ask it a task: `make compose-cpu-check`.

The CPU variant for hosts without an NVIDIA GPU (or without the NVIDIA Container Toolkit,
where compose.yaml's GPU reservation cannot be met). Steps:

1. the compose command: $COMPOSE (e.g. "docker compose"), else podman-compose on PATH (or
   beside this Python), else `docker compose`; with podman, deploy/podman/containers.conf
   unless CONTAINERS_CONF is set, and BUILDAH_FORMAT=docker (the HEALTHCHECK needs it) should
   compose build the image;
2. `config` must show no device reservation; `up -d` (builds rev88:0.1.0 only if it is
   missing: run `make image-check` first to build and check it; pulls postgres:15-bookworm for
   the ledger's postgres service if the engine does not have it);
3. GET /v2/health/ready = 200 on 127.0.0.1:8000 (the ready time), /health names the backend
   and a ledger in PostgreSQL;
4. posts MNIST-medium draw 0 without ?backend= (so the variant's REV88_BACKEND decides) and
   compares predictions_sha256 with `rev88 run --backend cpu` on the host;
5. `stop` (stop_grace_period applies): the container must have exited 0; then `down`.

Figures to stdout and --output (default out/compose-cpu-check.json). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import image_check as ic  # noqa: E402  (the helpers of deploy/image_check.py)

ic.LOG_PREFIX = "[compose-cpu-check]"
ROOT = ic.ROOT
FILES = ["-f", str(ic.DEPLOY / "compose.yaml"), "-f", str(ic.DEPLOY / "compose.cpu.yaml")]
PORT = 8000  # compose.yaml publishes 127.0.0.1:8000


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--rev88", default=str(Path(sys.executable).with_name("rev88")))
    parser.add_argument("--git-ref", metavar="REF",
                        help="run the host's reference from the committed tree at REF (git archive)")
    parser.add_argument("--output", type=Path, default=ROOT / "out" / "compose-cpu-check.json")
    args = parser.parse_args(argv)

    compose = compose_command()
    podman = "podman" in Path(compose[0]).name or os.environ.get("ENGINE", "").endswith("podman")
    if podman:
        os.environ.setdefault("CONTAINERS_CONF", str(ic.DEPLOY / "podman" / "containers.conf"))
        os.environ.setdefault("BUILDAH_FORMAT", "docker")
    engine = "podman" if podman else "docker"
    figures: dict = {"compose": " ".join(compose)}
    work = Path(tempfile.mkdtemp(prefix="rev88-compose-check-"))
    up = False
    try:
        version = ic.sh(*compose, "version", check_rc=False)
        figures["compose_version"] = (version.stdout or version.stderr).strip().splitlines()[:2]
        ic.log(f"{figures['compose']}: {figures['compose_version']}")
        config = ic.sh(*compose, *FILES, "config").stdout
        figures["config_has_devices"] = "devices" in config or "nvidia" in config
        ic.check(not figures["config_has_devices"], "the merged config has no GPU device reservation")

        source = ic.git_context(args.git_ref, work) if args.git_ref else None
        task, host_sha, _ = ic.host_reference(args.rev88, work, source)
        figures["host_predictions_sha256"] = host_sha
        try:
            ic.http("GET", f"http://127.0.0.1:{PORT}/v2/health/live", timeout=1)
            raise ic.CheckFailed(f"something already answers on 127.0.0.1:{PORT}; stop it first")
        except OSError:
            pass

        started = time.monotonic()
        ic.sh(*compose, *FILES, "up", "-d", capture=False)
        up = True
        name = ic.sh(engine, "ps", "-a", "--filter", "label=com.docker.compose.project=rev88",
                     "--filter", "label=com.docker.compose.service=rev88", "--format", "{{.Names}}").stdout.split()
        ic.check(len(name) == 1, f"one rev88 container (beside the postgres one): {name}")
        name = name[0]
        base = f"http://127.0.0.1:{PORT}"
        figures["ready_s"] = round(ic.wait_ready(base, engine, name, started, args.ready_timeout), 2)
        ic.log(f"ready {figures['ready_s']} s after `up -d`")
        _, health = ic.http("GET", base + "/health")
        health = json.loads(health)
        figures["health"] = {k: health.get(k) for k in ("status", "backend", "device") if k in health}
        figures["ledger_engine"] = (health.get("ledger") or {}).get("engine")
        ic.check(figures["ledger_engine"] == "postgresql", "the ledger is in the postgres service")

        start = time.monotonic()
        answer = ic.post_task(base, task.read_bytes(), "")
        figures["task_wall_s"] = round(time.monotonic() - start, 2)
        figures["task_backend"] = answer.get("metadata", {}).get("backend")
        figures["task_run_ms"] = answer.get("timing", {}).get("run_ms")
        sha = figures["container_predictions_sha256"] = answer["predictions_sha256"]
        ic.check(sha == host_sha, f"POST /tasks (backend {figures['task_backend']}): {sha} equals the host's")
        ic.check(figures["task_backend"] == "cpu-fast", "the variant's REV88_BACKEND=cpu-fast served it")

        start = time.monotonic()
        ic.sh(*compose, *FILES, "stop", capture=False)
        figures["stop_s"] = round(time.monotonic() - start, 2)
        figures["exit_code"] = int(ic.sh(engine, "inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip())
        ic.check(figures["exit_code"] == 0, f"`stop` ({figures['stop_s']} s): exit code {figures['exit_code']}")
        ic.sh(*compose, *FILES, "down", capture=False)
        up = False
        exits = ic.sh(engine, "ps", "-a", "--filter", "label=com.docker.compose.project=rev88",
                      "--format", "{{.ExitCode}}", check_rc=False).stdout.split()
        figures["left_after_down"] = exits
        ic.check(not exits, "down removed the containers")
        figures["passed"] = True
    except ic.CheckFailed as exc:
        figures["passed"] = False
        figures["failure"] = str(exc)
        ic.log(f"FAILED: {exc}")
    finally:
        if up:
            ic.sh(*compose, *FILES, "down", check_rc=False)
        shutil.rmtree(work, ignore_errors=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
