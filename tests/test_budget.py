"""learner.budget: the work and memory estimate of a task, its limits, and `rev88 run`'s check."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from learner.budget import (
    BYTES_ENV,
    DEFAULT_MAX_TASK_BYTES,
    DEFAULT_MAX_TASK_WORK,
    WORK_ENV,
    Estimate,
    check_budget,
    estimate,
    limits_from_env,
)
from learner.config import Config, make_config
from learner.errors import BudgetExceeded, ConfigError, TaskError
from learner.taskio import task_to_npz_bytes
from learner.train import parameter_count

from .helpers import small_task


def unchecked(**values):
    """A config-shaped object that skips Config's bounds: estimate() alone must refuse these too."""
    return SimpleNamespace(**{**Config().as_dict(), **values})


def test_interface_defaults():
    assert DEFAULT_MAX_TASK_WORK == 50_000_000 and DEFAULT_MAX_TASK_BYTES == 1 << 30
    assert (WORK_ENV, BYTES_ENV) == ("REV88_MAX_TASK_WORK", "REV88_MAX_TASK_BYTES")
    est = estimate(10, 3, Config())
    assert isinstance(est, Estimate) and est.as_dict() == {"work": est.work, "bytes": est.bytes, "steps": est.steps}
    with pytest.raises(AttributeError):
        est.work = 1  # frozen


def test_work_formula():
    # depth x (epochs x (train rows + 32 x minibatches) + queries), minibatches = ceil(N / batch)
    est = estimate(19, 7, make_config({"depth": 3, "epochs": 5, "batch_size": 8}))
    assert est.steps == 3 * 5
    assert est.work == 3 * (5 * (19 + 32 * 3) + 7)
    draw0 = estimate(10_000, 10_000, Config())
    assert draw0.steps == 79 * 2 and draw0.work == 2 * (2 * (10_000 + 32 * 79) + 10_000)


def test_defaults_admit_a_large_task():
    est = estimate(60_000, 10_000, make_config({"epochs": 100, "depth": 4}))  # batch 128
    assert est.work == 4 * (100 * (60_000 + 32 * 469) + 10_000) == 30_043_200
    check_budget(est)  # no error
    check_budget(estimate(10_000, 10_000, Config()))


def test_many_epochs_refused_by_work():
    with pytest.raises(ConfigError, match=r"config.epochs must be in \[1, 1000\]"):
        make_config({"epochs": 100_000})
    est = estimate(10_000, 10_000, unchecked(epochs=100_000))
    with pytest.raises(BudgetExceeded) as err:
        check_budget(est)
    exc = err.value
    assert isinstance(exc, TaskError) and exc.status == 422
    assert exc.message == (
        f"task needs an estimated {est.work:,} work units (depth × (epochs × (train rows + 32 × minibatches) "
        "+ queries)), over the limit of 50,000,000 (REV88_MAX_TASK_WORK)"
    )
    assert exc.details == {"resource": "work", "limit": 50_000_000, "estimate": est.work, "env": WORK_ENV}
    assert est.work == 2 * (100_000 * (10_000 + 32 * 79) + 10_000)  # about 2.5e9


def test_huge_depth_refused_by_bytes():
    with pytest.raises(ConfigError, match=r"config.depth must be in \[1, 64\]"):
        make_config({"depth": 100_000})
    est = estimate(64, 64, unchecked(depth=100_000))
    assert est.work < DEFAULT_MAX_TASK_WORK  # not the work: the parameters alone are 1.3 GB
    assert est.bytes > 4 * parameter_count(100_000) > DEFAULT_MAX_TASK_BYTES
    with pytest.raises(BudgetExceeded) as err:
        check_budget(est)
    exc = err.value
    assert exc.status == 413 and exc.details["resource"] == "bytes" and exc.details["env"] == BYTES_ENV
    assert f"task needs an estimated {est.bytes:,} bytes of memory" in exc.message
    assert "over the limit of 1,073,741,824 bytes (REV88_MAX_TASK_BYTES)" in exc.message


def test_work_is_checked_before_memory_and_limits_are_arguments():
    est = Estimate(work=10, bytes=10, steps=1)
    check_budget(est, max_work=10, max_bytes=10)  # at the limit is allowed
    with pytest.raises(BudgetExceeded, match=r"over the limit of 5 \(REV88_MAX_TASK_WORK\)") as err:
        check_budget(Estimate(work=10, bytes=10**12, steps=1), max_work=5, max_bytes=9)
    assert err.value.status == 422
    with pytest.raises(BudgetExceeded, match="over the limit of 9 bytes") as err:
        check_budget(est, max_bytes=9)
    assert err.value.status == 413


def test_bytes_grow_with_each_term():
    base = estimate(1000, 100, Config())
    assert estimate(1000, 100, make_config({"epochs": 3})).bytes - base.bytes == 2 * 1000 * 8  # two permutation copies
    assert estimate(2000, 100, Config()).bytes > base.bytes
    assert estimate(1000, 200, Config()).bytes > base.bytes
    assert estimate(1000, 100, make_config({"depth": 3})).bytes > base.bytes
    assert estimate(1000, 100, make_config({"batch_size": 512})).bytes > base.bytes
    # a minibatch never holds more rows than the task has
    assert estimate(100, 10, make_config({"batch_size": 65536})).bytes == estimate(100, 10, make_config(
        {"batch_size": 100})).bytes


def test_limits_from_env():
    assert limits_from_env({}) == (DEFAULT_MAX_TASK_WORK, DEFAULT_MAX_TASK_BYTES)
    assert limits_from_env({WORK_ENV: " 1000 ", BYTES_ENV: ""}) == (1000, DEFAULT_MAX_TASK_BYTES)
    assert limits_from_env({BYTES_ENV: "4096"}) == (DEFAULT_MAX_TASK_WORK, 4096)
    for name in (WORK_ENV, BYTES_ENV):
        for bad in ("0", "-5", "lots", "1e9", "²", "9" * 40):
            with pytest.raises(ConfigError, match=f"^{name} must be a positive integer") as err:
                limits_from_env({name: bad})
            assert err.value.details["variable"] == name


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_bytes_estimate_bounds_a_measured_peak(tmp_path):
    """The peak RSS of one run (many epochs: the permutation term shows) stays under the estimate."""
    script = textwrap.dedent(
        """
        import json, re, sys
        from learner.budget import estimate
        from learner.config import Config
        from learner.result import run_task
        from tests.conftest import small_task

        def kb(key):
            return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

        task, config = small_task(2000, 500, seed=1), Config(epochs=500, batch_size=65536, learning_rate=0.01)
        run_task(small_task(16, 4), Config(batch_size=8, epochs=1), sys.argv[1])  # one-time set-up
        base = kb("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")
        run_task(task, config, sys.argv[1])
        print(json.dumps({"extra": kb("VmHWM") - base, "estimate": estimate(2000, 500, config).bytes}))
        """
    )
    from learner.backends import cpu_fast

    for backend in ["cpu-fast"] if cpu_fast.kernel_available() else ["cpu"]:
        out = subprocess.run([sys.executable, "-c", script, backend], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], check=True)
        numbers = json.loads(out.stdout.strip().splitlines()[-1])
        assert 0 < numbers["extra"] < numbers["estimate"], numbers


# ---------------------------------------------------------------------------- rev88 run


def _run_cli(args, monkeypatch, capsys, env=None):
    from rev88.cli import main

    for name in (WORK_ENV, BYTES_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    code = main(args)
    return code, capsys.readouterr().err


def test_cli_run_checks_the_budget(tmp_path, monkeypatch, capsys):
    task = tmp_path / "t.npz"
    task.write_bytes(task_to_npz_bytes(small_task(40, 9)))
    args = ["run", "--input", str(task), "--backend", "cpu", "--output", str(tmp_path / "r.json")]
    work = estimate(40, 9, Config()).work
    code, err = _run_cli(args, monkeypatch, capsys, {WORK_ENV: str(work - 1)})
    assert code == 2 and f"over the limit of {work - 1:,} (REV88_MAX_TASK_WORK)" in err
    assert not (tmp_path / "r.json").exists()
    code, err = _run_cli(args, monkeypatch, capsys, {BYTES_ENV: "1000"})
    assert code == 2 and "over the limit of 1,000 bytes (REV88_MAX_TASK_BYTES)" in err
    code, err = _run_cli(args, monkeypatch, capsys, {WORK_ENV: "many"})
    assert code == 2 and re.search("REV88_MAX_TASK_WORK must be a positive integer .*'many'", err)
    code, err = _run_cli(args, monkeypatch, capsys, {WORK_ENV: str(work)})
    assert code == 0 and (tmp_path / "r.json").exists()
