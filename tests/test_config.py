"""Config: frozen defaults and one clear error per bad value."""

from __future__ import annotations

import dataclasses
import json

import pytest

from learner.config import Config, coerce_config_strings, load_config_file, make_config
from learner.errors import ConfigError


def test_frozen_defaults_match_record(run_record):
    assert Config().as_dict() == run_record["metadata"]["config"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().depth = 3  # frozen


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"depth": 0}, "config.depth must be > 0"),
        ({"epochs": -1}, "config.epochs must be > 0"),
        ({"batch_size": 2.5}, "config.batch_size must be an integer"),
        ({"seed": True}, "config.seed must be an integer"),
        ({"learning_rate": float("nan")}, "config.learning_rate must be finite"),
        ({"alpha": float("inf")}, "config.alpha must be finite"),
        ({"momentum": 1.0}, "config.momentum must be in [0, 1)"),
        ({"momentum": -0.1}, "config.momentum must be in [0, 1)"),
        ({"weight_decay": -1e-4}, "config.weight_decay must be >= 0"),
        ({"learning_rate": 0.0}, "config.learning_rate must be > 0"),
        ({"alpha": "0.5"}, "config.alpha must be a number"),
        ({"depht": 2}, "unknown config key(s): depht"),
    ],
)
def test_bad_config_values(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        make_config(overrides)
    assert fragment in str(err.value)


def test_deeper_is_allowed_and_ints_become_floats():
    c = make_config({"depth": 5, "alpha": 1, "momentum": 0})
    assert c.depth == 5 and isinstance(c.alpha, float) and c.momentum == 0.0


def test_query_string_coercion():
    assert make_config(coerce_config_strings({"batch_size": "64", "learning_rate": "0.05"})).batch_size == 64
    with pytest.raises(ConfigError, match="config.batch_size must be an integer"):
        coerce_config_strings({"batch_size": "sixty"})
    with pytest.raises(ConfigError, match="unknown config key"):
        make_config(coerce_config_strings({"nope": "1"}))


def test_config_file(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"depth": 1, "seed": 781}))
    assert load_config_file(p) == Config(depth=1, seed=781)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config_file(p)
    p.write_text("{bad json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config_file(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.json")
