#!/usr/bin/env python3
"""The Kubernetes manifests under `podman kube play`: `make kube-check` (issue #35).

No API server runs here, so the manifests are played with podman where it supports their kinds,
and what it does not do is done by this script from the manifests' own text, each step said:

  Secret         podman 4.3's kube play does not create them from YAML: each Secret of
                 deploy/k8s/postgres/postgres.yaml becomes a podman secret (its values, base64,
                 as a JSON object: the form podman's secretKeyRef reads)
  StatefulSet    not a kind podman plays: its pod template is played as the pod rev88-postgres-0,
                 its volumeClaimTemplate as the PersistentVolumeClaim data-rev88-postgres-0
  Deployment     podman plays one pod per Deployment: the template is played as two pods,
                 rev88-0 and rev88-1 (replicas on the shared ledger), without the GPU request
                 (nvidia.com/gpu) and with REV88_BACKEND=cpu-fast, the image's CPU kernel
  probes         podman 4.3 does not run readiness or startup probes: this script runs each
                 container's own startupProbe and readinessProbe (httpGet on the pod's address,
                 exec in the container) at their periods and thresholds, and a pod is ready when
                 they pass
  emptyDir       podman makes each a named volume of the volume's name, shared by every pod that
                 names it: each rev88 pod's are renamed <pod>-<name>
  containerPort  podman publishes one without a hostPort on the host's same port (two pods on 8000
                 collide): each gets a loopback hostPort (15432, 18000, 18001)
  Service        not played (no kube-proxy): the rev88 pods reach PostgreSQL through a hostAlias
                 rev88-postgres -> the database pod's address, as the Service's name would
  HPA, service.yaml, hpa-shared-queue.yaml   schema-validated only (tests/test_deploy_manifests.py)

Then draw 0 through each rev88 pod (the host's predictions_sha256), an asynchronous task
accepted by one and read through the other, and everything torn down (pods, PVC, secrets,
network). Figures to stdout and --output (default out/kube-check.json). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import image_check as ic  # noqa: E402  (the helpers of deploy/image_check.py)

ic.LOG_PREFIX = "[kube-check]"
ROOT = ic.ROOT
K8S = ic.DEPLOY / "k8s"
NETWORK = "rev88-kube-check"
REV88_IMAGE = "rev88:0.1.0"
POSTGRES_IMAGES = ("docker.io/library/postgres:15-bookworm", "rev88-postgres:15")
REPLICAS = ("rev88-0", "rev88-1")


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(items: list[dict], kind: str) -> list[dict]:
    return [d for d in items if d.get("kind") == kind]


def podman(*argv: str, **kw):
    return ic.sh("podman", *argv, **kw)


def secret_payload(secret: dict) -> str:
    values = dict(secret.get("data") or {})
    for key, value in (secret.get("stringData") or {}).items():
        values[key] = base64.b64encode(str(value).encode()).decode()
    return json.dumps(values)


def statefulset_pod(sts: dict, image: str) -> list[dict]:
    """A StatefulSet's first pod and its volume claims, as podman plays them."""
    name = sts["metadata"]["name"] + "-0"
    template = copy.deepcopy(sts["spec"]["template"])
    claims = []
    for claim in sts["spec"].get("volumeClaimTemplates", []):
        claim_name = f"{claim['metadata']['name']}-{name}"
        claims.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim_name},
                       "spec": claim["spec"]})
        template["spec"].setdefault("volumes", []).append(
            {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}})
    for c in template["spec"]["containers"]:
        c["image"] = image
    pin_host_ports(template["spec"], 15432)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": template["metadata"]["labels"]},
           "spec": template["spec"]}
    return [*claims, pod]


def pin_host_ports(spec: dict, first: int) -> None:
    """podman 4.3 publishes a containerPort without a hostPort on the host's same port (two pods
    on 8000 collide): each gets a hostPort of its own, on loopback only."""
    for c in spec["containers"]:
        for i, port in enumerate(c.get("ports", [])):
            port.setdefault("hostPort", first + i)
            port.setdefault("hostIP", "127.0.0.1")


def deployment_pod(dep: dict, name: str, postgres_ip: str) -> dict:
    template = copy.deepcopy(dep["spec"]["template"])
    spec = template["spec"]
    spec["hostAliases"] = [{"ip": postgres_ip, "hostnames": ["rev88-postgres"]}]  # (the Service's name)
    # podman 4.3 makes an emptyDir a named volume of the volume's name, the same for every pod:
    # each pod's get its own (<pod>-<name>), so two pods do not share a data folder
    renamed = {v["name"]: f"{name}-{v['name']}" for v in spec.get("volumes", []) if "emptyDir" in v}
    for v in spec.get("volumes", []):
        v["name"] = renamed.get(v["name"], v["name"])
    for c in spec["containers"]:
        for m in c.get("volumeMounts", []):
            m["name"] = renamed.get(m["name"], m["name"])
        c["image"] = REV88_IMAGE
        for part in ("requests", "limits"):
            (c.get("resources") or {}).get(part, {}).pop("nvidia.com/gpu", None)
        for env in c.get("env", []):
            if env["name"] == "REV88_BACKEND":
                env["value"] = "cpu-fast"
    pin_host_ports(spec, 18000 + REPLICAS.index(name) if name in REPLICAS else 18000)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": template["metadata"]["labels"],
                                                           "annotations": template["metadata"].get("annotations", {})},
            "spec": spec}


def pod_ip(pod: str) -> str:
    infra = podman("pod", "inspect", pod, "--format", "{{.InfraContainerID}}").stdout.strip()
    ip = podman("inspect", infra, "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}").stdout
    ic.check(bool(ip.strip()), f"pod {pod} has an address")
    return ip.strip()


def run_probe(kind: str, probe: dict, container: str, ip: str, ports: dict[str, int]) -> bool:
    timeout = probe.get("timeoutSeconds", 1)
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        port = ports.get(port, port) if isinstance(port, str) else port
        try:
            return 200 <= ic.http("GET", f"http://{ip}:{port}{probe['httpGet']['path']}", timeout=timeout)[0] < 400
        except OSError:
            return False
    if "exec" in probe:
        return podman("exec", container, *probe["exec"]["command"], check_rc=False,
                      timeout=timeout + 5).returncode == 0
    raise ic.CheckFailed(f"{container}: a {kind} probe of a kind this check does not run: {probe}")


def wait_probes(pod: dict, limit_s: float) -> float:
    """Each container's startupProbe, then readinessProbe, at their periods and thresholds."""
    started = time.monotonic()
    ip = pod_ip(pod["metadata"]["name"])
    for c in pod["spec"]["containers"]:
        name = f"{pod['metadata']['name']}-{c['name']}"
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
        for kind in ("startupProbe", "readinessProbe"):
            probe = c.get(kind)
            if not probe:
                continue
            period = probe.get("periodSeconds", 10)
            allowed = probe.get("failureThreshold", 3) if kind == "startupProbe" else None
            time.sleep(probe.get("initialDelaySeconds", 0))
            failures = 0
            while not run_probe(kind, probe, name, ip, ports):
                failures += 1
                state = podman("inspect", name, "--format", "{{.State.Status}} {{.State.ExitCode}}",
                               check_rc=False).stdout.strip()
                if state.startswith(("exited", "stopped")) and failures > 3:
                    raise ic.CheckFailed(f"{name} {state} during its {kind}:\n" + ic.logs("podman", name))
                if allowed is not None and failures >= allowed:
                    raise ic.CheckFailed(f"{name}: {kind} failed {failures} times (its failureThreshold)")
                if time.monotonic() - started > limit_s:
                    raise ic.CheckFailed(f"{name}: {kind} not passing within {limit_s:g} s")
                time.sleep(min(period, 1.0) if kind == "readinessProbe" else period)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev88", default=str(Path(sys.executable).with_name("rev88")))
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--output", type=Path, default=ROOT / "out" / "kube-check.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("CONTAINERS_CONF", str(ic.DEPLOY / "podman" / "containers.conf"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a stop still tears everything down)
    figures: dict = {"podman": podman("version", "--format", "{{.Client.Version}}", check_rc=False).stdout.strip(),
                     "checked": [], "played": [], "not_played": []}
    t_all = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rev88-kube-check-"))
    made: dict[str, list[str]] = {"files": [], "secrets": [], "volumes": []}

    def passed(what: str) -> None:
        figures["checked"].append(what)
        ic.log(f"checked: {what}")

    try:
        ic.check(ic.image_present("podman", REV88_IMAGE), f"{REV88_IMAGE} is built (make image-check or "
                                                          "make compose-check builds it)")
        postgres_image = next((i for i in POSTGRES_IMAGES if ic.image_present("podman", i)), None)
        ic.check(postgres_image is not None, f"a PostgreSQL image: one of {POSTGRES_IMAGES} (make postgres-image)")
        figures["postgres_image"] = postgres_image
        database = docs(K8S / "postgres" / "postgres.yaml")
        deployment = by_kind(docs(K8S / "deployment.yaml"), "Deployment")[0]
        figures["not_played"] = [f"{d['kind']}/{d['metadata']['name']}" for d in
                                 by_kind(database, "Service") + docs(K8S / "service.yaml") + docs(K8S / "hpa.yaml")
                                 + docs(K8S / "hpa-shared-queue.yaml")]
        task, host_sha, _ = ic.host_reference(args.rev88, work)
        podman("network", "rm", "-f", NETWORK, check_rc=False)
        podman("network", "create", NETWORK)

        for secret in by_kind(database, "Secret"):
            name = secret["metadata"]["name"]
            podman("secret", "rm", name, check_rc=False)
            payload = work / f"secret-{name}.json"
            payload.write_text(secret_payload(secret))
            podman("secret", "create", name, str(payload))
            made["secrets"].append(name)
        figures["played"].append("Secret/" + ", Secret/".join(made["secrets"]) + " (as podman secrets)")

        t = time.monotonic()
        [sts] = by_kind(database, "StatefulSet")
        pg_docs = statefulset_pod(sts, postgres_image)
        pg_file = work / "postgres-pod.yaml"
        pg_file.write_text(yaml.safe_dump_all(pg_docs))
        podman("kube", "play", "--network", NETWORK, str(pg_file), capture=False, timeout=300)
        made["files"].append(str(pg_file))
        made["volumes"] += [d["metadata"]["name"] for d in pg_docs if d["kind"] == "PersistentVolumeClaim"]
        pg_pod = pg_docs[-1]
        figures["postgres_ready_s"] = round(wait_probes(pg_pod, args.ready_timeout), 2)
        figures["played"].append(f"StatefulSet/{sts['metadata']['name']} (its pod {pg_pod['metadata']['name']} and "
                                 f"PVC {', '.join(made['volumes'])})")
        passed(f"PostgreSQL pod ready through its own readinessProbe (pg_isready) in {figures['postgres_ready_s']} s")
        pg_ip = pod_ip(pg_pod["metadata"]["name"])

        rev88_pods = [deployment_pod(deployment, name, pg_ip) for name in REPLICAS]
        figures["ready_s"] = {}
        for pod in rev88_pods:
            path = work / f"{pod['metadata']['name']}.yaml"
            path.write_text(yaml.safe_dump(pod))
            podman("kube", "play", "--network", NETWORK, str(path), capture=False, timeout=300)
            made["files"].append(str(path))
        for pod in rev88_pods:
            figures["ready_s"][pod["metadata"]["name"]] = round(wait_probes(pod, args.ready_timeout), 2)
        figures["played"].append(f"Deployment/{deployment['metadata']['name']} (two pods from its template: "
                                 f"{', '.join(REPLICAS)})")
        passed(f"two rev88 pods ready through their own startupProbe and readinessProbe: {figures['ready_s']}")

        urls = {name: f"http://{pod_ip(name)}:8000" for name in REPLICAS}
        body = task.read_bytes()
        figures["draw0"] = {}
        for name, url in urls.items():
            status, raw = ic.http("POST", url + "/tasks", body, timeout=600)
            answer = json.loads(raw)
            ic.check(status == 200, f"draw 0 through {name}: {status}")
            figures["draw0"][name] = answer["predictions_sha256"]
            ic.check(answer["predictions_sha256"] == host_sha, f"{name}'s draw-0 hash is the host's")
        health = json.loads(ic.http("GET", urls[REPLICAS[1]] + "/health")[1])
        ic.check((health.get("ledger") or {}).get("engine") == "postgresql", "the pods' ledger is the database pod")
        passed("draw 0 through each rev88 pod: the host's predictions_sha256; the ledger in the PostgreSQL pod")

        import urllib.request

        request = urllib.request.Request(urls[REPLICAS[0]] + "/tasks", data=body, method="POST",
                                         headers={"Content-Type": "application/octet-stream",
                                                  "Prefer": "respond-async"})
        with urllib.request.urlopen(request, timeout=60) as r:
            task_id = json.loads(r.read())["id"]
        deadline = time.monotonic() + 120
        doc: dict = {}
        while time.monotonic() < deadline:
            doc = json.loads(ic.http("GET", f"{urls[REPLICAS[1]]}/tasks/{task_id}")[1])
            if doc.get("status") in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.2)
        ic.check(doc.get("status") == "succeeded" and doc.get("predictions_sha256") == host_sha,
                 f"task {task_id} accepted by {REPLICAS[0]} read through {REPLICAS[1]}: succeeded, the host's hash")
        passed(f"an asynchronous task accepted by {REPLICAS[0]} read through {REPLICAS[1]}")
        figures["passed"] = True
    except (ic.CheckFailed, KeyError, OSError, ValueError) as exc:
        figures["passed"] = False
        figures["failure"] = f"{type(exc).__name__}: {exc}"
        ic.log(f"FAILED: {figures['failure']}")
        for name in [*REPLICAS, "rev88-postgres-0"]:
            tail = podman("pod", "logs", "--tail", "20", name, check_rc=False)
            if tail.returncode == 0:
                ic.log(f"--- {name}:\n{tail.stdout}{tail.stderr}")
    finally:
        t = time.monotonic()
        for path in reversed(made["files"]):
            podman("kube", "down", path, check_rc=False)
        for name in made["volumes"]:
            podman("volume", "rm", "-f", name, check_rc=False)
        podman("volume", "prune", "-f", check_rc=False)  # the emptyDirs and the image's anonymous volume
        for name in made["secrets"]:
            podman("secret", "rm", name, check_rc=False)
        podman("network", "rm", "-f", NETWORK, check_rc=False)
        figures["teardown_s"] = round(time.monotonic() - t, 2)
        left = podman("pod", "ps", "--format", "{{.Name}}", check_rc=False).stdout.split()
        figures["pods_left"] = [p for p in left if p in (*REPLICAS, "rev88-postgres-0")]
        if figures["pods_left"]:
            figures["passed"] = False
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    figures["wall_s"] = round(time.monotonic() - t_all, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0 if figures.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
