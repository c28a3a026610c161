"""Config: frozen defaults, every value bounded, one clear error per bad value."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from learner.config import (
    BOUNDS,
    SEED_MAX,
    Config,
    coerce_config_strings,
    load_config_file,
    make_config,
)
from learner.errors import ConfigError

from .helpers import small_task


def test_frozen_defaults_match_record(run_record):
    assert Config().as_dict() == run_record["metadata"]["config"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().depth = 3  # frozen


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"depth": 0}, "config.depth must be > 0 (range [1, 64]), got 0"),
        ({"epochs": -1}, "config.epochs must be > 0 (range [1, 1000]), got -1"),
        ({"batch_size": 2.5}, "config.batch_size must be an integer"),
        ({"epochs": 2.0}, "config.epochs must be an integer, got 2.0"),
        ({"seed": True}, "config.seed must be an integer"),
        ({"learning_rate": float("nan")}, "config.learning_rate must be finite"),
        ({"alpha": float("inf")}, "config.alpha must be finite"),
        ({"momentum": 1.0}, "config.momentum must be in [0, 1), got 1.0"),
        ({"momentum": -0.1}, "config.momentum must be >= 0 (range [0, 1)), got -0.1"),
        ({"weight_decay": -1e-4}, "config.weight_decay must be >= 0 (range [0, 1e+30])"),
        ({"learning_rate": 0.0}, "config.learning_rate must be > 0 (range (0, 1e+30]), got 0.0"),
        ({"alpha": "0.5"}, "config.alpha must be a number"),
        ({"depht": 2}, "unknown config key(s): depht (did you mean depth?); allowed: depth, alpha"),
        ({"epoch": 3}, "unknown config key(s): epoch (did you mean epochs?)"),
        ({"lr": 0.1, "epoch": 3}, "unknown config key(s): epoch (did you mean epochs?), lr; allowed"),
    ],
)
def test_bad_config_values(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        make_config(overrides)
    assert fragment in str(err.value)


# ---------------------------------------------------------------------------- bounds

ABOVE = {  # the smallest value above each field's range, and the message that names it
    "depth": (65, "config.depth must be in [1, 64], got 65"),
    "seed": (SEED_MAX + 1, "config.seed must be in [0, 9223372036854775807], got 9223372036854775808"),
    "epochs": (1001, "config.epochs must be in [1, 1000], got 1001"),
    "batch_size": (65537, "config.batch_size must be in [1, 65536], got 65537"),
    "alpha": (1.0000001e30, "config.alpha must be in [-1e+30, 1e+30], got 1.0000001e+30"),
    "learning_rate": (2e30, "config.learning_rate must be in (0, 1e+30], got 2e+30"),
    "momentum": (1.0, "config.momentum must be in [0, 1), got 1.0"),
    "weight_decay": (1e31, "config.weight_decay must be in [0, 1e+30], got 1e+31"),
}
BELOW = {
    "depth": (0, "config.depth must be > 0 (range [1, 64]), got 0"),
    "seed": (-1, "config.seed must be >= 0 (range [0, 9223372036854775807]), got -1"),
    "epochs": (0, "config.epochs must be > 0 (range [1, 1000]), got 0"),
    "batch_size": (0, "config.batch_size must be > 0 (range [1, 65536]), got 0"),
    "alpha": (-2e30, "config.alpha must be >= -1e+30 (range [-1e+30, 1e+30]), got -2e+30"),
    "learning_rate": (-0.1, "config.learning_rate must be > 0 (range (0, 1e+30]), got -0.1"),
    "momentum": (-1e-9, "config.momentum must be >= 0 (range [0, 1)), got -1e-09"),
    "weight_decay": (-1e-9, "config.weight_decay must be >= 0 (range [0, 1e+30]), got -1e-09"),
}


def test_every_field_is_bounded():
    assert set(BOUNDS) == set(Config.__dataclass_fields__) == set(ABOVE) == set(BELOW)


@pytest.mark.parametrize("side", ["above", "below"])
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_bound_refused_with_its_range(name, side):
    value, message = (ABOVE if side == "above" else BELOW)[name]
    with pytest.raises(ConfigError) as err:
        make_config({name: value})
    assert str(err.value) == message
    assert err.value.details["field"] == name and err.value.status == 422


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_end_of_a_closed_range_accepted(name):
    low, high = BOUNDS[name]
    if name != "learning_rate":
        assert getattr(make_config({name: low}), name) == low
    if name != "momentum":
        assert getattr(make_config({name: high}), name) == high


def test_huge_numbers_are_config_errors_not_overflows():
    for overrides in ({"seed": 1180591620717411303424}, {"alpha": 10**400}, {"epochs": -(10**400)}):
        with pytest.raises(ConfigError, match="must be"):
            make_config(overrides)


@pytest.mark.parametrize("seed", [0, SEED_MAX])
def test_seed_at_both_ends_trains_on_cpu_and_cpu_fast(seed):
    from learner.backends import cpu_fast
    from learner.result import run_task

    task, config = small_task(40, 9, seed=3), Config(seed=seed, batch_size=16)
    backends = ["cpu"] + (["cpu-fast"] if cpu_fast.kernel_available() else [])
    results = [run_task(task, config, backend) for backend in backends]
    for result in results:
        assert result.metadata["config"]["seed"] == seed
        assert np.isfinite(result.scores).all()
    for other in results[1:]:
        for key in ("initial_parameter_sha256", "epoch_permutation_sha256", "predictions_sha256"):
            assert other.metadata[key] == results[0].metadata[key], key
    # the ends are distinct streams, and not the default's
    assert results[0].metadata["initial_parameter_sha256"] != run_task(task, Config(batch_size=16), "cpu").metadata[
        "initial_parameter_sha256"]


def test_deeper_is_allowed_and_ints_become_floats():
    c = make_config({"depth": 5, "alpha": 1, "momentum": 0})
    assert c.depth == 5 and isinstance(c.alpha, float) and c.momentum == 0.0


# ---------------------------------------------------------------------------- query strings


def test_query_string_coercion():
    assert make_config(coerce_config_strings({"batch_size": "64", "learning_rate": "0.05"})).batch_size == 64
    assert coerce_config_strings({"seed": str(SEED_MAX), "alpha": "-1e30"}) == {"seed": SEED_MAX, "alpha": -1e30}
    with pytest.raises(ConfigError, match="config.batch_size must be an integer"):
        coerce_config_strings({"batch_size": "sixty"})
    with pytest.raises(ConfigError, match="unknown config key"):
        make_config(coerce_config_strings({"nope": "1"}))


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"seed": "1180591620717411303424"}, "config.seed must be in [0, 9223372036854775807], got 1180591620717411303424"),
        ({"seed": "9" * 5000}, "config.seed must be in [0, 9223372036854775807], got 99999999999999999999"),
        ({"seed": "-" + "9" * 5000}, "config.seed must be >= 0 (range [0, 9223372036854775807])"),
        ({"depth": "65"}, "config.depth must be in [1, 64], got 65"),
        ({"epochs": "2.5"}, "config.epochs must be an integer, got '2.5'"),
        ({"epochs": "2.0"}, "config.epochs must be an integer, got '2.0'"),
        ({"epochs": "1e3"}, "config.epochs must be an integer"),
        ({"alpha": "1e400"}, "config.alpha must be finite"),
        ({"learning_rate": "nan"}, "config.learning_rate must be finite"),
        ({"learning_rate": "1e31"}, "config.learning_rate must be in (0, 1e+30], got 1e+31"),
    ],
)
def test_query_strings_out_of_range_are_config_errors(raw, message):
    with pytest.raises(ConfigError) as err:
        coerce_config_strings(raw)
    assert message in str(err.value)
    assert len(str(err.value)) < 200  # a huge value is shortened, not echoed


def test_config_file(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"depth": 1, "seed": 781}))
    assert load_config_file(p) == Config(depth=1, seed=781)
    p.write_text(json.dumps({"seed": 2**64}))
    with pytest.raises(ConfigError, match=r"config.seed must be in \[0, 9223372036854775807\]"):
        load_config_file(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config_file(p)
    p.write_text("{bad json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config_file(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.json")
