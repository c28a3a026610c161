"""``rev88 measure --simulate``, ``--allow-invalid`` and ``rev88 measure analyze``: exit statuses,
what is printed, what is written."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from learner.taskio import save_task
from rev88.cli import main

from .conftest import REFERENCE_DIR, small_task

SHORT = ["--trials", "3", "--target-seconds", "2", "--settle-seconds", "0.5", "--idle-seconds", "1",
         "--reference-seconds", "2", "--sham-seconds", "2"]


def _measure(tmp_path, scenario, *extra, name="rec.json"):
    out = tmp_path / name
    code = main(["measure", "--simulate", scenario, "--backend", "cpu", *SHORT, "--output", str(out), *extra])
    return code, out


def test_simulated_healthy_record_is_valid_and_reanalyzes(tmp_path, capsys):
    code, out = _measure(tmp_path, "healthy")
    printed = capsys.readouterr()
    assert code == 0, printed.err
    doc = json.loads(out.read_text())
    assert doc["valid"] is True and doc["failed_gates"] == []
    for gate in doc["gates"]:
        assert f"pass      {gate}" in printed.out
    assert "valid: true" in printed.out and "net energy per task (the gated figure, counter)" in printed.out
    assert doc["metadata"]["train_count"] == 64  # the synthetic rehearsal task (no --input)

    assert main(["measure", "analyze", str(out)]) == 0
    printed = capsys.readouterr()
    assert "reproduced: all" in printed.out and "recomputed values equal the record's exactly" in printed.out
    for line in ("reference_before:", "sham:", "harness control:", "trial 2:", "telemetry:", "processes:"):
        assert line in printed.out


def test_an_invalid_record_exits_1_and_says_which_gate(tmp_path, capsys):
    code, out = _measure(tmp_path, "counter-drift")
    printed = capsys.readouterr()
    assert code == 1
    assert out.exists() and json.loads(out.read_text())["failed_gates"] == ["meters_agree"]  # written all the same
    assert "rev88 measure: gate meters_agree fail: trial" in printed.err and "limit 3%" in printed.err
    assert "--allow-invalid" in printed.err
    assert "valid: false" in printed.out

    code, out2 = _measure(tmp_path, "counter-drift", "--allow-invalid", name="rec2.json")
    printed = capsys.readouterr()
    assert code == 0 and "gate meters_agree fail" in printed.err and "--allow-invalid" in printed.err

    # analyze: it reproduces, but the record is invalid -> 1, or 0 with --allow-invalid
    assert main(["measure", "analyze", str(out)]) == 1
    printed = capsys.readouterr()
    assert "reproduced: all" in printed.out and "gate meters_agree fail" in printed.err
    assert main(["measure", "analyze", str(out), "--allow-invalid"]) == 0


def test_analyze_exits_1_on_a_record_that_does_not_reproduce(tmp_path, capsys):
    code, out = _measure(tmp_path, "healthy")
    assert code == 0
    doc = json.loads(out.read_text())
    tampered = copy.deepcopy(doc)
    tampered["figures"]["headline"]["net_mj_per_task"]["mean"] *= 0.5  # a better-looking figure
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(tampered))
    capsys.readouterr()
    assert main(["measure", "analyze", str(bad), "--allow-invalid"]) == 1
    err = capsys.readouterr().err
    assert "NOT reproduced: 1 value(s) differ" in err and "figures.headline.net_mj_per_task.mean" in err


def test_analyze_the_reference_record(tmp_path, capsys):
    record = REFERENCE_DIR / "rev88-run-record.json"
    analysis = tmp_path / "analysis.json"
    assert main(["measure", "analyze", str(record), "--output", str(analysis)]) == 1  # reproduces; no gates
    printed = capsys.readouterr()
    assert "reproduced: all 59 recomputed values" in printed.out
    assert "MISSING   telemetry" in printed.out and "FAIL      round_spread" in printed.out
    assert main(["measure", "analyze", str(record), "--allow-invalid"]) == 0
    result = json.loads(analysis.read_text())
    assert result["reproduced"] is True and result["valid"] is False


@pytest.mark.parametrize("content, words", [("not json", "is not a JSON record"),
                                            ('{"energy": null}', "not a gated energy record")])
def test_analyze_rejects_what_is_not_a_record(tmp_path, capsys, content, words):
    path = tmp_path / "x.json"
    path.write_text(content)
    assert main(["measure", "analyze", str(path)]) == 2
    assert words in capsys.readouterr().err
    assert main(["measure", "analyze", str(tmp_path / "absent.json")]) == 2


@pytest.mark.parametrize("extra, words", [
    (["--reference-seconds", "0"], "reference_seconds must be > 0"),
    (["--sham-seconds", "nan"], "sham_seconds must be a finite number"),
    (["--backend", "cuda"], "--simulate runs the learner on the CPU"),
])
def test_bad_simulate_arguments_exit_2(tmp_path, capsys, extra, words):
    out = tmp_path / "e.json"
    assert main(["measure", "--simulate", "healthy", "--output", str(out), *extra]) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_measure_needs_input_or_simulate(tmp_path, capsys):
    assert main(["measure", "--output", str(tmp_path / "e.json")]) == 2
    assert "--input is required" in capsys.readouterr().err
    assert main(["measure", "--simulate", "healthy"]) == 2
    assert "--output is required" in capsys.readouterr().err


def test_rev88_measure_simulate_as_a_command(tmp_path):
    """The real command line, in a child process, with a task file: invalid record -> exit 1."""
    task = tmp_path / "task.npz"
    save_task(task, small_task(n=40, m=9, seed=5))
    out = tmp_path / "gaps.json"
    proc = subprocess.run([sys.executable, "-m", "rev88", "measure", "--simulate", "gaps", "--input", str(task),
                           "--backend", "cpu", *SHORT, "--output", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gate telemetry fail: largest gap between samples" in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["failed_gates"] == ["telemetry"] and doc["board"]["scenario"] == "gaps"
