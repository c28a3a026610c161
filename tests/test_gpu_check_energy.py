"""scripts/gpu_check_energy.py --dry-run: the gated protocol on the simulated board with the long
windows of ``rev88 measure``'s defaults, healthy and one failing scenario, each gate printed, the
reference figures with a band made from them, the sham residual, the cold and paired idle, the
counter's period and one per-request figure (the device path needs a GPU: not run here)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("gpu_check_energy", ROOT / "scripts" / "gpu_check_energy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_energy_section_dry_run(tmp_path):
    module = _module()
    lines: list[str] = []
    result = module.run(tmp_path, dry_run=True, log=lines.append)
    assert result["passed"] is True, {k: v for k, v in result["checks"].items() if not v}
    assert result["scenarios"] == {"healthy": {"valid": True, "failed_gates": []},
                                   "counter-drift": {"valid": False, "failed_gates": ["meters_agree"]}}
    assert result["checks"]["simulated_counter_drift_fails_meters_agree"] is True
    assert set(result["gates"]) == {"reference", "meters_agree", "sham_residual", "round_spread", "telemetry",
                                    "exclusive_gpu", "task_verified"}
    # the long windows ran (the device's protocol), with no budget given
    assert result["protocol"] == module.GATED_LONG and "budget_cut" not in result
    assert result["protocol_windows"].startswith("long")
    printed = "\n".join(lines)
    for gate in result["gates"]:
        assert f"pass      {gate}" in printed  # every gate printed, with its reason
    # the board's reference figures, its band, and a band made from this run for the next board
    ref = result["reference"]
    assert ref["board"] == "rev88 simulated board" and ref["status"] == "pass"
    assert set(ref["windows"]) == {"reference_before", "reference_after"}
    assert ref["band_from_this_run"] == {"j_per_tflop": [5.9, 10.9], "tflop_per_s": [15.0, 23.0]}
    assert "reference on rev88 simulated board, reference_before: 19.00 TFLOP/s" in printed
    assert 'a band from this run (gates.band_from_run' in printed
    # the sham residual on the long windows, and the baseline beside the cold idle
    sham = result["sham_residual"]
    assert sham["status"] == "pass" and sham["sham_seconds"] == 5.0 and sham["limit"] == 0.05
    assert "sham residual on long (rev88 measure's defaults) windows" in printed
    idle = result["idle"]
    assert idle["baseline"] == "paired" and idle["cold"]["counter_w"] == pytest.approx(60.0, abs=0.5)
    assert idle["settles"] == 14 and "cold idle (before the protocol's work)" in printed
    # the counter's period (the simulated board's 25 ms) and a per-request figure that obeys the rules
    assert result["counter_update"]["period_s"] == pytest.approx(0.025, abs=0.0011)
    request = result["per_request"]
    assert all(request["rules"].values())
    # the dry meter's counter moves every 100 ms: a shorter run is answered from power
    assert request["counter_update_s"] == 0.1
    assert request["gross_source"] == ("power" if request["duration_s"] < 0.1 else "counter")
    saved = json.loads((tmp_path / "energy_check.json").read_text())
    assert saved["gated"]["valid"] is True and saved["gated_scenarios"]["counter-drift"]["valid"] is False
    assert saved["gated"]["plan"]["options"]["sham_seconds"] == 5.0


def test_without_room_for_the_long_windows_the_short_rehearsal_runs_and_says_so(tmp_path):
    module = _module()
    result = module.run(tmp_path, dry_run=True, log=lambda *_: None, deadline=time.monotonic() + 60.0,
                        reserve_s=1000.0)
    assert result["protocol"] == module.GATED_DEVICE and "budget_cut" in result and result["windows"] == "short"
    assert "the short rehearsal ran instead" in result["budget_cut"]
    # the checks passed, but the long windows' measurement was cut: not a pass (exit status 3)
    assert result["checks_passed"] is True and result["passed"] is False
    assert result["sham_residual"]["windows"].startswith("short")


def test_the_long_windows_are_rev88_measures_defaults_and_fit_the_estimate():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import gpu_check_common as common

    from learner.measure.gated import DEFAULTS

    module = _module()
    assert module.GATED_LONG == DEFAULTS
    assert common.gated_window_seconds(module.GATED_LONG) == 129.0
    assert module.LONG_NEED_S == 129.0 + 3.0 + module.LONG_OVERHEAD_S
    assert module.LONG_NEED_S <= gpu_check.DEVICE_ESTIMATE_S["energy"]


def test_the_per_request_rules_catch_a_negative_or_quantized_figure():
    module = _module()
    good = {"gross_j": 4.0, "gross_source": "power", "idle_adjusted_j": None,
            "idle_adjusted_reason": "not above the idle baseline", "counter_delta_mj": 0, "duration_s": 0.0657,
            "counter_update_s": 0.1, "method": "power-at-window-end-x-duration (...); idle baseline: median ..."}
    assert all(module.per_request_rules(good).values())
    # the first H200 run's figure: 0.000 J gross from the counter, -7.857 J idle-adjusted
    h200 = {**good, "gross_j": 0.0, "gross_source": "counter", "idle_adjusted_j": -7.857, "idle_adjusted_reason": None,
            "method": "nvml-total-energy-counter-delta"}
    rules = module.per_request_rules(h200)
    assert not rules["gross_above_zero"] and not rules["counter_used_only_where_it_advanced"]
    assert not rules["idle_adjusted_above_zero_or_none_with_a_reason"] and not rules["baseline_named"]


def test_device_protocol_settles_at_least_a_second():
    """On the GPU each trial's idle-adjusted energy must be > 0: an idle window that begins while
    board power is still raised from the window before eats into it, so every settle may last >= 1 s
    (the settle is a cap: it ends sooner only when the power has stopped falling)."""
    module = _module()
    assert module.GATED_DEVICE["settle_seconds"] >= 1.0 and module.GATED_LONG["settle_seconds"] >= 1.0
    assert "1 s settle" in module.__doc__
