"""Static checks of the Dockerfile, deploy/compose.yaml and deploy/k8s/ against the app itself:
routes the probes hit, the default port, the settings' variable names, the drain timeout,
non-root users and GPU requests. (No Docker engine or cluster is needed, or used.)"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from app.service import FORCE_EXIT_GRACE_S
from app.settings import Settings
from rev88.cli.serve import SERVE_ENV, add_serve, cmd_serve, graceful_shutdown_s

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DEFAULTS = Settings()
ENV_NAMES = set(SERVE_ENV.values())


# --------------------------------------------------------------------------- helpers


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    out, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def instructions(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def dockerfile_env() -> dict[str, str]:
    env = {}
    for args in instructions("ENV"):
        for item in shlex.split(args):
            key, sep, value = item.partition("=")
            assert sep, f"ENV {args!r}: use KEY=value"
            env[key] = value
    return env


@pytest.fixture(scope="module")
def routes() -> dict[str, set[str]]:
    """path -> HTTP methods, from the real app (cpu backend: nothing starts until the lifespan)."""
    from fastapi.routing import iter_route_contexts

    from app.main import create_app

    app = create_app(Settings(backend="cpu"))
    table: dict[str, set[str]] = {}
    for route in iter_route_contexts(app.routes):  # (the routes of the routers the app includes too)
        methods = getattr(route, "methods", None) or set()
        table.setdefault(route.path, set()).update(methods)
    return table


def probe_url(text: str) -> tuple[int, str]:
    """The (port, path) a python/urllib health check asks."""
    found = re.findall(r"http://127\.0\.0\.1:(\d+)(/[\w/.-]*)", text)
    assert len(found) == 1, f"expected one loopback URL in {text!r}"
    return int(found[0][0]), found[0][1]


class Reset:
    """Compose's `!reset` tag: the override file removes the value it stands on."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Reset) and other.value == self.value


class ComposeLoader(yaml.SafeLoader):
    """Safe YAML plus the Compose specification's merge tags (!reset, !override)."""


def _tagged(kind):
    def construct(loader, node):
        if isinstance(node, yaml.MappingNode):
            value = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_scalar(node)
        return Reset(value) if kind == "reset" else value
    return construct


ComposeLoader.add_constructor("!reset", _tagged("reset"))
ComposeLoader.add_constructor("!override", _tagged("override"))


def load_yaml(path: Path) -> list:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=ComposeLoader) if doc is not None]


def k8s_docs() -> dict[str, dict]:
    docs = {}
    for name in ("deployment.yaml", "service.yaml", "hpa.yaml"):
        (doc,) = load_yaml(K8S / name)
        docs[doc["kind"]] = doc
    return docs


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def container_env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def seconds(text: str | int) -> float:
    if isinstance(text, int):
        return float(text)
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", text)
    assert m and text, f"not a duration: {text!r}"
    return int(m[1] or 0) * 60 + int(m[2] or 0)


def metric_names() -> set[str]:
    """Every metric the app's registry exports (as /metrics renders it)."""
    from prometheus_client.parser import text_string_to_metric_families

    from app.runtime.metrics import Metrics

    metrics = Metrics()
    metrics.bind(depth=lambda: 0, in_flight=lambda: 0, busy=lambda: 0, ready=lambda: 0)
    body, _ = metrics.render()
    return {family.name for family in text_string_to_metric_families(body.decode())}


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_runs_as_a_numeric_non_root_user_after_installing():
    words = [w for w, _ in dockerfile()]
    users = instructions("USER")
    assert users, "the image must drop root with USER"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {users[-1]}: use a numeric non-root uid (runAsNonRoot can check it)"
    last_user = len(words) - 1 - words[::-1].index("USER")
    assert "RUN" not in words[last_user:], "installs run before USER, nothing runs as root after it"
    # the Deployment runs as the same uid
    sc = k8s_docs()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert sc["runAsUser"] == int(user)


def test_dockerfile_environment():
    env = dockerfile_env()
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    from learner.kernels.tuned import CUBLAS_WORKSPACE

    # the same value the learner sets for itself when the variable is unset (the tuned table's)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    init = (ROOT / "learner" / "__init__.py").read_text()
    assert f'os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", "{CUBLAS_WORKSPACE}")' in init


def test_dockerfile_port_and_command_agree_with_the_settings():
    assert instructions("EXPOSE") == [str(DEFAULTS.port)]
    (cmd,) = instructions("CMD")
    argv = exec_form(cmd)
    assert argv == ["rev88", "serve", "--host", "0.0.0.0", "--port", str(DEFAULTS.port)]
    # the command parses with the real CLI and means what it says
    import argparse

    parser = argparse.ArgumentParser(prog="rev88")
    add_serve(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv[1:])
    assert args.func is cmd_serve and args.host == "0.0.0.0" and args.port == DEFAULTS.port and args.workers is None  # workers: derived from the devices


def test_dockerfile_healthcheck_hits_the_live_route(routes):
    (hc,) = instructions("HEALTHCHECK")
    assert "curl" not in hc and "wget" not in hc  # not in a slim image
    _, _, command = hc.partition("CMD ")
    argv = exec_form(command.strip())
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "<healthcheck>", "exec")  # valid Python
    port, path = probe_url(argv[2])
    assert (port, path) == (DEFAULTS.port, "/v2/health/live")
    assert "GET" in routes[path]


def test_dockerfile_installs_the_pinned_cuda_capable_torch():
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M)[1]
    runs = " ".join(instructions("RUN"))
    # === : exactly PyPI's release (the CUDA build on Linux x86_64), never a local +cpu build
    assert f'"torch==={version}"' in runs
    extras = re.search(r'"\.\[([a-z,]+)\]"', runs)
    assert extras and {"gpu", "postgres"} <= set(extras[1].split(",")), "the gpu and postgres extras"
    # Triton (the gpu extra) compiles its launcher with the host C compiler at first use
    assert re.search(r"apt-get install [^&]*\bgcc\b", runs)
    (base,) = instructions("FROM")
    assert base.startswith("python:3.11-") or base.startswith("nvidia/cuda:")


def test_dockerignore_keeps_what_the_image_copies():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    copied = []
    for args in instructions("COPY"):
        copied += args.split()[:-1]
    # the packages pyproject.toml installs, the CLI's front door (rev88/) included
    assert set(copied) >= {"pyproject.toml", "README.md", "learner", "app", "rev88"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r'^include = \[(.*)\]$', pyproject, re.M)[1]
    assert {p.strip(' "*') for p in packages.split(",")} <= set(copied)
    for src in copied:
        assert not any(fnmatch.fnmatch(src, p) for p in patterns), f"{src} is copied but .dockerignore drops it"
    for heavy in (".venv", ".git", "tests"):
        assert heavy in patterns
    # a kernel compiled on the host must not reach the image (it would hide a failed build there)
    assert "**/*.so" in patterns


def test_dockerfile_smoke_tests_the_installed_package_and_its_kernel():
    """The build's smoke test imports the *installed* package (from /, not the source copy in
    WORKDIR) and fails when the cpu-fast kernel was not compiled."""
    (workdir,) = instructions("WORKDIR")
    install = [r for r in instructions("RUN") if re.search(r'"\.\[gpu[a-z,]*\]"', r)]
    assert len(install) == 1
    steps = [step.strip() for step in install[0].split("&&")]
    cd = [i for i, step in enumerate(steps) if step.startswith("cd ")]
    smoke = [i for i, step in enumerate(steps) if step.startswith("python -c")]
    assert cd and smoke and cd[0] < smoke[0], "the smoke test runs after a cd away from the sources"
    target = steps[cd[0]].split()[1]
    assert not target.startswith(workdir) and target != ".", target
    code = steps[smoke[0]].split(None, 2)[2].strip('"')
    compile(code, "<smoke>", "exec")
    for needed in ("import learner", "app.main", "rev88.cli", "cpu_fast.kernel_available()", workdir,
                   "app.ledger.postgres"):  # psycopg installed: the image can keep its ledger in PostgreSQL
        assert needed in code, needed


# --------------------------------------------------------------------------- YAML


def test_every_yaml_under_deploy_parses():
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert len(files) >= 7
    for path in files:
        docs = load_yaml(path)
        assert docs and all(isinstance(d, dict) for d in docs), path


def test_serve_flags_cover_every_settings_variable():
    """The env names the deploy files and `rev88 serve` use are the ones app.settings reads."""
    samples = {"REV88_HOST": "0.0.0.0", "REV88_PORT": "9", "REV88_BACKEND": "cpu", "REV88_QUEUE_SIZE": "3",
               "REV88_MAX_BODY_BYTES": "5", "REV88_TASK_TIMEOUT_S": "7", "REV88_DRAIN_TIMEOUT_S": "11",
               "REV88_API_KEY": "k", "REV88_LOG_LEVEL": "debug", "REV88_THREADS": "2",
               "REV88_BATCH_MAX": "4", "REV88_BATCH_WAIT_MS": "20", "REV88_WORKERS": "3",
               "REV88_MAX_TASK_WORK": "1000", "REV88_MAX_TASK_BYTES": "100000", "REV88_DATA_DIR": "/x",
               "REV88_RETAIN_TASKS": "5", "REV88_RETAIN_BYTES": "6",
               "REV88_DATABASE_URL": "postgresql://rev88@db/rev88", "REV88_DB_POOL_SIZE": "3",
               "REV88_DB_TIMEOUT_S": "2", "REV88_LEASE_S": "20", "REV88_LEASE_RENEW_S": "4",
               "REV88_LEASE_ATTEMPTS": "5", "REV88_CLAIM_POLL_S": "0.5", "REV88_BACKLOG_SIZE": "50", "REV88_BACKLOG_BYTES": "5000",
               "REV88_UPLOAD_TIMEOUT_S": "30", "REV88_UPLOAD_MIN_RATE": "1000", "REV88_UPLOAD_BUFFER_BYTES": str(1 << 30),
               "REV88_HEADER_TIMEOUT_S": "3", "REV88_KEEPALIVE_S": "9", "REV88_MAX_CONNECTIONS": "100",
               "REV88_STOCK_HTTP": "1", "REV88_DATASET_BYTES": "1000", "REV88_DATASET_CACHE_BYTES": "5",
               "REV88_SWEEP_MAX_CELLS": "7", "REV88_SWEEP_MAX_WORK": "99", "REV88_SEED_CACHE_BYTES": "12", "REV88_SEED_PROCESSES": "2", "REV88_DEVICE_DATASET_BYTES": "13", "REV88_WEBHOOK_RETRY_SCHEDULE": "0,1",
               "REV88_WEBHOOK_TIMEOUT_S": "3", "REV88_WEBHOOK_ALLOW_CIDRS": "10.0.0.0/8",
               "REV88_WEBHOOK_SECRET_OVERLAP_S": "60", "REV88_WEBHOOK_CONCURRENCY": "2", "REV88_WEBHOOK_POLL_S": "0.5",
               "REV88_WEBHOOK_RETAIN_S": "3600"}
    assert set(samples) == ENV_NAMES
    for name, value in samples.items():
        assert Settings.from_env({name: value}) != DEFAULTS, f"{name} is not read by app.settings"


# --------------------------------------------------------------------------- compose


def compose_service(name: str = "rev88") -> dict:
    (doc,) = load_yaml(DEPLOY / "compose.yaml")
    assert set(doc["services"]) == {"rev88", "postgres"}
    return doc["services"][name]


def compose_merge(base, override):
    """The Compose specification's merge of an override file (mappings merge, `!reset`
    removes the key, sequences append) -- enough for compose.cpu.yaml."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            else:
                out[k] = compose_merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return override


def test_compose_reserves_one_nvidia_gpu():
    devices = compose_service()["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_compose_healthcheck_port_env_and_grace(routes):
    service = compose_service()
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    compile(test[3], "<healthcheck>", "exec")
    port, path = probe_url(test[3])
    assert (port, path) == (DEFAULTS.port, "/v2/health/live") and "GET" in routes[path]
    container_ports = {int(str(p).rsplit(":", 1)[-1]) for p in service["ports"]}
    assert container_ports == {DEFAULTS.port}
    env = service["environment"]
    assert set(env) <= ENV_NAMES, set(env) - ENV_NAMES
    drain = float(env.get("REV88_DRAIN_TIMEOUT_S", DEFAULTS.drain_timeout_s))
    assert seconds(service["stop_grace_period"]) > graceful_shutdown_s(drain, FORCE_EXIT_GRACE_S)
    assert service["build"] == {"context": "..", "dockerfile": "Dockerfile"}
    assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == ROOT / "Dockerfile"
    if service.get("read_only"):
        assert "/tmp" in service["tmpfs"]


def test_compose_cpu_override_drops_only_the_gpu_reservation():
    (base,) = load_yaml(DEPLOY / "compose.yaml")
    (cpu,) = load_yaml(DEPLOY / "compose.cpu.yaml")
    assert set(cpu["services"]) == {"rev88"} <= set(base["services"]), "the override names the rev88 service"
    (override,) = cpu["services"].values()
    assert set(override) <= {"environment", "deploy"}
    assert override["deploy"]["resources"]["reservations"]["devices"] == Reset([])
    merged = compose_merge(compose_service(), override)
    assert "devices" not in merged["deploy"]["resources"]["reservations"]
    assert merged["environment"]["REV88_BACKEND"] in {"cpu", "cpu-fast"}
    assert set(merged["environment"]) <= ENV_NAMES
    # everything else is compose.yaml's: same image, health check, grace, read-only root
    for field in ("image", "build", "healthcheck", "stop_grace_period", "read_only", "tmpfs", "ports"):
        assert merged[field] == compose_service()[field], field


def test_image_checks_are_make_targets_outside_make_test():
    makefile = (ROOT / "Makefile").read_text()
    for target, script in (("image-check", "deploy/image_check.py"), ("compose-check", "deploy/compose_check.py"),
                           ("compose-cpu-check", "deploy/compose_check.py"),
                           ("postgres-image", "deploy/postgres/Containerfile")):
        rule = re.search(rf"^(?:[\w-]+ )*{target}(?: [\w-]+)*:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert rule and script in rule[1], target
        if script.endswith(".py"):
            compile((ROOT / script).read_text(), script, "exec")
    # never part of `make test` (the build downloads several GB)
    test_rule = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)[1]
    assert "image" not in test_rule and "compose" not in test_rule
    assert (DEPLOY / "bootstrap_base_image.sh").stat().st_mode & 0o111, "bootstrap_base_image.sh is executable"
    assert (DEPLOY / "postgres" / "entrypoint.sh").stat().st_mode & 0o111, "the postgres entrypoint is executable"


def test_the_second_replica_is_the_first_but_for_its_port_and_volume():
    """compose.replicas.yaml's rev88-b: compose.yaml's rev88 (with compose.cpu.yaml's backend)
    written out, on the same database, its own port and data volume."""
    base = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    second = yaml.safe_load((DEPLOY / "compose.replicas.yaml").read_text())["services"]["rev88-b"]
    first = base["services"]["rev88"]
    assert second["image"] == first["image"] and "build" not in second
    assert second["ports"] == ["127.0.0.1:8001:8000"] and first["ports"] == ["127.0.0.1:8000:8000"]
    for field in ("healthcheck", "stop_grace_period", "read_only", "tmpfs", "security_opt", "restart", "depends_on"):
        assert second[field] == first[field], field
    same = {k: v for k, v in first["environment"].items() if k != "REV88_BACKEND"}
    assert {k: v for k, v in second["environment"].items() if k != "REV88_BACKEND"} == same
    assert second["volumes"] == ["rev88-data-b:/var/lib/rev88"]
    assert base["services"]["postgres"]["image"] == "${REV88_POSTGRES_IMAGE:-postgres:15-bookworm}"


# --------------------------------------------------------------------------- Kubernetes


def test_deployment_requests_one_gpu_and_runs_non_root():
    dep = k8s_docs()["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"].get("nvidia.com/gpu", 1) == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    if sc.get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], "a read-only root needs a writable /tmp"
        cache = dockerfile_env()
        assert cache["XDG_CACHE_HOME"].startswith("/tmp/") and cache["TRITON_CACHE_DIR"].startswith("/tmp/")


def test_deployment_probes_hit_real_routes_on_the_container_port(routes):
    c = container(k8s_docs()["Deployment"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert list(ports.values()) == [DEFAULTS.port]
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        port = ports.get(get["port"], get["port"])
        assert port == DEFAULTS.port, probe
        assert "GET" in routes[get["path"]], f"{probe} asks {get['path']}, which the app does not serve"
        paths[probe] = get["path"]
    assert paths["livenessProbe"] == "/v2/health/live"
    assert paths["readinessProbe"] == "/v2/health/ready"
    assert paths["startupProbe"] == "/v2/health/live"


def test_termination_grace_outlasts_the_drain():
    dep = k8s_docs()["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    env = container_env(c)
    assert set(env) <= ENV_NAMES, set(env) - ENV_NAMES
    drain = float(env["REV88_DRAIN_TIMEOUT_S"]["value"]) if "REV88_DRAIN_TIMEOUT_S" in env else DEFAULTS.drain_timeout_s
    pre_stop = 0.0
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if command:
        assert command[0] == "sleep"
        pre_stop = float(command[1])
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > drain
    assert grace > pre_stop + graceful_shutdown_s(drain, FORCE_EXIT_GRACE_S)
    # the API key comes from a Secret, never a literal in the manifest
    if "REV88_API_KEY" in env:
        assert "value" not in env["REV88_API_KEY"] and env["REV88_API_KEY"]["valueFrom"]["secretKeyRef"]


def test_service_selects_the_pods_and_targets_the_container_port():
    docs = k8s_docs()
    dep, svc = docs["Deployment"], docs["Service"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    c = container(dep)
    names = {p["name"]: p["containerPort"] for p in c["ports"]}
    (port,) = svc["spec"]["ports"]
    assert names.get(port["targetPort"], port["targetPort"]) == DEFAULTS.port
    annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
    if annotations.get("prometheus.io/scrape") == "true":
        assert int(annotations["prometheus.io/port"]) == DEFAULTS.port
        assert annotations["prometheus.io/path"] == "/metrics"


def test_hpa_scales_the_deployment_on_a_metric_the_app_exports(routes):
    docs = k8s_docs()
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", docs["Deployment"]["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "rev88_queue_depth"
    assert name in metric_names(), "the app's /metrics does not export it"
    assert "GET" in routes["/metrics"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # prometheus-adapter's rule serves that very name from that very series
    (values,) = load_yaml(K8S / "prometheus-adapter-values.yaml")
    rules = values["rules"]["custom"]
    assert any(name in r["seriesQuery"] and r["name"]["as"] == name
               and r["resources"]["overrides"].keys() >= {"namespace", "pod"} for r in rules)


def test_kustomization_lists_the_manifests_and_names_the_image():
    (kust,) = load_yaml(K8S / "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    assert set(kust["resources"]) == {"deployment.yaml", "service.yaml", "hpa.yaml"}
    for res in kust["resources"]:
        assert (K8S / res).is_file()
    image = container(k8s_docs()["Deployment"])["image"].split(":")[0]
    assert image in {i["name"] for i in kust["images"]}


# --------------------------------------------------------------------------- CI and README


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == "make test"
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:\w*)\n(.*?)```", quick, re.S)
    assert blocks and [line.strip() for line in blocks[0].strip().splitlines()] == ["make serve", "make test"]


def test_the_ledger_lives_on_a_volume_everywhere():
    """The root filesystem is read-only: REV88_DATA_DIR must be a volume in the image, compose and k8s."""
    data_dir = dockerfile_env()["REV88_DATA_DIR"]
    assert any(data_dir in v for v in instructions("VOLUME"))
    service = compose_service()
    assert service["environment"]["REV88_DATA_DIR"] == data_dir
    assert any(str(v).split(":")[1] == data_dir for v in service["volumes"])
    dep = k8s_docs()["Deployment"]
    c = container(dep)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["REV88_DATA_DIR"] == data_dir
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert data_dir in mounts and mounts[data_dir] in volumes


# --------------------------------------------------------------------------- the shared ledger (issue #22)


def test_compose_keeps_the_ledger_in_its_postgres_service():
    from urllib.parse import urlsplit

    (doc,) = load_yaml(DEPLOY / "compose.yaml")
    rev88, pg = compose_service(), compose_service("postgres")
    assert rev88["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert pg["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    # a named volume (declared at the top level), never a bind mount or nothing
    (volume,) = pg["volumes"]
    name, path = volume.split(":")[:2]
    assert name in doc["volumes"] and path == "/var/lib/postgresql/data"
    assert "ports" not in pg, "the database is reachable on the compose network only"
    url = urlsplit(rev88["environment"]["REV88_DATABASE_URL"])
    env = pg["environment"]
    assert (url.scheme, url.hostname, url.port) == ("postgresql", "postgres", 5432)
    assert url.username == env["POSTGRES_USER"] and url.path == "/" + env["POSTGRES_DB"]
    assert url.password == env["POSTGRES_PASSWORD"] and url.password.startswith("${REV88_DB_PASSWORD:-")
    assert Settings.from_env({"REV88_DATABASE_URL": "postgresql://u:p@postgres:5432/rev88"}).database_url
    # room for several replicas' pools: replicas x (REV88_DB_POOL_SIZE + 2) under max_connections
    command = pg["command"]
    max_connections = int(command[command.index("-c") + 1].split("=")[1])
    assert max_connections >= 8 * (DEFAULTS.db_pool_size + 2)


def test_the_deployment_takes_the_database_url_from_a_secret():
    c = container(k8s_docs()["Deployment"])
    env = container_env(c)
    url = env["REV88_DATABASE_URL"]
    assert "value" not in url, "a database URL holds a password: never a literal in the manifest"
    ref = url["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "rev88-database", "key": "url", "optional": True}  # without it: SQLite, as before
    lease = float(env["REV88_LEASE_S"]["value"])
    assert 0 < lease <= 30, "a dead pod's tasks are rescued in seconds, not hours"


def test_the_trial_postgres_matches_the_secret_rev88_reads():
    from urllib.parse import urlsplit

    docs = {(d["kind"], d["metadata"]["name"]): d for d in load_yaml(K8S / "postgres" / "postgres.yaml")}
    sts = docs[("StatefulSet", "rev88-postgres")]
    svc = docs[("Service", "rev88-postgres")]
    url = urlsplit(docs[("Secret", "rev88-database")]["stringData"]["url"])
    assert url.hostname == svc["metadata"]["name"] == sts["spec"]["serviceName"]
    assert url.port == svc["spec"]["ports"][0]["port"] == 5432
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = container_env(c)
    assert url.username == env["POSTGRES_USER"]["value"] and url.path == "/" + env["POSTGRES_DB"]["value"]
    password = env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert docs[("Secret", password["name"])]["stringData"][password["key"]] == url.password
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["data"] == "/var/lib/postgresql/data" and env["PGDATA"]["value"].startswith(mounts["data"] + "/")
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    readme = (DEPLOY / "README.md").read_text()
    assert "managed or operated PostgreSQL" in readme and "kubectl apply -k deploy/k8s/postgres" in readme


def test_the_shared_queue_hpa_scales_on_a_metric_the_app_exports_counted_once():
    from prometheus_client.parser import text_string_to_metric_families

    from app.runtime.metrics import Metrics

    (hpa,) = load_yaml(K8S / "hpa-shared-queue.yaml")
    assert hpa["metadata"]["name"] == k8s_docs()["HorizontalPodAutoscaler"]["metadata"]["name"]  # replaces it
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    name = metric["external"]["metric"]["name"]
    metrics = Metrics()
    metrics.watch_ledger(lambda: {"engine": "postgresql", "up": True, "leases_held": 0, "pool": {"max": 8},
                                  "queue": {"queued": 3, "running": 1}, "counters": {"claimed": 4}})
    body, _ = metrics.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert name in families and families[name].samples[0].value == 3
    (values,) = load_yaml(K8S / "prometheus-adapter-values.yaml")
    (rule,) = [r for r in values["rules"]["external"] if r["name"]["as"] == name]
    assert name in rule["seriesQuery"] and rule["metricsQuery"].startswith("max("), "each queued task counted once"


def test_what_kube_check_plays_is_the_manifests_own():
    """deploy/kube_check.py's stand-ins keep the manifests' pod specs: the StatefulSet's template
    (its claim as a PVC), the Deployment's template without the GPU request, the Secrets' values."""
    import base64
    import importlib.util

    spec = importlib.util.spec_from_file_location("kube_check", DEPLOY / "kube_check.py")
    kc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kc)
    database = kc.docs(K8S / "postgres" / "postgres.yaml")
    [sts] = kc.by_kind(database, "StatefulSet")
    pvc, pod = kc.statefulset_pod(sts, "rev88-postgres:15")
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == "data-rev88-postgres-0"
    assert pod["metadata"]["name"] == "rev88-postgres-0" and pod["spec"]["containers"][0]["image"] == "rev88-postgres:15"
    template = sts["spec"]["template"]["spec"]
    assert pod["spec"]["containers"][0]["readinessProbe"] == template["containers"][0]["readinessProbe"]
    assert pod["spec"]["securityContext"] == template["securityContext"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "data-rev88-postgres-0"}} in pod["spec"]["volumes"]
    deployment = kc.by_kind(kc.docs(K8S / "deployment.yaml"), "Deployment")[0]
    rev = kc.deployment_pod(deployment, "rev88-0", "10.0.0.9")
    c = rev["spec"]["containers"][0]
    original = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in str(c["resources"]) and "nvidia.com/gpu" in str(original["resources"])
    assert {e["name"]: e.get("value") for e in c["env"]}["REV88_BACKEND"] == "cpu-fast"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe] == original[probe], probe
    assert rev["spec"]["hostAliases"] == [{"ip": "10.0.0.9", "hostnames": ["rev88-postgres"]}]
    assert {v["name"] for v in rev["spec"]["volumes"]} == {"rev88-0-data", "rev88-0-tmp"}
    assert {m["name"] for m in c["volumeMounts"]} == {"rev88-0-data", "rev88-0-tmp"}
    secret = next(s for s in kc.by_kind(database, "Secret") if s["metadata"]["name"] == "rev88-database")
    values = json.loads(kc.secret_payload(secret))
    assert base64.b64decode(values["url"]).decode() == secret["stringData"]["url"]
