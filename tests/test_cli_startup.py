"""`rev88 --version` and `--help` (every command's too) start without importing torch (issue #56:
they took seconds when every command imported it); a command that trains still gets its backend,
and an unavailable one still exits 2.

Each runs in a fresh interpreter, as the console script does (``rev88.cli:main``), and reports
which heavy packages it had imported by the time it exited."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

PROBE = """
import json, sys
from rev88.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "app": "app.main" in sys.modules}), file=sys.stderr)
"""

COMMANDS = ["run", "make-task", "score", "evaluate", "measure", "serve", "submit", "tasks", "task", "cancel",
            "dataset", "sweep", "keys"]


def probe(*argv: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


def test_version_and_help_import_no_torch():
    seen, out = probe("--version")
    assert seen == {"code": 0, "torch": False, "app": False} and out.strip() == "rev88 0.1.0"
    seen, out = probe("--help")
    assert seen == {"code": 0, "torch": False, "app": False}
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_imports_no_torch(command):
    seen, out = probe(command, "--help")
    assert seen["code"] == 0 and not seen["torch"], (command, seen)
    assert out.startswith("usage: rev88 " + command)


def test_the_backend_names_are_listed_and_an_unavailable_one_exits_2(tmp_path):
    """--help lists the backends (read without torch); asking for one this machine has not still
    fails as bad input (2), with the reason, once the command runs."""
    _, out = probe("run", "--help")
    assert "cpu-fast" in out and "fused" in out
    from learner.taskio import save_task
    from tests.helpers import small_task

    save_task(tmp_path / "t.npz", small_task())
    proc = subprocess.run([sys.executable, "-m", "rev88", "run", "--input", str(tmp_path / "t.npz"), "--backend",
                           "fused", "--output", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: fused may run")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, (proc.returncode, proc.stderr)
