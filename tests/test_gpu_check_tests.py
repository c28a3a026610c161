"""The tests section of scripts/gpu_check.py (scripts/gpu_check_tests.py): it runs exactly the
tests marked ``gpu`` (pytest -m gpu), reads their outcomes as they stream, keeps the outcomes so
far when its cap stops pytest, and on a GPU passes only when every marked test ran and passed
(``gpu_ran``). Also: the marker means "needs a GPU" -- the tests that skip without CUDA carry
it, tests/conftest.py skips the marked ones without a GPU, and no interpreter test is marked."""

from __future__ import annotations

import ast
import importlib.util
import sys
import time
from pathlib import Path

import pytest

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

@pytest.mark.gpu
def test_passes():
    pass

@pytest.mark.gpu
def test_fails():
    assert 1 == 2

@pytest.fixture
def broken():
    raise RuntimeError("setup breaks")

@pytest.mark.gpu
def test_errors(broken):
    pass

@pytest.mark.gpu
@pytest.mark.skip(reason="not here")
def test_skips():
    pass

@pytest.mark.gpu
def test_slow():
    time.sleep(float(__import__("os").environ.get("SLOW_S", "0")))

def test_not_marked_never_runs():
    raise AssertionError("a test not marked gpu ran in the GPU tests section")
'''
MARKERS = '[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n'


def _file(tmp_path) -> str:
    (tmp_path / "pytest.ini").write_text(MARKERS)
    path = tmp_path / "test_sample.py"
    path.write_text(FILE)
    return str(path)


def test_only_the_marked_tests_run_and_their_outcomes_are_counted(tmp_path):
    got = section.run_pytest(section.command([_file(tmp_path)]), cap_s=120, log=lambda *a: None)
    assert got["finished"] and not got["timed_out"] and got["returncode"] == 1
    assert got["counts"] == {"passed": 2, "failed": 1, "error": 1, "skipped": 1, "xfail": 0, "xpass": 0}
    assert got["selected"] == 5  # the unmarked test deselected: never run
    assert sorted(n.split("::")[1] for n in got["not_passed"]) == ["test_errors", "test_fails"]
    assert not any("not_marked" in n for n in got["outcomes"])


def test_a_cap_stops_a_slow_run_and_keeps_what_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOW_S", "60")
    t0 = time.monotonic()
    got = section.run_pytest(section.command([_file(tmp_path)]), cap_s=8, log=lambda *a: None)
    assert got["timed_out"] and not got["finished"] and time.monotonic() - t0 < 40
    assert got["counts"]["passed"] == 1 and got["counts"]["failed"] == 1  # the tests before the slow one


def _marked_files(tmp_path, body: str) -> tuple[str, ...]:
    (tmp_path / "pytest.ini").write_text(MARKERS)
    path = tmp_path / "test_gpu_only.py"
    path.write_text("import pytest\n\n" + body)
    return (str(path),)


def test_on_a_gpu_every_marked_test_must_have_run_and_passed(tmp_path, monkeypatch):
    """gpu_ran counts the marked tests that ran and passed on this machine; a skipped one (no
    CUDA) fails the section on a GPU, and the dry run (the CPU) only rehearses the command."""
    files = _marked_files(tmp_path, "@pytest.mark.gpu\n@pytest.mark.skip(reason='no CUDA GPU')\ndef test_graphs():\n"
                                    "    pass\n\n@pytest.mark.gpu\ndef test_ok():\n    pass\n")
    monkeypatch.setattr(section, "gpu_test_files", lambda: files)
    report = section.run(tmp_path / "out", dry_run=False, log=lambda *a: None)
    assert report["passed"] is False and report["gpu_ran"] == 1
    assert "1 of 2 marked tests ran on the GPU: 1 skipped" in report["error"]
    report = section.run(tmp_path / "out", dry_run=True, log=lambda *a: None)
    assert report["passed"] is True and report["pytest"]["counts"]["passed"] == 1
    files = _marked_files(tmp_path, "@pytest.mark.gpu\ndef test_a():\n    pass\n\n@pytest.mark.gpu\ndef test_b():\n    pass\n")
    report = section.run(tmp_path / "out2", dry_run=False, log=lambda *a: None)
    assert report["passed"] is True and report["gpu_ran"] == 2 and report["pytest"]["selected"] == 2


def test_the_cap_is_the_tables_and_the_budget_lowers_it(tmp_path):
    import gpu_budget

    assert section.DEVICE_CAP_S == gpu_budget.SECTIONS["tests"].limit_s - 10
    report = section.run(tmp_path / "out", dry_run=False, deadline=time.monotonic() + 5, log=lambda *a: None)
    assert report["budget_cut"] and "not run" in report["skipped"] and report["passed"] is False


# --------------------------------------------------------------------------- the marker


def _not_cuda(expr: ast.AST) -> bool:
    return (isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not)
            and "cuda.is_available" in ast.unparse(expr.operand))


def _skipif_on_cuda(node: ast.FunctionDef) -> bool:
    """A ``skipif(not ...cuda.is_available())`` decorator, or ``if not ...cuda.is_available():
    pytest.skip(...)`` in the test: a test that skips itself without CUDA."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and ast.unparse(sub.func).endswith("skipif") and sub.args and _not_cuda(sub.args[0]):
            return True
        if isinstance(sub, ast.If) and _not_cuda(sub.test) and any(
                isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and ast.unparse(s.value.func).endswith("skip")
                for s in sub.body):
            return True
    return False


def test_the_gpu_marker_means_needs_a_gpu():
    """Every test that skips itself without CUDA is marked gpu (the conftest's hook then does the
    skipping); every marked test sits in a file the section runs; no marked test runs Triton's
    interpreter (those stay on the CPU machines); and the set is not empty."""
    marked = section.gpu_tests()
    assert marked and "tests/test_cuda.py" in marked and "tests/test_fused.py" in marked
    assert set(section.gpu_test_files()) == set(marked)
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        names = set(marked.get(str(path.relative_to(ROOT)), ()))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            if _skipif_on_cuda(node):
                pytest.fail(f"{path.name}::{node.name} skips without CUDA by itself: mark it gpu instead")
            if node.name in names:
                source = ast.unparse(node)
                assert "TRITON_INTERPRET" not in source and "_run_child" not in source and "small_runs" not in source, (
                    f"{path.name}::{node.name} is marked gpu but runs the interpreter")


def test_the_conftest_skips_marked_tests_without_a_gpu(monkeypatch):
    """tests/conftest.py's hook: without CUDA a marked test gets a skip naming the marker; with the
    rehearsal switch a marked test that takes ``gpu_device`` runs (in the interpreter), the rest
    still skip; an unmarked test is never touched."""
    import torch

    from tests import conftest

    class Item:
        def __init__(self, marked: bool, fixtures=()):
            self.marked, self.fixturenames, self.added = marked, list(fixtures), []

        def get_closest_marker(self, name):
            return object() if self.marked and name == "gpu" else None

        def add_marker(self, marker):
            self.added.append(marker)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("REV88_GPU_TESTS_ON_CPU", raising=False)
    items = [Item(True), Item(True, ["gpu_device"]), Item(False)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [len(i.added) for i in items] == [1, 1, 0]
    assert "marked gpu: needs a CUDA GPU" in items[0].added[0].kwargs["reason"]
    monkeypatch.setenv("REV88_GPU_TESTS_ON_CPU", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    items = [Item(True), Item(True, ["gpu_device"]), Item(False)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [len(i.added) for i in items] == [1, 0, 0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    items = [Item(True), Item(False)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [len(i.added) for i in items] == [0, 0]
