"""The service's ?measure=energy handling (app/tasks): the gated protocol's window arguments, the
measurement's timeout, and the measurement itself on a CPU worker (timing only, nothing gated)."""

from __future__ import annotations

import pytest

from app.errors import InvalidRequest
from app.tasks.device import measure_on_device
from app.tasks.options import MEASURE_PARAMS, measure_arguments, measure_timeout_s, parse_options
from learner.config import make_config
from learner.measure.gated import DEFAULTS, OVERHEAD_ALLOWANCE_S

from .conftest import small_task


def test_the_gated_windows_are_arguments_with_the_protocols_defaults():
    for name in DEFAULTS:
        assert MEASURE_PARAMS[name][3] == DEFAULTS[name]  # the service's defaults are the protocol's
    given = measure_arguments({"reference_seconds": "2.5", "sham_seconds": "1"})
    assert given["reference_seconds"] == 2.5 and given["sham_seconds"] == 1.0
    # not given: left to the protocol (its plan records what it used); the four older ones as before
    assert measure_arguments({}) == {"trials": 3, "target_seconds": 5.0, "settle_seconds": 3.0, "idle_seconds": 3.0}
    for raw, words in (({"reference_seconds": "0"}, "reference_seconds must be in"),
                       ({"sham_seconds": "nan"}, "sham_seconds must be in"),
                       ({"reference_seconds": "31"}, "reference_seconds must be in")):
        with pytest.raises(InvalidRequest, match=words):
            measure_arguments(raw)
    with pytest.raises(InvalidRequest, match="only apply with measure=energy"):
        parse_options([("sham_seconds", "2")], "cpu")
    assert parse_options([("measure", "energy"), ("sham_seconds", "2")], "cpu").measure["sham_seconds"] == 2.0


def test_the_timeout_covers_every_phase():
    args = {"trials": 2, "target_seconds": 4.0, "settle_seconds": 1.0, "idle_seconds": 2.0}
    frame = 2 * (1.0 + 2.0)
    phases = 2.0 + 2 * (10.0 + frame) + (5.0 + frame) + 3 * (4.0 + frame)  # cold idle, references, sham, harness + 2 trials
    assert measure_timeout_s(args, 7.0) == pytest.approx(phases + OVERHEAD_ALLOWANCE_S + 5 * 7.0)
    longest = {name: spec[2] for name, spec in MEASURE_PARAMS.items()}
    assert measure_timeout_s(longest, 0.0) < 3600 - 600  # one measurement well under an hour


class _NoMeter:
    def meter_for(self, engine):
        return None, "backend 'cpu' runs on the CPU"


def test_a_cpu_worker_measures_timing_only():
    doc = measure_on_device(small_task(n=24, m=5, seed=3), make_config({"batch_size": 8}), "cpu",
                            {"trials": 1, "target_seconds": 0.05, "settle_seconds": 0.0, "idle_seconds": 0.0},
                            _NoMeter())
    assert doc["energy"] is None and doc["valid"] is None and doc["gates"] is None
    assert "nothing to gate" in doc["gates_reason"]
