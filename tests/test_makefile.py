"""The Makefile installs only when what it builds from changed (issue #56): `make serve` a second
time starts the service without running pip, and a changed pyproject.toml, C source of the
cpu-fast kernel or Makefile installs again; a fresh venv installs; the CPU and GPU builds of
torch replace each other.

Real GNU make runs the repository's own Makefile in a folder of its own, beside a copy of the
files it builds from, with a venv whose ``pip`` and ``rev88`` only write down how they were
called (what the Makefile decides is under test here, not pip: the real install runs in CI's
`make test`, and docs/performance.md has a real second `make serve` timed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

PAST = 1_700_000_000  # (the sources' time: before anything an install writes)
# make run as a top-level make, whatever runs this test (CI runs the suite under `make test`: a
# child make would print "Entering directory" lines and inherit the parent's flags)
MAKE_ENV = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
RECORDER = """#!/bin/sh
echo "$(basename "$0") $*" >> "$(dirname "$0")/../calls.log"
"""


@pytest.fixture
def tree(tmp_path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "learner" / "backends").mkdir(parents=True)
    for name in ("cpu_fast_kernel.c", "cpu_fast.h"):
        shutil.copy(ROOT / "learner" / "backends" / name, tmp_path / "learner" / "backends" / name)
    for path in tmp_path.rglob("*"):
        os.utime(path, (PAST, PAST))  # (the sources older than anything an install writes)
    return tmp_path


def make_venv(tree: Path) -> Path:
    bin_ = tree / "venv" / "bin"
    bin_.mkdir(parents=True)
    for name in ("python", "pip", "rev88"):
        (bin_ / name).write_text(RECORDER)
        (bin_ / name).chmod(0o755)
    return bin_


def make(tree: Path, *targets: str, gpu: bool = False) -> list[str]:
    """Run make; the commands the venv's programs were called with, in order."""
    log = tree / "venv" / "calls.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(["make", "-s", *targets, "VENV=venv", f"HAS_GPU={'yes' if gpu else ''}"], cwd=tree, env=MAKE_ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines() if log.exists() else []


def pip_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("pip ")]


def touch(tree: Path, name: str) -> None:
    """``name`` changed after the last install: the stamps put back in the past, the file after them
    (an install now writes its stamp at today's time, after both)."""
    for stamp in tree.glob("venv/.rev88-installed-*"):
        os.utime(stamp, (PAST + 100, PAST + 100))
    os.utime(tree / name, (PAST + 200, PAST + 200))


def test_a_second_make_serve_does_not_install(tree):
    make_venv(tree)
    first = make(tree, "serve")
    assert pip_calls(first) == ["pip install -q torch==2.13.0 -e ."] and first[-1] == "rev88 serve"
    second = make(tree, "serve")
    assert second == ["rev88 serve"]  # no pip: seconds, not a reinstall
    assert make(tree, "install") == []


@pytest.mark.parametrize("changed", ["pyproject.toml", "learner/backends/cpu_fast_kernel.c",
                                     "learner/backends/cpu_fast.h", "Makefile"])
def test_what_the_install_builds_from_changed_installs_again(tree, changed):
    make_venv(tree)
    make(tree, "serve")
    assert pip_calls(make(tree, "serve")) == []
    touch(tree, changed)
    assert pip_calls(make(tree, "serve")) == ["pip install -q torch==2.13.0 -e ."]
    assert pip_calls(make(tree, "serve")) == []


def test_a_fresh_venv_installs(tree):
    """No venv yet: make creates it and installs (shown by a dry run: creating it is real work)."""
    proc = subprocess.run(["make", "-n", "serve", "VENV=fresh", "HAS_GPU="], cwd=tree, env=MAKE_ENV, capture_output=True,
                          text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert lines[0].startswith("python3.11 -m venv fresh")
    assert "fresh/bin/pip install -q 'torch==2.13.0' -e ." in lines
    assert lines[-1].strip() == "fresh/bin/rev88 serve"


def test_the_tests_install_serves_the_cpu_and_the_gpu_build_replaces_it(tree):
    make_venv(tree)
    assert pip_calls(make(tree, "install-test")) == ["pip install -q torch==2.13.0 -e .[test]"]
    assert make(tree, "serve") == ["rev88 serve"]  # (the tests' install is a CPU install with more)
    assert pip_calls(make(tree, "serve", gpu=True)) == ["pip install -q torch===2.13.0 -e .[gpu]"]
    assert pip_calls(make(tree, "serve", gpu=True)) == []
    assert pip_calls(make(tree, "install-test")) == ["pip install -q torch==2.13.0 -e .[test]"]
    assert pip_calls(make(tree, "serve", gpu=True)) == ["pip install -q torch===2.13.0 -e .[gpu]"]  # its torch back
    assert pip_calls(make(tree, "serve")) == ["pip install -q torch==2.13.0 -e ."]


def test_reinstall_installs_regardless(tree):
    make_venv(tree)
    make(tree, "install")
    assert pip_calls(make(tree, "reinstall")) == ["pip install -q torch==2.13.0 -e ."]
