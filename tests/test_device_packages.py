"""What a GPU call carries is what the service imports (issue 43, item 1).

The first GPU run passed only because the carried wheels were fixed by hand: the pins said
uvicorn 0.54.0 (the service accepts 0.55.x only) and did not carry httptools (the body protocol's
parser, absent from the GPU image). These tests measure, in a child process, every distribution
the service imports when it starts, and fail when the GPU image's packages
(scripts/gpu_image_packages.txt) plus the carried pins (scripts/device_wheels.txt) lack one, or
when a pin leaves pyproject.toml's range or app/http/versions.TESTED's releases.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_carried as carried  # noqa: E402
import gpu_check_common as common  # noqa: E402

# Imported when installed, never needed: the service runs without them.
OPTIONAL = {
    "psycopg": "the postgres extra (REV88_DATABASE_URL); the GPU run uses SQLite",
    "psycopg-binary": "the postgres extra",
    "psycopg-pool": "the postgres extra",
    "watchfiles": "uvicorn imports it for --reload, only where installed",
    "rich": "httpx's command line imports it, only where installed",
    "pygments": "httpx's command line imports it, only where installed",
}

MEASURE = r"""
import importlib, json, pkgutil, sys
before = set(sys.modules)
import app, learner
for package in (app, learner):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
import rev88.cli.serve, rev88.client
from importlib.metadata import packages_distributions
owners = packages_distributions()
tops = {name.split(".")[0] for name in set(sys.modules) - before}
tops -= set(sys.stdlib_module_names) | {"app", "learner", "rev88", "__main__", "__mp_main__"}
print(json.dumps(sorted({dist for top in tops for dist in owners.get(top, [])})))
"""


@pytest.fixture(scope="module")
def imported() -> set[str]:
    """The distributions (normalized names) the service's modules import, measured."""
    proc = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {carried.normalized(name) for name in json.loads(proc.stdout.splitlines()[-1])}


def test_service_modules_are_what_the_service_imports(imported):
    listed = {carried.normalized(name) for name in common.SERVICE_MODULES}
    needed = imported - set(OPTIONAL)
    assert not needed - listed, (f"the service imports {sorted(needed - listed)}, not in "
                                 "scripts/gpu_check_common.SERVICE_MODULES (add them, and pin them in "
                                 "scripts/device_wheels.txt when the GPU image lacks them)")
    assert not listed - imported, f"SERVICE_MODULES lists {sorted(listed - imported)}, which the service never imports"
    for dist, module in common.SERVICE_MODULES.items():
        assert importlib.util.find_spec(module) is not None, f"{dist}'s import name {module!r} does not import"


def test_image_plus_pins_hold_every_package_the_service_imports(imported):
    image, pins = carried.read_image(), carried.read_pins()
    missing = sorted(imported - set(OPTIONAL) - set(image) - set(pins))
    assert not missing, f"the GPU image lacks {missing} and scripts/device_wheels.txt does not carry them"
    assert carried.pin_problems(pins) == []
    assert {"httptools", "uvicorn"} <= set(pins) and "httptools" not in image


def test_pins_are_the_releases_installed_here_where_the_range_is_one_release():
    """Where pyproject.toml or versions.TESTED narrows a package to one minor release, the carried
    wheel is that release, the one this suite ran on."""
    pins = carried.read_pins()
    for name in carried.tested_releases():
        installed = importlib.metadata.version(name)
        assert carried._release_of(pins[name])[:2] == carried._release_of(installed)[:2], (name, pins[name], installed)


def test_pins_meet_each_others_requirements_as_installed_here():
    """A pinned package installed here at its pinned version: its requirements on other pinned
    packages are met by their pins (pydantic 2.14.4 needs pydantic-core 2.50.5 exactly)."""
    pins = carried.read_pins()
    checked = 0
    for name, version in pins.items():
        try:
            if importlib.metadata.version(name) != version:
                continue
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in importlib.metadata.requires(name) or []:
            req, _, spec, marker = carried.parse_requirement(text)
            if req in pins and carried.marker_holds(marker, set()):
                checked += 1
                assert carried.spec_contains(spec, pins[req]), f"{name}=={version} needs {text}, pinned {pins[req]}"
    assert checked >= 3


@pytest.mark.parametrize("change, says", [
    ({"uvicorn": "0.54.0"}, "was tested on 0.55.x only"),
    ({"fastapi": "0.164.2"}, "outside pyproject.toml's fastapi>=0.165,<0.166"),
    ({"orjson": "2.0.0"}, "outside pyproject.toml's orjson>=3.9,<4"),
    ({"httptools": None}, "the service imports httptools, which is neither on the GPU image"),
    ({"orjson": None}, "the service imports orjson"),
])
def test_a_wrong_or_missing_pin_is_named(change, says):
    pins = dict(carried.read_pins())
    for name, version in change.items():
        if version is None:
            pins.pop(name)
        else:
            pins[name] = version
    problems = carried.pin_problems(pins)
    name = next(iter(change))
    assert problems and any(says in p for p in problems) and all(name in p for p in problems), problems


def test_an_image_without_a_package_the_service_needs_is_named():
    image = dict(carried.read_image())
    image.pop("numpy")
    problems = carried.pin_problems(carried.read_pins(), image)
    assert problems == ["the service imports numpy, which is neither on the GPU image "
                        "(scripts/gpu_image_packages.txt) nor in scripts/device_wheels.txt: pin it there"]


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    stem = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{stem}.dist-info/METADATA", meta)


def test_carried_wheels_own_requirements(tmp_path):
    pins = {"uvicorn": "0.55.0", "httptools": "0.9.0", "fastapi": "0.165.0"}
    _wheel(tmp_path, "uvicorn", "0.55.0", ["click>=7.0", "h11>=0.8", "httptools>=0.6.3; extra == 'standard'",
                                           "websockets>=13; extra == 'standard'"])
    _wheel(tmp_path, "httptools", "0.9.0", [])
    _wheel(tmp_path, "fastapi", "0.165.0", ["starlette>=1.10,<1.11", "pydantic>=2.7", "email-validator; extra == 'all'",
                                           "tomli; python_version < '3.11'"])
    image = carried.read_image()
    problems = carried.requirement_problems(tmp_path, pins, image)
    # pyproject asks for plain uvicorn: its 'standard' extra's websockets is not needed; fastapi's
    # starlette is neither pinned here nor on the image; pydantic is on neither either
    assert sorted(problems) == sorted([
        "fastapi-0.165.0-py3-none-any.whl needs starlette>=1.10,<1.11, which is neither carried nor on the GPU "
        "image: pin it in scripts/device_wheels.txt",
        "fastapi-0.165.0-py3-none-any.whl needs pydantic>=2.7, which is neither carried nor on the GPU image: "
        "pin it in scripts/device_wheels.txt"]), problems
    pins.update(starlette="1.9.0", pydantic="2.14.4")
    problems = carried.requirement_problems(tmp_path, pins, image)
    assert problems == ["fastapi-0.165.0-py3-none-any.whl needs starlette>=1.10,<1.11, but "
                        "scripts/device_wheels.txt pins starlette==1.9.0"]
    _wheel(tmp_path, "httptools", "0.9.0", ["numpy>=9"])  # the image's numpy is 2.5
    assert any("the GPU image has numpy==2.5" in p for p in carried.requirement_problems(tmp_path, pins, image))


@pytest.mark.parametrize("spec, version, ok", [
    (">=0.55,<0.56", "0.55.0", True), (">=0.55,<0.56", "0.56.0", False), (">=0.55,<0.56", "0.54.9", False),
    ("==2.50.5", "2.50.5", True), ("==2.50.5", "2.50.6", False), ("==1.10.*", "1.10.3", True),
    ("==1.10.*", "1.11.0", False), ("!=1.0", "1.0.0", False), ("~=3.2", "3.9", True), ("~=3.2", "4.0", False),
    ("<3", "2.5", True), (">2.4", "2.5", True), ("", "0.0.1", True),
])
def test_the_standard_library_specifier_matches_packaging(spec, version, ok):
    from packaging.specifiers import SpecifierSet

    assert carried._simple_contains(spec, version) is ok
    assert SpecifierSet(spec).contains(version, prereleases=True) is ok


def test_a_child_python_keeps_the_parent_s_import_path(tmp_path, monkeypatch):
    """On the GPU machine the service's packages come from a folder on PYTHONPATH (the carried
    wheels): a test's child process that set PYTHONPATH to the checkout alone lost them (the first
    GPU run: 'No module named orjson' in tests/test_app_batching.py's child)."""
    from .helpers import child_pythonpath

    site = tmp_path / "site"
    site.mkdir()
    (site / "rev88_carried_probe.py").write_text("VALUE = 43\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT)}
    code = "import rev88_carried_probe, learner; print(rev88_carried_probe.VALUE)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "43", proc.stderr
    assert child_pythonpath(ROOT).split(os.pathsep) == [str(ROOT), str(site)]


def test_no_child_python_drops_the_parent_s_import_path():
    """Every place in tests/, bench/ and scripts/ that hands a child Python a PYTHONPATH keeps the
    parent's (tests.helpers.child_pythonpath, or the parent's PYTHONPATH joined on)."""
    offenders = []
    for folder in ("tests", "bench", "scripts"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"""["']PYTHONPATH["']\s*[:\]]\s*=?\s*str\(""", line) and "on purpose" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "a child's PYTHONPATH without the parent's:\n" + "\n".join(offenders)
