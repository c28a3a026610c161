"""The rendered kustomization (deploy/k8s) validated strictly against the Kubernetes schemas.

`kubectl apply --dry-run` needs an API server; none runs here, so the manifests are checked
offline: deploy/k8s is rendered the way `kubectl kustomize` renders it (resources, then the
images transformer: the only features kustomization.yaml uses; anything else fails the
renderer, so a new feature cannot slip past unrendered), and each resource goes through
kubernetes-validate with strict=True (unknown fields rejected) for the oldest and newest
Kubernetes versions we claim. Where kubectl exists, its rendering must equal ours. The
validator's own teeth are tested too: broken manifests in a tmp dir must be rejected.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (it is in the test extra: pip install -e '.[test]')",
)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes the manifests are written for, and the newest the validator knows.
VERSIONS = ("1.29.0", kv.utils.latest_version())
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "images"}
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


# --------------------------------------------------------------------------- rendering


def _split_image(image: str) -> tuple[str, str, str]:
    """(name, ':tag' or '', '@digest' or '') of a container image reference."""
    name, at, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return name, tag, at + digest


def _set_images(node, images: list[dict]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in CONTAINER_LISTS and isinstance(value, list):
                for c in value:
                    if isinstance(c, dict) and isinstance(c.get("image"), str):
                        c["image"] = _new_image(c["image"], images)
            _set_images(value, images)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, images)


def _new_image(image: str, images: list[dict]) -> str:
    name, tag, digest = _split_image(image)
    for rule in images:
        if rule["name"] != name:
            continue
        unknown = set(rule) - {"name", "newName", "newTag", "digest"}
        assert not unknown, f"images: {sorted(unknown)} not supported by this renderer"
        name = rule.get("newName", name)
        if "digest" in rule:
            return f"{name}@{rule['digest']}"
        if "newTag" in rule:
            tag, digest = f":{rule['newTag']}", ""
        return name + tag + digest
    return image


def render(folder: Path) -> list[dict]:
    """What `kubectl kustomize FOLDER` outputs, for the features deploy/k8s uses."""
    (kust,) = [d for d in yaml.safe_load_all((folder / "kustomization.yaml").read_text()) if d]
    unknown = set(kust) - KUSTOMIZATION_KEYS
    assert not unknown, f"kustomization.yaml uses {sorted(unknown)}: teach tests/test_deploy_manifests.render them"
    assert kust["kind"] == "Kustomization"
    docs = []
    for res in kust.get("resources", []):
        path = folder / res
        assert path.is_file(), f"resource {res} is not a file (remote bases and folders are not rendered here)"
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    docs = copy.deepcopy(docs)
    _set_images(docs, kust.get("images", []))
    return docs


def key(doc: dict) -> tuple[str, str, str]:
    return doc["apiVersion"], doc["kind"], doc["metadata"]["name"]


def by_key(docs: list[dict]) -> dict:
    table = {key(d): d for d in docs}
    assert len(table) == len(docs), "two resources with the same apiVersion/kind/name"
    return table


def validate_all(docs: list[dict], version: str) -> None:
    for doc in docs:
        kv.validate(doc, version, strict=True)


# --------------------------------------------------------------------------- the real manifests


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render(K8S)


def test_rendering_has_the_three_resources_with_the_named_image(rendered):
    assert {d["kind"] for d in rendered} == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    (kust,) = yaml.safe_load_all((K8S / "kustomization.yaml").read_text())
    (rule,) = kust["images"]
    (dep,) = [d for d in rendered if d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"{rule['newName']}:{rule['newTag']}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: Python rendering only")
def test_python_rendering_equals_kubectl_kustomize(rendered):
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    assert by_key(theirs) == by_key(rendered)


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_manifests_pass_strict_schema_validation(rendered, version):
    validate_all(rendered, version)


def test_every_rendered_resource_has_a_schema(rendered):
    # a kind without a schema would raise SchemaNotFoundError above; make the kinds explicit
    for doc in rendered:
        assert kv.validate(doc, VERSIONS[-1], strict=True)


# --------------------------------------------------------------------------- the validator can fail


def broken_copy(tmp_path: Path, mutate) -> Path:
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    (dep,) = yaml.safe_load_all((folder / "deployment.yaml").read_text())
    mutate(dep)
    (folder / "deployment.yaml").write_text(yaml.safe_dump(dep))
    return folder


def _typo(dep: dict) -> None:
    pod = dep["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")


def _wrong_type(dep: dict) -> None:
    dep["spec"]["replicas"] = "one"


def _probe_port_missing(dep: dict) -> None:
    del dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"]


def _container_typo(dep: dict) -> None:
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["securityContext"]["readOnlyRootFileSystem"] = c["securityContext"].pop("readOnlyRootFilesystem")


@pytest.mark.parametrize("mutate", [_typo, _wrong_type, _probe_port_missing, _container_typo],
                         ids=["unknown-pod-field", "replicas-not-an-integer", "probe-without-port",
                              "misspelt-security-field"])
def test_a_broken_manifest_is_rejected(tmp_path, mutate):
    docs = render(broken_copy(tmp_path, mutate))
    with pytest.raises(kv.ValidationError):
        validate_all(docs, VERSIONS[-1])


def test_unknown_fields_pass_only_without_strict(tmp_path):
    """What strict adds: the misspelt field is accepted by the lax schema and refused by the strict one."""
    docs = render(broken_copy(tmp_path, _typo))
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    kv.validate(dep, VERSIONS[-1], strict=False)
    with pytest.raises(kv.ValidationError, match="terminationGracePeriodSecond"):
        kv.validate(dep, VERSIONS[-1], strict=True)


def test_renderer_refuses_kustomization_features_it_does_not_render(tmp_path):
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    with (folder / "kustomization.yaml").open("a") as f:
        f.write("namePrefix: staging-\n")
    with pytest.raises(AssertionError, match="namePrefix"):
        render(folder)


def test_images_transformer_matches_kustomize_rules():
    rules = [{"name": "rev88", "newName": "registry.example.com/team/rev88", "newTag": "1.2.3"}]
    assert _new_image("rev88:0.1.0", rules) == "registry.example.com/team/rev88:1.2.3"
    assert _new_image("rev88", rules) == "registry.example.com/team/rev88:1.2.3"
    assert _new_image("other:0.1.0", rules) == "other:0.1.0"
    assert _new_image("localhost:5000/rev88:1", [{"name": "localhost:5000/rev88", "newTag": "2"}]) == "localhost:5000/rev88:2"
    assert _new_image("rev88:0.1.0", [{"name": "rev88", "digest": "sha256:" + "0" * 64}]) == "rev88@sha256:" + "0" * 64


# --------------------------------------------------------------------------- the shared ledger (issue #22)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_trial_postgres_and_the_shared_queue_hpa_pass_strict_schema_validation(version):
    docs = render(K8S / "postgres")
    assert sorted(d["kind"] for d in docs) == ["Secret", "Secret", "Service", "StatefulSet"]
    (kust,) = yaml.safe_load_all((K8S / "postgres" / "kustomization.yaml").read_text())
    (rule,) = kust["images"]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"{rule['newName']}:{rule['newTag']}"
    validate_all(docs, version)
    validate_all([d for d in yaml.safe_load_all((K8S / "hpa-shared-queue.yaml").read_text()) if d], version)
