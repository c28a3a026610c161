"""The measurement protocol end to end: a simulated meter and clock driving real
training runs on a tiny task, the CPU path (timing only), and ``rev88 measure``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from learner.backends.cpu import CpuBackend
from learner.config import make_config
from learner.energy import SimulatedMeter
from learner.measure import STATE_HASH_KEYS, ProtocolError, check_protocol, measure_run, measure_task
from learner.result import run_task
from learner.taskio import save_task

from .conftest import small_task

CONFIG = make_config({"batch_size": 16})
TASK_S = 0.25  # simulated seconds per task (binary-exact, so the expected figures are exact)
ACTIVE_W, IDLE_W = 156.0, 60.0


class SimulatedGpuBackend:
    """The real cpu backend, plus simulated time and power on the meter for every task."""

    name = "simulated"
    device = "cpu"

    def __init__(self, meter: SimulatedMeter, task_s: float = TASK_S, active_w: float = ACTIVE_W):
        self.inner = CpuBackend()
        self.meter, self.task_s, self.active_w = meter, task_s, active_w
        self.runs = 0

    def describe(self) -> dict:
        return {"backend": self.name}

    def run(self, task, prepared):
        out = self.inner.run(task, prepared)
        self.meter.advance(self.task_s, power_w=self.active_w)
        self.runs += 1
        return out


def test_protocol_with_simulated_meter(run_record):
    task = small_task(n=40, m=9, seed=5)
    meter = SimulatedMeter(idle_w=IDLE_W, start_mj=18_000_000_000, start_s=5.0)
    backend = SimulatedGpuBackend(meter)
    sleeps: list[float] = []

    def sleep(seconds):
        sleeps.append(seconds)
        meter.sleep(seconds)

    result, doc = measure_run(task, CONFIG, backend, trials=2, target_seconds=2.0, settle_seconds=0.5,
                              idle_seconds=1.0, meter=meter, sleep=sleep)
    e = doc["energy"]
    assert e is not None and "energy_reason" not in doc
    # calibration: one simulated task; repeats = 2.0 s / 250 ms
    assert e["calibration_ms"] == 250.0
    assert e["repeats_per_trial"] == 8
    # before run + calibration + 2 x 8 + after run
    assert backend.runs == 1 + 1 + 16 + 1
    # the cold idle window (1 s, before any work), then per trial: settle, idle, settle, idle; each
    # settle polls the power every 0.1 s up to its 0.5 s cap (shorter than the slope test's fit)
    assert sleeps == pytest.approx([1.0] + ([0.1] * 5 + [1.0]) * 4)
    for i, t in enumerate(e["trials"]):
        assert t["trial"] == i and t["invocations"] == 8
        for name in ("idle_before", "idle_after"):
            assert t[name]["duration_s"] == 1.0 and t[name]["settle_seconds"] == pytest.approx(0.5)
            assert t[name]["settle"]["ended_by"] == "cap" and len(t[name]["settle"]["readings"]) == 6
            assert t[name]["average_power_w"] == IDLE_W
        assert t["idle_adjusted_reason"] is None
        assert t["active"]["duration_s"] == 2.0
        assert t["active"]["energy_j"] == ACTIVE_W * 2.0
        assert t["paired_idle_w"] == IDLE_W
        assert t["idle_adjusted_mj_per_task"] == (ACTIVE_W - IDLE_W) * TASK_S * 1000  # 24000 mJ
        assert t["unadjusted_mj_per_task"] == ACTIVE_W * TASK_S * 1000  # 39000 mJ
        assert t["wall_ms_per_task"] == 250.0
        assert t["cuda_ms_per_task"] is None  # no CUDA events off the GPU
        assert t["telemetry_before"]["power_w"] == IDLE_W and t["telemetry_after"]["power_w"] == ACTIVE_W
    # trial 1 starts where trial 0 ended: the windows follow each other in time
    t0, t1 = e["trials"]
    assert t1["idle_before"]["start"]["time_s"] == pytest.approx(t0["idle_after"]["end"]["time_s"] + 0.5)
    # the cold idle beside the paired idle (this meter has no clocks), and the baseline named
    cold = e["cold_idle"]
    assert cold["counter_w"] == IDLE_W and cold["window"]["duration_s"] == 1.0
    assert cold["paired_idle_minus_cold_w"] == [0.0, 0.0]
    assert cold["window"]["end"]["time_s"] == 5.0 + 1.0  # before any work
    assert "baseline: paired idle" in e["method"] and "cold idle (before any work) recorded beside" in e["method"]
    assert e["settle"]["fit_s"] == 1.0
    assert t0["active"]["start"]["energy_mj"] == t0["idle_before"]["end"]["energy_mj"]
    s = e["summary"]
    assert s["idle_adjusted_mj_per_task"] == {"mean": 24000.0, "sample_sd": 0.0, "values": [24000.0, 24000.0]}
    assert s["cuda_ms_per_task"] is None
    assert doc["timing"]["wall_ms_per_task"]["count"] == 16
    assert doc["timing"]["wall_ms_per_task"]["median"] == 250.0
    # the same checks and names as the record
    assert e["repeat_predictions_equal"] and e["repeat_state_hashes_equal"]
    assert e["state_hash_keys_checked"] == list(STATE_HASH_KEYS) == run_record["energy"]["state_hash_keys_checked"]
    assert e["before_metadata"]["predictions_sha256"] == result.predictions_sha256 == doc["predictions_sha256"]
    assert e["hardware"]["gpu"] == "simulated"
    assert set(e["software"]) == set(run_record["energy"]["software"])
    rec = run_record["energy"]
    assert set(rec) <= set(e)
    # the record's fields, plus why an idle-adjusted figure is missing and what each settle saw
    assert set(t0) - set(rec["trials"][0]) == {"idle_adjusted_reason"}
    for name in ("idle_before", "idle_after", "active"):
        assert set(t0[name]) - set(rec["trials"][0][name]) == ({"settle"} if name != "active" else set())
        assert set(rec["trials"][0][name]["start"]) == set(t0[name]["start"])
    assert set(rec["summary"]) == set(s)
    # every field of the record's hardware object, plus how the NVML handle was chosen
    assert set(e["hardware"]) - set(rec["hardware"]) == {"nvml_handle_selected_by"}
    assert set(rec["hardware"]) <= set(e["hardware"])
    json.dumps(doc)  # a JSON document throughout


def test_protocol_sees_a_different_power():
    """The figures follow the simulated hardware (not canned): double the task time."""
    task = small_task(n=24, m=5, seed=6)
    meter = SimulatedMeter(idle_w=40.0)
    backend = SimulatedGpuBackend(meter, task_s=0.5, active_w=100.0)
    doc = measure_task(task, CONFIG, backend, trials=1, target_seconds=1.0, settle_seconds=0.0,
                       idle_seconds=0.5, meter=meter, sleep=meter.sleep)
    t = doc["energy"]["trials"][0]
    assert doc["repeats_per_trial"] == 2
    assert t["idle_adjusted_mj_per_task"] == (100.0 - 40.0) * 0.5 * 1000
    assert doc["energy"]["summary"]["unadjusted_mj_per_task"]["sample_sd"] is None  # one trial


def test_cpu_measure_reports_timing_and_no_energy():
    task = small_task(n=30, m=6, seed=7)

    def no_sleep(seconds):
        raise AssertionError("no idle windows without a meter")

    result, doc = measure_run(task, CONFIG, "cpu", trials=2, target_seconds=0.05, meter=None, sleep=no_sleep)
    assert doc["energy"] is None
    assert "CPU" in doc["energy_reason"]
    assert doc["memory"] is None and "CUDA" in doc["memory_reason"]
    n = doc["repeats_per_trial"]
    assert 1 <= n <= 1000
    wall = doc["timing"]["wall_ms_per_task"]
    assert wall["count"] == 2 * n
    assert wall["min"] <= wall["median"] <= wall["max"] and wall["min"] <= wall["mean"] <= wall["max"]
    assert wall["min"] > 0
    assert doc["timing"]["cuda_ms_per_task"] is None
    assert [t["invocations"] for t in doc["trials"]] == [n, n]
    assert doc["repeat_predictions_equal"] and doc["repeat_state_hashes_equal"]
    assert doc["predictions_sha256"] == run_task(task, CONFIG, "cpu").predictions_sha256
    assert doc["protocol"]["calibration"] == "wall clock"
    assert doc["hardware"]["logical_cpus"] >= 1
    json.dumps(doc)


def test_changed_state_is_detected():
    """A backend whose later runs differ must fail the before/after check."""
    task = small_task(n=20, m=4, seed=8)
    meter = SimulatedMeter()

    class Drifting(SimulatedGpuBackend):
        def run(self, task, prepared):
            out = super().run(task, prepared)
            if self.runs > 2:
                out.scores = out.scores.copy()
                out.scores[0] = out.scores[0][::-1].copy()  # flips the first prediction's ranking
            return out

    doc = measure_task(task, CONFIG, Drifting(meter), trials=1, target_seconds=0.5, settle_seconds=0.0,
                       idle_seconds=0.5, meter=meter, sleep=meter.sleep)
    assert doc["repeat_state_hashes_equal"] is False


@pytest.mark.parametrize(
    "args, words",
    [
        ((0, 5.0, 3.0, 3.0), "trials must be an integer >= 1"),
        ((2.5, 5.0, 3.0, 3.0), "trials must be an integer"),
        ((1, 0.0, 3.0, 3.0), "target_seconds must be > 0"),
        ((1, float("nan"), 3.0, 3.0), "target_seconds must be a finite number"),
        ((1, 5.0, -1.0, 3.0), "settle_seconds must be >= 0"),
        ((1, 5.0, 3.0, float("inf")), "idle_seconds must be a finite number"),
    ],
)
def test_protocol_arguments_are_checked(args, words):
    with pytest.raises(ProtocolError, match=words):
        check_protocol(*args)
    with pytest.raises(ProtocolError):
        measure_task(small_task(), CONFIG, "cpu", *args)
    check_protocol(1, 0.1, 0.0, 0.0)


def _rev88(*args):
    return subprocess.run([sys.executable, "-m", "rev88", *args], capture_output=True, text=True, timeout=300)


def test_rev88_measure_on_cpu(tmp_path):
    task_path = tmp_path / "task.npz"
    save_task(task_path, small_task(n=48, m=10, seed=9))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"batch_size": 16}))
    out = tmp_path / "energy.json"
    r = _rev88("measure", "--input", str(task_path), "--backend", "cpu", "--config", str(cfg),
               "--trials", "2", "--target-seconds", "0.1", "--output", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["energy"] is None and doc["energy_reason"]
    assert doc["backend"] == "cpu" and doc["metadata"]["config"]["batch_size"] == 16
    wall = doc["timing"]["wall_ms_per_task"]
    assert set(wall) == {"count", "median", "mean", "sample_sd", "min", "max"}
    assert wall["count"] == 2 * doc["repeats_per_trial"]
    assert "energy: none" in r.stdout and "wall ms per task: median" in r.stdout


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--trials", "0"], "trials must be an integer >= 1"),
        (["--target-seconds", "0"], "target_seconds must be > 0"),
        (["--idle-seconds", "-2"], "idle_seconds must be >= 0"),
        (["--backend", "cuda"], "needs a CUDA GPU"),
    ],
)
def test_rev88_measure_rejects_bad_arguments(tmp_path, capsys, extra, words):
    import torch

    from rev88.cli import main

    if extra[0] == "--backend" and torch.cuda.is_available():
        pytest.skip("a GPU is present here")
    task_path = tmp_path / "task.npz"
    save_task(task_path, small_task())
    code = main(["measure", "--input", str(task_path), "--output", str(tmp_path / "e.json"), *extra])
    assert code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()
