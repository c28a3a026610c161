"""The energy interface and the protocol's arithmetic, against the reference record's
own raw readings, with a simulated counter and clock where a GPU would be needed."""

from __future__ import annotations

import statistics

import pytest

from learner import energy
from learner.energy import IdleBaseline, SimulatedMeter, nvml_device, read, request_energy
from learner.measure import repeats_for, summarize, summary, timing_stats, trial_figures, window

REL = 1e-9


def _windows(trial: dict, with_settle: bool = True):
    def w(name, settle):
        raw = trial[name]
        return window(raw["start"], raw["end"], raw.get("settle_seconds") if settle else None)

    return w("idle_before", with_settle), w("active", False), w("idle_after", with_settle)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_record_trial_arithmetic_from_raw_readings(run_record, index):
    trial = run_record["energy"]["trials"][index]
    idle_before, active, idle_after = _windows(trial)
    for ours, name in ((idle_before, "idle_before"), (active, "active"), (idle_after, "idle_after")):
        theirs = trial[name]
        assert ours["duration_s"] == pytest.approx(theirs["duration_s"], rel=1e-12, abs=0)
        assert ours["energy_j"] == pytest.approx(theirs["energy_j"], rel=1e-12, abs=0)
        assert ours["average_power_w"] == pytest.approx(theirs["average_power_w"], rel=1e-12, abs=0)
        assert ours["start"] == theirs["start"] and ours["end"] == theirs["end"]
    # The CUDA-event total is not among the raw readings; only its division is checked here.
    cuda_total = trial["cuda_ms_per_task"] * trial["invocations"]
    figures = trial_figures(idle_before, active, idle_after, trial["invocations"], cuda_total)
    for key in ("paired_idle_w", "idle_adjusted_mj_per_task", "unadjusted_mj_per_task", "wall_ms_per_task"):
        assert figures[key] == pytest.approx(trial[key], rel=REL, abs=0), key
    assert figures["cuda_ms_per_task"] == pytest.approx(trial["cuda_ms_per_task"], rel=1e-12)


def test_record_trial0_headline_figures(run_record):
    trial = run_record["energy"]["trials"][0]
    idle_before, active, idle_after = _windows(trial)
    figures = trial_figures(idle_before, active, idle_after, trial["invocations"], None)
    assert figures["idle_adjusted_mj_per_task"] == pytest.approx(1030.9487807986357, rel=REL, abs=0)
    assert figures["unadjusted_mj_per_task"] == pytest.approx(3467.8846153846152, rel=REL, abs=0)
    assert figures["cuda_ms_per_task"] is None
    # The adjustment is big here (idle is ~64 W of ~92 W): subtracting only one idle window
    # instead of the pair would miss the record by far more than the tolerance.
    one_sided = (active["energy_j"] - idle_before["average_power_w"] * active["duration_s"]) * 1000 / 104
    assert abs(one_sided - 1030.9487807986357) > 1.0


def test_repeats_selection_and_clamp(run_record):
    e = run_record["energy"]
    assert repeats_for(e["calibration_ms"], 5.0) == e["repeats_per_trial"] == 104
    assert repeats_for(62.5, 2.0) == 32  # exact division: no extra repeat
    assert repeats_for(62.4, 2.0) == 33  # ceil
    assert repeats_for(10_000.0, 5.0) == 1  # slower than the target: one task
    assert repeats_for(0.001, 5.0) == 1000  # faster than target/1000: capped
    assert repeats_for(0.0, 5.0) == 1000


def test_summary_of_record_trials(run_record):
    e = run_record["energy"]
    ours = summary(e["trials"])
    for key, theirs in e["summary"].items():
        assert ours[key]["values"] == theirs["values"]
        assert ours[key]["mean"] == pytest.approx(theirs["mean"], rel=1e-12)
        assert ours[key]["sample_sd"] == pytest.approx(theirs["sample_sd"], rel=1e-12)
    # sample (n-1), not population, SD
    values = e["summary"]["idle_adjusted_mj_per_task"]["values"]
    assert ours["idle_adjusted_mj_per_task"]["sample_sd"] != pytest.approx(statistics.pstdev(values))


def test_summarize_edges():
    assert summarize([]) is None and summarize([None, None]) is None
    one = summarize([2.5])
    assert one == {"mean": 2.5, "sample_sd": None, "values": [2.5]}
    assert summarize([1.0, None, 3.0])["mean"] == 2.0


def test_timing_stats():
    stats = timing_stats([4.0, 1.0, 3.0, 2.0])
    assert stats == {"count": 4, "median": 2.5, "mean": 2.5, "sample_sd": pytest.approx(1.2909944487358056),
                     "min": 1.0, "max": 4.0}
    assert timing_stats([]) is None
    assert timing_stats([7.0])["sample_sd"] is None


def test_window_with_zero_duration_has_no_power():
    w = window({"energy_mj": 5, "time_s": 1.0, "query_latency_s": 0.0},
               {"energy_mj": 5, "time_s": 1.0, "query_latency_s": 0.0})
    assert w["average_power_w"] is None
    figures = trial_figures(w, window({"energy_mj": 0, "time_s": 0.0, "query_latency_s": 0},
                                      {"energy_mj": 1000, "time_s": 1.0, "query_latency_s": 0}), w, 1, None)
    assert figures["paired_idle_w"] is None and figures["idle_adjusted_mj_per_task"] is None
    assert figures["unadjusted_mj_per_task"] == 1000.0


# --------------------------------------------------------------------------- simulated meter


def test_simulated_meter_integrates_power():
    m = SimulatedMeter(idle_w=50.0, start_mj=1000, start_s=10.0)
    r0 = read(m)
    assert r0.energy_mj == 1000 and r0.time_s == 10.0 and r0.query_latency_s == 0.0
    m.sleep(2.0)
    m.advance(0.25, power_w=200.0)
    r1 = read(m)
    assert r1.energy_mj == 1000 + 100_000 + 50_000
    assert r1.time_s == 12.25
    assert m.power_w() == 200.0
    with pytest.raises(ValueError):
        m.advance(-1.0)


def test_simulated_counter_update_period():
    m = SimulatedMeter(idle_w=100.0, start_mj=0, start_s=0.0, update_period_s=0.05)
    m.advance(0.07)  # last tick at 0.05 s -> 5 J
    assert m.energy_mj() == 5000
    m.advance(0.03)  # exactly on the 0.10 s tick
    assert m.energy_mj() == 10_000


def test_idle_baseline_is_a_bounded_median():
    m = SimulatedMeter(idle_w=10.0)
    idle = IdleBaseline(capacity=3)
    assert idle.median_w() is None
    for watts in (10.0, 90.0, 20.0, 30.0):
        m.idle_w = watts
        m.sleep(0.1)
        idle.sample(m)
    assert len(idle) == 3
    assert idle.median_w() == 30.0  # of 90, 20, 30: the oldest (10) fell out

    class Broken:
        def power_w(self):
            raise RuntimeError("sensor gone")

    assert idle.sample(Broken()) is None
    assert "sensor gone" in idle.last_error and len(idle) == 3
    with pytest.raises(ValueError):
        IdleBaseline(capacity=0)


def _idle_sampled(m: SimulatedMeter, watts: float = 60.0, n: int = 5) -> IdleBaseline:
    idle = IdleBaseline()
    for _ in range(n):
        m.idle_w = watts
        m.sleep(1.0)
        idle.sample(m)
    return idle


def test_request_energy_long_window_is_the_counters_and_measured():
    m = SimulatedMeter(idle_w=60.0, start_mj=7_000_000)  # a counter that follows every advance
    idle = _idle_sampled(m)
    idle.record_cold(m)

    def run():
        m.advance(0.5, power_w=200.0)
        return "done"

    result, figures = request_energy(m, run, idle)
    assert result == "done"
    assert figures["gross_j"] == 100.0 and figures["gross_source"] == "counter" and figures["gross_reason"] is None
    assert figures["idle_baseline_w"] == 60.0
    assert figures["idle_adjusted_j"] == 100.0 - 60.0 * 0.5 and figures["idle_adjusted_reason"] is None
    assert figures["duration_s"] == 0.5
    assert figures["counter_start_mj"] == 7_000_000 + 300_000
    assert figures["counter_end_mj"] == figures["counter_start_mj"] + 100_000 == 7_400_000
    assert figures["estimate"] is False
    assert figures["method"].startswith("nvml-total-energy-counter-delta; idle baseline: median of the last 5 ")
    assert "cold idle 60.0 W before any work recorded beside" in figures["method"]
    assert figures["cold_idle_w"] == 60.0 and figures["cold_idle"]["error"] is None
    assert figures["counter_update_s"] == 0.0 and figures["gated"] is False


# The simulated counter below updates every 62.5 ms (exact in binary, so window edges fall on ticks).
PERIOD = 0.0625


def _ticking(start_s: float = 1.0) -> SimulatedMeter:
    return SimulatedMeter(idle_w=60.0, start_mj=0, start_s=start_s, update_period_s=PERIOD)


def test_a_window_shorter_than_one_update_that_read_nothing_is_answered_from_power():
    """The H200's figure: 0.000 J gross, -7.857 J idle-adjusted over 65.7 ms, because the counter had
    not advanced and the idle baseline was subtracted anyway. Now: never 0 J, never negative."""
    m = _ticking()
    idle = _idle_sampled(m, watts=119.6)  # the warm idle after work on the H200
    m.idle_w = 60.0
    m.sleep(0.001)  # just past a tick: the next one is 61.5 ms away
    _, f = request_energy(m, lambda: m.advance(0.040, power_w=300.0), idle)
    assert f["counter_delta_mj"] == 0  # the counter did not move: 0 J is not a reading
    assert f["gross_source"] == "power" and f["gross_j"] == pytest.approx(300.0 * 0.040)
    assert "did not advance" in f["gross_reason"]
    assert f["method"].startswith("power-at-window-end-x-duration (as Zeus's approx_instant_energy")
    assert f["idle_adjusted_j"] == pytest.approx((300.0 - 119.6) * 0.040) and f["idle_adjusted_j"] > 0
    assert f["estimate"] is True and f["note"].startswith("estimate: a 40.0 ms window, answered from power.")
    # the same window with power at the baseline: no figure rather than a negative one
    _, f = request_energy(m, lambda: m.advance(0.040, power_w=100.0), idle)
    assert f["gross_j"] == pytest.approx(4.0) and f["idle_adjusted_j"] is None
    assert "not above the idle baseline" in f["idle_adjusted_reason"]


def test_a_window_shorter_than_one_update_that_crossed_a_tick_is_still_not_the_counters():
    m = _ticking()
    idle = _idle_sampled(m)
    m.sleep(0.050)  # 12.5 ms before the next tick
    _, f = request_energy(m, lambda: m.advance(0.040, power_w=300.0), idle)
    # the counter moved by one update: 12.5 ms at idle and 27.5 ms at 300 W inside it, the rest
    # of the 62.5 ms update from before the window -- not the window's energy
    assert f["counter_delta_mj"] > 0
    assert f["gross_source"] == "power" and f["gross_j"] == pytest.approx(12.0)
    assert "shorter than one counter update (62.5 ms)" in f["gross_reason"]


def test_a_window_of_exactly_one_update_is_the_counters_but_an_estimate():
    m = _ticking()
    idle = _idle_sampled(m)  # ends on a tick (t = 6.0 s)
    _, f = request_energy(m, lambda: m.advance(PERIOD, power_w=300.0), idle)
    assert f["duration_s"] == PERIOD and f["counter_delta_mj"] == round(300.0 * PERIOD * 1000)
    assert f["gross_source"] == "counter" and f["gross_j"] == 300.0 * PERIOD
    assert f["idle_adjusted_j"] == pytest.approx((300.0 - 60.0) * PERIOD)
    assert f["estimate"] is True and "under 10 counter updates of 62.5 ms" in f["note"]


def test_a_long_window_on_a_ticking_counter_is_measured():
    m = _ticking()
    idle = _idle_sampled(m)
    _, f = request_energy(m, lambda: m.advance(10 * PERIOD, power_w=300.0), idle)
    assert f["gross_source"] == "counter" and f["gross_j"] == pytest.approx(300.0 * 10 * PERIOD)
    assert f["estimate"] is False and not f["note"].startswith("estimate")
    assert f["counter_update_s"] == PERIOD and f["counter_update_source"] == "declared by the simulated meter"


def test_no_negative_energy_from_the_counter_either():
    m = _ticking()
    idle = _idle_sampled(m, watts=119.6)
    _, f = request_energy(m, lambda: m.advance(1.0, power_w=80.0), idle)  # below the warm baseline
    assert f["gross_source"] == "counter" and f["gross_j"] == pytest.approx(80.0)
    assert f["idle_adjusted_j"] is None and "not above the idle baseline (119.6 W" in f["idle_adjusted_reason"]


def test_no_baseline_no_power_or_a_restarted_counter():
    m = _ticking()
    m.sleep(0.001)
    _, f = request_energy(m, lambda: m.advance(0.004, power_w=300.0), IdleBaseline())  # nothing sampled yet
    assert f["gross_source"] == "power" and f["idle_adjusted_j"] is None and f["idle_baseline_w"] is None
    assert f["idle_adjusted_reason"] == "no idle power sampled yet"
    assert f["method"].endswith("idle baseline: none (no idle power sampled yet)")

    class Blind(SimulatedMeter):
        def power_w(self):
            raise RuntimeError("sensor gone")

    b = Blind(idle_w=60.0, start_mj=0, start_s=1.001, update_period_s=PERIOD)
    _, f = request_energy(b, lambda: b.advance(0.004, power_w=300.0), _idle_sampled(m))
    assert f["gross_j"] is None and f["gross_source"] is None and f["idle_adjusted_j"] is None
    assert "sensor gone" in f["gross_reason"] and f["method"].startswith("none;")

    z = SimulatedMeter(idle_w=0.0, start_mj=0, start_s=1.001, update_period_s=PERIOD)  # a sensor reading 0 W
    _, f = request_energy(z, lambda: z.advance(0.004, power_w=0.0), IdleBaseline())
    assert f["gross_j"] is None and "the power read 0.0 W" in f["gross_reason"]

    class Restarted(SimulatedMeter):
        def energy_mj(self):
            return 0 if self._t > 2.0 else 5_000_000

    r = Restarted(idle_w=60.0, start_s=1.5)
    _, f = request_energy(r, lambda: r.advance(1.0, power_w=200.0), IdleBaseline())
    assert f["counter_delta_mj"] < 0 and f["gross_source"] == "power" and f["gross_j"] == pytest.approx(200.0)
    assert "went backwards" in f["gross_reason"]


def test_the_counters_period_is_watched_declared_or_assumed():
    m = SimulatedMeter(idle_w=60.0, start_mj=0, start_s=0.0, update_period_s=0.05)
    found = energy.measure_update_period(m, m.sleep)
    assert found["period_s"] == pytest.approx(0.05, abs=0.0011) and found["changes"] == 5
    assert found["step_mj"] == 3000 and found["reason"] is None  # 60 W x 50 ms

    class Stuck(SimulatedMeter):
        counter_update_s = None  # a meter that does not know its period (NvmlMeter before watching)

        def energy_mj(self):
            return 42

    s = Stuck(start_s=0.0)
    found = energy.measure_update_period(s, s.sleep, cap_s=0.2)
    assert found["period_s"] is None and found["changes"] == 0 and "could not be timed" in found["reason"]
    assert found["watched_s"] == pytest.approx(0.2, abs=0.002)
    period, how = energy.counter_resolution(s)
    assert period == energy.ASSUMED_UPDATE_S and how.startswith("assumed")
    assert energy.counter_resolution(m) == (0.05, "declared by the simulated meter")


def test_the_cold_idle_is_recorded_and_never_raises():
    m = SimulatedMeter(idle_w=76.0)
    idle = IdleBaseline()
    cold = idle.record_cold(m)
    assert cold["power_w"] == 76.0 and cold["error"] is None and idle.cold is cold

    class Broken(SimulatedMeter):
        def power_w(self):
            raise RuntimeError("NVML hiccup")

    assert "NVML hiccup" in IdleBaseline().record_cold(Broken())["error"]


# --------------------------------------------------------------------------- NVML access degrades here


def test_pci_bus_ids_of_the_record_match(run_record):
    hw = run_record["energy"]["hardware"]
    assert energy.parse_pci_bus_id(hw["cuda_pci_bus_id"]) == energy.parse_pci_bus_id(hw["nvml_pci_bus_id"])
    assert energy.parse_pci_bus_id("0000:50:00.0") != energy.parse_pci_bus_id("00000000:51:00.0")


def test_meter_and_telemetry_degrade_to_a_reason():
    nv, reason = energy.nvml()
    if nv is not None:
        pytest.skip("NVML works on this machine; the GPU check script covers it")
    meter, why = energy.open_meter()
    assert meter is None and why == reason
    assert any(word in why for word in ("NVML", "nvidia-ml-py", "driver", "GPU"))
    gpu, why = energy.gpu_telemetry()
    assert gpu is None and why == reason
    meter, why = energy.open_meter(0)
    assert meter is None and why


# --------------------------------------------------------------------------- RAPL (CPU package energy)


def _zone(root, name, label, energy_uj, max_uj):
    z = root / name
    z.mkdir(parents=True)
    (z / "name").write_text(label + "\n")
    (z / "energy_uj").write_text(f"{energy_uj}\n")
    (z / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return z


def test_rapl_packages_and_wrap(tmp_path):
    root = tmp_path / "powercap"
    p0 = _zone(root, "intel-rapl:0", "package-0", 1_000_000, 2_000_000)
    _zone(root, "intel-rapl:0:0", "core", 5, 10)  # a sub-zone: not counted
    p1 = _zone(root, "intel-rapl:1", "package-1", 1_900_000, 2_000_000)
    _zone(root, "intel-rapl:2", "psys", 0, 10)  # not a package
    domains, reason = energy.rapl_packages(root)
    assert reason is None
    assert sorted(domains) == ["intel-rapl:0:package-0", "intel-rapl:1:package-1"]
    start = energy.rapl_read(domains)
    (p0 / "energy_uj").write_text("1500000\n")  # +0.5 J
    (p1 / "energy_uj").write_text("100000\n")  # wrapped: +0.2 J
    end = energy.rapl_read(domains)
    assert energy.rapl_delta_j(domains, start, end) == pytest.approx(0.7)


def test_rapl_absent_or_unreadable(tmp_path):
    domains, reason = energy.rapl_packages(tmp_path / "missing")
    assert domains is None and "does not exist" in reason
    root = tmp_path / "powercap"
    z = _zone(root, "intel-rapl:0", "package-0", 1, 10)
    (z / "energy_uj").unlink()
    domains, reason = energy.rapl_packages(root)
    assert domains is None and "not readable" in reason


def test_every_nvml_name_used_exists_in_pynvml():
    """The GPU paths cannot run here; at least every pynvml name they use must exist."""
    import re
    from pathlib import Path

    pynvml = pytest.importorskip("pynvml")
    # learner.energy is a package now: every module of it (the NVML code is in nvml_device.py and sampler.py)
    source = "".join(f.read_text() for f in sorted(Path(energy.__file__).parent.glob("*.py")))
    names = set(re.findall(r"\b(?:nv|pynvml)\.(nvml\w+|NVML\w+)", source))
    assert {"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetPciInfo"} <= names
    missing = sorted(n for n in names if not hasattr(pynvml, n))
    assert not missing


def test_driver_version_degrades_to_none():
    if energy.nvml()[0] is not None:
        assert energy.driver_version()
    else:
        assert energy.driver_version() is None


# --------------------------------------------------------------------------- NVML handle selection (fake pynvml)


class _FakeNvml:
    """Just enough of pynvml for ``nvml_device._select``: devices as (bus id, uuid) pairs."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices, bus_lookup_fails=False, bus_answer=None):
        self.devices = devices  # list of (nvml bus id, nvml uuid)
        self.bus_lookup_fails = bus_lookup_fails
        self.bus_answer = bus_answer  # index answered by the bus lookup, whatever was asked

    def __getattr__(self, name):  # any other NVML query: not supported on this fake GPU
        if not name.startswith("nvml"):
            raise AttributeError(name)

        def unsupported(*args):
            raise self.NVMLError("Not Supported")

        return unsupported

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        if self.bus_lookup_fails:
            raise self.NVMLError("Not Found")
        if self.bus_answer is not None:
            return self.bus_answer
        for i, (b, _) in enumerate(self.devices):
            if energy.parse_pci_bus_id(b) == energy.parse_pci_bus_id(bus):
                return i
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetPciInfo(self, handle):
        return type("PciInfo", (), {"busId": self.devices[handle][0].encode()})()

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.devices):
            raise self.NVMLError("Invalid Argument")
        return i

    def nvmlDeviceGetUUID(self, handle):
        return self.devices[handle][1]


UUID_A = "GPU-6a0b3c2e-1111-2222-3333-444455556666"
UUID_B = "GPU-0f0e0d0c-aaaa-bbbb-cccc-ddddeeeeffff"


@pytest.fixture
def one_cuda_device(monkeypatch):
    """torch sees one CUDA device at 0000:50:00.0 whose uuid is UUID_B's (torch's spelling)."""
    import torch

    props = type("Props", (), {"pci_domain_id": 0, "pci_bus_id": 0x50, "pci_device_id": 0,
                                "uuid": UUID_B[4:], "total_memory": 1})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    return props


def test_uuid_spellings_compare_equal():
    assert energy.normalize_uuid(UUID_A) == energy.normalize_uuid(UUID_A[4:].upper())
    assert energy.normalize_uuid(UUID_A.replace("-", "")[3:]) == energy.normalize_uuid(UUID_A)
    assert energy.normalize_uuid(b"GPU-ab") == "ab" and energy.normalize_uuid(None) is None


def test_handle_chosen_by_pci_bus_id_when_it_matches(one_cuda_device):
    nv = _FakeNvml([("00000000:4F:00.0", UUID_A), ("00000000:50:00.0", UUID_B)])
    device, reason = nvml_device._select(nv, None)
    assert reason is None and device.handle == 1
    assert device.selected_by == "pci_bus_id" and device.selected_by_cuda_pci_bus_id


def test_handle_falls_back_to_uuid_when_the_bus_lookup_fails(one_cuda_device):
    nv = _FakeNvml([("00000000:4F:00.0", UUID_A), ("00000000:51:00.0", UUID_B)], bus_lookup_fails=True)
    device, reason = nvml_device._select(nv, None)
    assert reason is None and device.handle == 1 and device.selected_by == "uuid"
    assert not device.selected_by_cuda_pci_bus_id
    assert device.cuda_uuid == energy.normalize_uuid(UUID_B)
    assert nvml_device._hardware(nv, device)["nvml_handle_selected_by"] == "uuid"


def test_handle_falls_back_to_uuid_when_the_bus_answer_differs(one_cuda_device):
    nv = _FakeNvml([("00000000:4F:00.0", UUID_A), ("00000000:51:00.0", UUID_B)], bus_answer=0)
    device, reason = nvml_device._select(nv, None)
    assert reason is None and device.handle == 1 and device.selected_by == "uuid"


def test_no_match_by_bus_id_or_uuid_is_a_reason(one_cuda_device):
    nv = _FakeNvml([("00000000:4F:00.0", UUID_A)], bus_lookup_fails=True)
    device, reason = nvml_device._select(nv, None)
    assert device is None
    assert "0000:50:00.0" in reason and energy.normalize_uuid(UUID_B) in reason


def test_without_cuda_nvml_index_0_is_named_as_such(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, reason = nvml_device._select(_FakeNvml([("00000000:4F:00.0", UUID_A)]), None)
    assert reason is None and device.handle == 0 and device.selected_by == "index"


class _Clock:
    """A virtual clock for time.perf_counter and time.sleep (no real waiting)."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class _MeteredNvml(_FakeNvml):
    """One device whose counter updates every 80 ms at 76 W, and whose power answers the instant field."""

    NVML_SUCCESS = 0
    NVML_FI_DEV_POWER_INSTANT = 186

    def __init__(self, clock: _Clock):
        super().__init__([("00000000:50:00.0", UUID_A)])
        self.clock = clock

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return int((self.clock.t // 0.08) * 0.08 * 76_000)

    def nvmlDeviceGetFieldValues(self, handle, fields):
        value = type("V", (), {"uiVal": 76_000})()
        return [type("F", (), {"nvmlReturn": 0, "valueType": 1, "value": value})()]


def test_an_nvml_meter_reads_instant_power_and_watches_its_counter(monkeypatch):

    clock = _Clock()
    monkeypatch.setattr(nvml_device, "time", clock)
    device = nvml_device._Device(0, None, None, "00000000:50:00.0", False, "index")
    meter = nvml_device.NvmlMeter(_MeteredNvml(clock), device)
    assert meter.counter_update_s is None and energy.counter_resolution(meter)[1].startswith("assumed")
    assert meter.power_w() == 76.0 and meter.power_query == "NVML_FI_DEV_POWER_INSTANT (instantaneous)"
    found = meter.measure_counter_update()
    assert found["period_s"] == pytest.approx(0.08, abs=0.0011) and found["changes"] == 5
    assert meter.counter_update_s == found["period_s"] and meter.counter_update is found
    period, how = energy.counter_resolution(meter)
    assert period == found["period_s"] and how.startswith("measured: median of 4 interval(s)")
    # a 65.7 ms request on it is judged by the watched period: answered from power, never 0 J
    idle = IdleBaseline()
    idle.record_cold(meter)
    idle.sample(meter)
    _, f = request_energy(meter, lambda: clock.sleep(0.0657), idle)
    assert f["gross_source"] == "power" and f["gross_j"] == pytest.approx(76.0 * 0.0657)
    assert f["idle_adjusted_j"] is None and f["cold_idle_w"] == 76.0  # idle power only: nothing above idle


def test_the_service_records_the_cold_idle_at_open_and_watches_the_counter_once(monkeypatch):
    from app.runtime.energy import Energy

    clock = _Clock()
    monkeypatch.setattr(nvml_device, "time", clock)
    device = nvml_device._Device(0, 0, None, "00000000:50:00.0", False, "index")
    meter = nvml_device.NvmlMeter(_MeteredNvml(clock), device)
    watched = []
    original = meter.measure_counter_update
    monkeypatch.setattr(meter, "measure_counter_update", lambda: watched.append(1) or original())
    monkeypatch.setattr(energy, "open_meter", lambda index: (meter, None))
    service_energy = Energy()
    service_energy.open(["cuda:0"])
    idle = service_energy.idles["cuda:0"]
    assert idle.cold["power_w"] == 76.0 and len(idle) == 0  # before any work: recorded, not a sample
    service_energy.sample_idle()
    service_energy.sample_idle()
    assert watched == [1] and service_energy.counters["cuda:0"]["period_s"] == pytest.approx(0.08, abs=0.0011)
    assert len(idle) == 2 and meter.counter_update_s == pytest.approx(0.08, abs=0.0011)
