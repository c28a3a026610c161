"""The learner's configuration: frozen rev88 defaults and strict validation."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Config:
    depth: int = 2
    alpha: float = 0.5
    seed: int = 11
    epochs: int = 2
    learning_rate: float = 0.1
    batch_size: int = 128
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("depth", "seed", "epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config.{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ConfigError(f"config.{name} must be > 0, got {value}")
        for name in ("alpha", "learning_rate", "momentum", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"config.{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(f"config.{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"config.momentum must be in [0, 1), got {self.momentum}")
        if self.learning_rate <= 0.0:
            raise ConfigError(f"config.learning_rate must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0.0:
            raise ConfigError(f"config.weight_decay must be >= 0, got {self.weight_decay}")

    def as_dict(self) -> dict[str, Any]:
        """Key order as in the reference records' metadata.config."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return make_config(changes, base=self)


FIELDS = tuple(f.name for f in dataclasses.fields(Config))


def make_config(overrides: Mapping[str, Any] | None = None, base: Config | None = None) -> Config:
    """Defaults (or ``base``) with ``overrides`` applied; unknown keys are an error."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)}; allowed: {', '.join(FIELDS)}"
        )
    values = (base or Config()).as_dict()
    values.update(overrides)
    return Config(**values)


def coerce_config_strings(raw: Mapping[str, str]) -> dict[str, Any]:
    """Turn string values (query parameters) into ints/floats by field type."""
    out: dict[str, Any] = {}
    for key, text in raw.items():
        if key not in FIELDS:
            out[key] = text  # make_config names it as unknown
            continue
        kind = Config.__dataclass_fields__[key].type
        try:
            out[key] = int(text) if kind == "int" else float(text)
        except ValueError:
            raise ConfigError(f"config.{key} must be {'an integer' if kind == 'int' else 'a number'}, got {text!r}") from None
    return out


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config file, unvalidated (clients that let a server validate use it)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f'config file {path} must be a JSON object of config keys, e.g. {{"batch_size": 64}}')
    return data


def load_config_file(path: str | Path) -> Config:
    return make_config(read_config_json(path))
