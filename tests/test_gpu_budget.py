"""The GPU runs' budget, tested rather than hoped (issue #53): scripts/gpu_budget.py's table of
device seconds, replayed for every documented plan through ``gpu_check.run_check`` itself with the
scripts' own budget rules (which sections start, the reserve each keeps, the energy windows, the
fused energy trials, the tests' cap, each tuning candidate); a plan passes only when no section
is cut, interrupted or skipped and no measurement is left out. Raising one part's seconds past
what a plan leaves makes the replay fail -- the guard is checked, not assumed. The dry run makes
the same decisions on the same projected clock, so it fails the same way.

No GPU and no timing here: the clock is the table's, so the results do not depend on this
machine's speed."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import gpu_budget  # noqa: E402
import gpu_check  # noqa: E402
import gpu_check_common as common  # noqa: E402
import gpu_check_energy  # noqa: E402
import gpu_check_fused  # noqa: E402
import gpu_check_tests  # noqa: E402
import gpu_tune  # noqa: E402


def _replay(plan: str, tmp_path) -> dict:
    return gpu_budget.replay_plan(gpu_budget.PLANS[plan], tmp_path / plan)


@pytest.mark.parametrize("plan", sorted(gpu_budget.PLANS))
def test_every_documented_plan_measures_everything(plan, tmp_path):
    """Every section of every call starts, decides for its full measurement and ends inside the
    budget and its own limit; the arithmetic of the calls fits the session."""
    result = _replay(plan, tmp_path)
    assert result["arithmetic"] == [], result["arithmetic"]
    for call in result["calls"]:
        assert call["problems"] == [], gpu_budget.describe(result)
    assert result["fits"], gpu_budget.describe(result)


def test_the_replay_went_through_the_sections_own_decisions(tmp_path):
    """The stand-ins called the real rules: the energy section chose the long windows, fused its
    energy trials, the tests section a cap above their expected seconds, the tuning run every
    candidate -- each with the seconds left that the table projects."""
    call1, call2 = gpu_budget.PLANS["two-call"].calls
    one = gpu_budget.replay(call1, tmp_path / "1")
    assert one["sections"]["energy"]["protocol_windows"] == "long"
    assert one["sections"]["fused"]["energy_attempted"] is True
    assert list(one["sections"]) == ["precheck", "cuda", "energy", "fused", "service"]
    # the fused section decides after its checks: with the table's seconds up to there
    fused = one["sections"]["fused"]
    assert fused["projected_start_s"] == pytest.approx(sum(gpu_budget.expected_seconds()[s]
                                                           for s in ("precheck", "cuda", "energy")))
    assert fused["reserve_s"] == gpu_budget.expected_seconds()["service"]
    two = gpu_budget.replay(call2, tmp_path / "2")
    assert list(two["sections"]) == ["precheck", "tune", "tests"]
    assert two["sections"]["tune"]["not_run"] == [] and two["sections"]["tune"]["candidates_run"] == len(
        gpu_tune.candidates())
    tests = two["sections"]["tests"]
    assert tests["cap_s"] >= gpu_budget.SECTIONS["tests"].seconds
    # the cap is what the budget leaves (72 s here), not the section's own 90 s
    assert tests["cap_s"] == pytest.approx(min(gpu_check_tests.DEVICE_CAP_S, tests["projected_left_s"]))
    assert tests["cap_s"] < gpu_check_tests.DEVICE_CAP_S
    assert two["exit_status"] == one["exit_status"] == 0


def test_the_two_calls_are_within_the_issues_limits():
    call1, call2 = gpu_budget.PLANS["two-call"].calls
    assert gpu_budget.call_projection(call1) <= 330 and call1.limit_s == 330
    assert gpu_budget.call_projection(call2) <= 300 and call2.limit_s == 300
    assert "tests" not in call1.sections and {"tune", "tests"} <= set(call2.sections)
    assert set(call1.sections) | set(call2.sections) == set(gpu_check.ALL_SECTIONS)
    # each command fits the device tool: 10 minutes a command, 15 minutes a session with a start
    plan = gpu_budget.PLANS["two-call"]
    assert gpu_budget.START_S + sum(c.timeout_s + gpu_budget.TRANSFER_S for c in plan.calls) <= 900
    assert gpu_budget.START_S + sum(c.timeout_s + gpu_budget.TRANSFER_S for c in gpu_budget.PLANS["600-s-left"].calls) <= 600


def _slack(call: gpu_budget.Call) -> float:
    """The seconds a call's budget leaves over its sections' expected seconds."""
    expected = gpu_budget.expected_seconds()
    return call.budget_s - sum(expected[s] for s in gpu_budget.ordered(call.sections))


def _raise_section(monkeypatch, name: str, by: float) -> None:
    if name == "fused":
        monkeypatch.setitem(gpu_budget.FUSED_PARTS, "checks", gpu_budget.FUSED_PARTS["checks"] + by)
    elif name == "tune":
        monkeypatch.setitem(gpu_budget.TUNE, "draws",
                            dataclasses.replace(gpu_budget.TUNE["draws"], seconds=gpu_budget.TUNE["draws"].seconds + by))
    else:
        monkeypatch.setitem(gpu_budget.SECTIONS, name,
                            dataclasses.replace(gpu_budget.SECTIONS[name], seconds=gpu_budget.SECTIONS[name].seconds + by))


@pytest.mark.parametrize("plan, call_index, name", [
    (plan, i, name) for plan, p in sorted(gpu_budget.PLANS.items()) for i, call in enumerate(p.calls)
    for name in gpu_budget.ordered(call.sections)])
def test_a_section_raised_past_the_plans_slack_fails_the_replay(plan, call_index, name, monkeypatch, tmp_path):
    """The guard can fail: one section's expected seconds raised by one second more than its
    call's budget leaves makes the replay report a cut, a skipped measurement or a section past
    the budget -- whichever the scripts' own rules decide."""
    call = gpu_budget.PLANS[plan].calls[call_index]
    by = _slack(call) + 1
    _raise_section(monkeypatch, name, by)
    result = gpu_budget.replay(call, tmp_path / "raised")
    assert result["problems"], f"{plan} call {call_index + 1}: {name} +{by:g} s went unnoticed"


def test_a_raise_within_the_slack_still_fits(monkeypatch, tmp_path):
    """... and the margin is real: the last section raised by less than the slack still fits."""
    call = gpu_budget.PLANS["two-call"].calls[0]
    _raise_section(monkeypatch, "service", _slack(call) - 1)
    assert gpu_budget.replay(call, tmp_path / "r")["problems"] == []


@pytest.mark.parametrize("part, by, words", [
    ("energy_trials", 40, "fused: budget_cut"),  # the fused section's own decision cuts its trials
    ("checks", 40, "fused: budget_cut"),
])
def test_the_fused_energy_trials_are_cut_when_their_part_grows(part, by, words, monkeypatch, tmp_path):
    monkeypatch.setitem(gpu_budget.FUSED_PARTS, part, gpu_budget.FUSED_PARTS[part] + by)
    result = gpu_budget.replay(gpu_budget.PLANS["two-call"].calls[0], tmp_path / "r")
    assert any(p.startswith(words) for p in result["problems"]), result["problems"]


def test_slower_candidates_leave_some_not_run(monkeypatch, tmp_path):
    """A tuning candidate that is not run for the budget is a skipped measurement: the replay says which."""
    monkeypatch.setitem(gpu_budget.TUNE, "fused_one", dataclasses.replace(gpu_budget.TUNE["fused_one"], seconds=8))
    result = gpu_budget.replay(gpu_budget.PLANS["two-call"].calls[1], tmp_path / "r")
    assert any("candidate" in p and "not run" in p for p in result["problems"]), result["problems"]


def test_the_dry_run_decides_as_the_device_would(tmp_path):
    """run_check in a dry run reads the projected device clock: the two-call plan's call 1 passes,
    and with a device budget too small for it the energy section falls back to the short windows
    and the run exits 3 -- the way the device run would."""
    call = gpu_budget.PLANS["two-call"].calls[0]
    stand_ins = gpu_budget._stand_ins(print)
    sections = list(gpu_budget.ordered(call.sections))
    report, status = gpu_check.run_check(tmp_path / "ok", ROOT / "data" / "mnist", True, sections, 300,
                                         runners=stand_ins, log=lambda *a: None, device_budget_s=call.budget_s,
                                         check_inputs=False)
    assert status == 0 and report["device_budget_s"] == call.budget_s
    assert report["projected_device_seconds"] == pytest.approx(sum(gpu_budget.expected_seconds()[s] for s in sections))
    assert "proj.s" in (tmp_path / "ok" / "summary.txt").read_text()
    report, status = gpu_check.run_check(tmp_path / "small", ROOT / "data" / "mnist", True, sections, 300,
                                         runners=stand_ins, log=lambda *a: None, device_budget_s=call.budget_s - 40,
                                         check_inputs=False)
    assert status == 3 and report["sections"]["energy"]["budget_cut"]
    assert "cut" in (tmp_path / "small" / "summary.txt").read_text()


def test_a_section_without_its_minimum_left_is_not_started(tmp_path):
    """gpu_check.may_start on the projected clock: 30 s left after precheck and cuda is under the
    fused section's 60 s minimum, so it is skipped (not started and then cut)."""
    call = gpu_budget.Call(("precheck", "cuda", "fused"), 60, 200, 200)
    result = gpu_budget.replay(call, tmp_path / "r")
    fused = result["sections"]["fused"]
    assert fused["skipped"].startswith("not started for the device budget") and "needs 60 s" in fused["skipped"]
    assert result["sections"]["cuda"]["passed"] is True and result["exit_status"] == 3


def test_a_section_projected_past_the_device_budget_is_cut(tmp_path):
    """A section whose own decisions cannot shorten it (the service) and that would end past the
    device budget: the device's alarm would interrupt it, so the replay and the dry run call it cut."""
    call = gpu_budget.Call(("precheck", "service"), 60, 200, 200)
    result = gpu_budget.replay(call, tmp_path / "r")
    assert any(p.startswith("service: budget_cut") and "device budget" in p for p in result["problems"])


# --------------------------------------------------------------------------- the table itself


def test_every_section_and_part_has_its_figure_and_source():
    for name in gpu_check.ALL_SECTIONS:
        cost = gpu_budget.SECTIONS[name]
        assert cost.source and cost.limit_s and name in gpu_budget.MIN_START_S["device"]
        assert gpu_budget.expected_seconds()[name] <= cost.limit_s, name
        assert gpu_budget.MIN_START_S["device"][name] <= gpu_budget.expected_seconds()[name] or name == "precheck"
    for name, cost in gpu_budget.TUNE.items():
        assert cost.source, name
        if cost.limit_s is not None:
            assert cost.seconds <= cost.limit_s, name
    assert gpu_budget.SECTIONS["fused"].seconds == sum(gpu_budget.FUSED_PARTS.values())
    assert set(gpu_check.DEVICE_ESTIMATE_S) == set(gpu_check.ALL_SECTIONS)


def test_the_tables_windows_are_the_protocols():
    """The energy figures come from the protocols the sections run, not typed twice."""
    assert common.gated_window_seconds(gpu_check_energy.GATED_LONG) == gpu_budget.ENERGY_LONG_WINDOWS_S
    assert common.gated_window_seconds(gpu_check_energy.GATED_DEVICE) == gpu_budget.ENERGY_SHORT_WINDOWS_S
    assert gpu_check_energy.LONG_NEED_S == gpu_budget.SECTIONS["energy"].seconds
    assert gpu_check_energy.LONG_OVERHEAD_S == gpu_budget.ENERGY_OVERHEAD_S
    p = gpu_check_fused.PERF_DEVICE  # learner.measure.paired: a cold idle, then per trial two settles and idles
    per_variant = p["idle_seconds"] + p["trials"] * (p["target_seconds"] + 2 * p["settle_seconds"] + 2 * p["idle_seconds"])
    assert per_variant == gpu_budget.FUSED_ENERGY_WINDOWS_PER_VARIANT_S
    assert gpu_check_fused.ENERGY_NEED_S == gpu_budget.FUSED_PARTS["timing"] + gpu_budget.FUSED_PARTS["energy_trials"]
    assert gpu_check_tests.DEVICE_CAP_S < gpu_budget.SECTIONS["tests"].limit_s
    assert gpu_check_tests.DEVICE_CAP_S >= gpu_budget.SECTIONS["tests"].seconds


def test_both_scripts_read_the_one_table():
    assert gpu_check.DEVICE_ESTIMATE_S == gpu_budget.expected_seconds()
    assert gpu_check.MIN_START_S is gpu_budget.MIN_START_S
    estimate = gpu_tune.estimate_device_s(gpu_tune.candidates())
    assert estimate["total_s"] == gpu_budget.expected_seconds()["tune"] and estimate["fits"]
    for c in gpu_tune.candidates():
        assert gpu_tune.cost_of(c) is gpu_budget.TUNE[gpu_tune.cost_key(c)]
    text = gpu_tune.projection_text()
    assert "fused one 128x8 ieee" in text and "not run 0" in text


def test_docs_give_the_plans_calls_verbatim():
    """docs/gpu.md gives every plan's calls as the table makes them (command, carry, timeout_s)."""
    doc = (ROOT / "docs" / "gpu.md").read_text()
    for plan in gpu_budget.PLANS.values():
        for call in plan.calls:
            assert call.command() in doc, call.command()
    for plan in gpu_budget.PLANS.values():
        for call in plan.calls:
            match = re.search(rf"{re.escape(call.command())}", doc)
            assert match
    # the projected seconds the docs state are the table's
    projected = re.findall(r"projected (\d+) s", doc, re.I)
    for call in gpu_budget.PLANS["two-call"].calls:
        assert str(round(gpu_budget.call_projection(call))) in projected
