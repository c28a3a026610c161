"""The one-shot's tests section (scripts/gpu_check_tests.py) on a pytest run of its own files:
outcomes read as they stream, a cap that stops a slow run keeps the outcomes so far, and the
verdict on a GPU needs the CUDA tests to have run."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _load():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("gpu_check_tests", SCRIPTS / "gpu_check_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


section = _load()

FILE = '''
import time
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.fixture
def broken():
    raise RuntimeError("setup breaks")

def test_errors(broken):
    pass

@pytest.mark.skip(reason="not here")
def test_skips():
    pass

def test_slow():
    time.sleep(float(__import__("os").environ.get("SLOW_S", "0")))
'''


def _file(tmp_path) -> str:
    path = tmp_path / "test_sample.py"
    path.write_text(FILE)
    return str(path)


def test_outcomes_are_counted_as_pytest_prints_them(tmp_path):
    got = section.run_pytest(section.command([_file(tmp_path)]), cap_s=120, log=lambda *a: None)
    assert got["finished"] and not got["timed_out"] and got["returncode"] == 1
    assert got["counts"] == {"passed": 2, "failed": 1, "error": 1, "skipped": 1, "xfail": 0, "xpass": 0}
    assert sorted(n.split("::")[1] for n in got["not_passed"]) == ["test_errors", "test_fails"]


def test_a_cap_stops_a_slow_run_and_keeps_what_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOW_S", "60")
    t0 = time.monotonic()
    got = section.run_pytest(section.command([_file(tmp_path)]), cap_s=8, log=lambda *a: None)
    assert got["timed_out"] and not got["finished"] and time.monotonic() - t0 < 40
    assert got["counts"]["passed"] == 1 and got["counts"]["failed"] == 1  # the tests before the slow one


def test_on_a_gpu_the_cuda_tests_must_have_run(tmp_path, monkeypatch):
    cuda = tmp_path / "test_cuda.py"
    cuda.write_text("import pytest\n\n@pytest.mark.skip(reason='no CUDA GPU')\ndef test_graphs():\n    pass\n")
    only_pass = tmp_path / "test_ok.py"
    only_pass.write_text("def test_ok():\n    pass\n")
    monkeypatch.setattr(section, "GPU_TEST_FILES", (str(cuda), str(only_pass)))
    report = section.run(tmp_path / "out", dry_run=False, log=lambda *a: None)
    assert report["passed"] is False and "tests/test_cuda.py's tests skipped" in report["error"]
    report = section.run(tmp_path / "out", dry_run=True, log=lambda *a: None)
    assert report["passed"] is True and report["pytest"]["counts"]["passed"] == 1


def test_the_cap_is_the_estimate_and_the_budget_lowers_it(tmp_path):
    gpu_check = sys.modules.get("gpu_check") or importlib.import_module("gpu_check")
    assert section.DEVICE_CAP_S == gpu_check.DEVICE_ESTIMATE_S["tests"]
    report = section.run(tmp_path / "out", dry_run=False, deadline=time.monotonic() + 5, log=lambda *a: None)
    assert report["budget_cut"] and "not run" in report["skipped"] and report["passed"] is False
