"""The learner's configuration: frozen rev88 defaults and strict validation.

Every value is bounded (``BOUNDS``), so no config can ask for unbounded work or memory
by itself and no value can overflow what the code hands it to:

    depth          [1, 64]          coupling blocks (the fused backend allows at most 32)
    seed           [0, 2**63 - 1]   see SEED_MAX
    epochs         [1, 1000]
    batch_size     [1, 65536]
    alpha          [-1e30, 1e30]    see FLOAT_MAX
    learning_rate  (0, 1e30]
    momentum       [0, 1)
    weight_decay   [0, 1e30]

Integer fields take integers only (not bools, not floats such as 2.5 or 2.0). How much a
task may cost with a given config also depends on its size: ``learner.budget``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError

# Seeds go to torch.Generator.manual_seed (initial parameters) and numpy's PCG64
# (permutations). Measured with torch 2.13 and numpy 2.4: manual_seed accepts
# [-2**63, 2**64 - 1] and wraps negatives modulo 2**64 (seed -1 gives the stream of
# 2**64 - 1), anything else raises "Overflow when unpacking long long"; PCG64 accepts
# every integer >= 0 (however large) and refuses negatives. Both accept [0, 2**64 - 1]
# and map distinct seeds there to distinct streams; we keep the half that is a signed
# 64-bit integer everywhere (JSON readers, npz, C), 0 included.
SEED_MAX = 2**63 - 1

# Every backend computes in float32 (largest finite value ~3.4e38); torch refuses a Python
# float beyond that range as an SGD step size ("value cannot be converted to type float
# without overflow"). 1e30 leaves room and is far beyond any value that trains: anything
# above ~10 for alpha or learning_rate diverges, and divergence stops the run early.
FLOAT_MAX = 1e30

# field: (lowest, highest), both included except where EXCLUSIVE says otherwise
BOUNDS: dict[str, tuple[int, int] | tuple[float, float]] = {
    "depth": (1, 64),
    "alpha": (-FLOAT_MAX, FLOAT_MAX),
    "seed": (0, SEED_MAX),
    "epochs": (1, 1000),
    "learning_rate": (0.0, FLOAT_MAX),
    "batch_size": (1, 65536),
    "momentum": (0.0, 1.0),
    "weight_decay": (0.0, FLOAT_MAX),
}
EXCLUSIVE = {"learning_rate": "low", "momentum": "high"}  # learning_rate > 0, momentum < 1
INT_FIELDS = ("depth", "seed", "epochs", "batch_size")
FLOAT_FIELDS = ("alpha", "learning_rate", "momentum", "weight_decay")


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
        for name in INT_FIELDS + FLOAT_FIELDS:
            object.__setattr__(self, name, check_value(name, getattr(self, name)))

    def as_dict(self) -> dict[str, Any]:
        """Key order as in the reference records' metadata.config (the fields are plain numbers:
        a shallow dict, what ``dataclasses.asdict`` gives at a tenth of its cost)."""
        return {name: getattr(self, name) for name in FIELDS}

    def replace(self, **changes: Any) -> Config:
        return make_config(changes, base=self)


FIELDS = tuple(f.name for f in dataclasses.fields(Config))


_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")


def bound_text(name: str) -> str:
    """The allowed range of a field in interval notation, e.g. '[1, 64]' or '(0, 1e+30]'."""
    low, high = BOUNDS[name]
    left = "(" if EXCLUSIVE.get(name) == "low" else "["
    right = ")" if EXCLUSIVE.get(name) == "high" else "]"
    if name in INT_FIELDS:
        return f"{left}{low}, {high}{right}"
    return f"{left}{low:g}, {high:g}{right}"


def in_bounds(name: str, value: int | float) -> bool:
    """Exact for ints of any size (Python compares int with float exactly)."""
    low, high = BOUNDS[name]
    above_low = value > low if EXCLUSIVE.get(name) == "low" else value >= low
    below_high = value < high if EXCLUSIVE.get(name) == "high" else value <= high
    return above_low and below_high


def _shown(value: object) -> str:
    plain = isinstance(value, int) or (isinstance(value, str) and _INTEGER.fullmatch(value))
    text = str(value).strip() if plain else repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def out_of_range(name: str, value: int | float | str) -> ConfigError:
    """'config.depth must be in [1, 64], got 65'; below the range, the lower bound first:
    'config.depth must be > 0 (range [1, 64]), got 0'."""
    low = BOUNDS[name][0]
    number = float(value) if isinstance(value, str) else value
    if number > low or (number == low and EXCLUSIVE.get(name) != "low"):
        return ConfigError(f"config.{name} must be in {bound_text(name)}, got {_shown(value)}", field=name)
    if EXCLUSIVE.get(name) == "low":
        lower = f"> {low:g}"
    elif name in INT_FIELDS and low == 1:
        lower = "> 0"
    else:
        lower = f">= {low:g}" if name in FLOAT_FIELDS else f">= {low}"
    return ConfigError(f"config.{name} must be {lower} (range {bound_text(name)}), got {_shown(value)}", field=name)


def check_value(name: str, value: Any) -> int | float:
    """``value`` checked for field ``name``: the int, or the number as a float."""
    if name in INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config.{name} must be an integer, got {_shown(value)}", field=name)
        if not in_bounds(name, value):
            raise out_of_range(name, value)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.{name} must be a number, got {_shown(value)}", field=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config.{name} must be finite, got {value!r}", field=name)
    if not in_bounds(name, value):  # before float(): a huge int would overflow it
        raise out_of_range(name, value)
    return float(value)


def nearest(word: str, choices) -> str | None:
    """The one of ``choices`` that ``word`` most likely misspells (difflib's closest match at
    least 0.6 alike: ``epoch`` -> ``epochs``), or None."""
    found = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_text(unknown, choices) -> str:
    """``epoch (did you mean epochs?), lr``: unknown names, each with the choice it likely misspells."""
    words = []
    for name in unknown:
        near = nearest(name, choices)
        words.append(f"{name} (did you mean {near}?)" if near else str(name))
    return ", ".join(words)


_DEFAULTS: Config | None = None  # Config() once: it is frozen, and checking it costs 8 field checks


def make_config(overrides: Mapping[str, Any] | None = None, base: Config | None = None) -> Config:
    """Defaults (or ``base``) with ``overrides`` applied; unknown keys are an error."""
    global _DEFAULTS
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown config key(s): {unknown_text(unknown, FIELDS)}; allowed: {', '.join(FIELDS)}")
    if base is None:
        if _DEFAULTS is None:
            _DEFAULTS = Config()
        base = _DEFAULTS
        if not overrides:
            return base
    values = base.as_dict()
    values.update(overrides)
    return Config(**values)


def coerce_config_strings(raw: Mapping[str, str]) -> dict[str, Any]:
    """Turn string values (query parameters) into ints/floats by field type, each checked
    against its bounds (a huge integer is a ConfigError naming the range, never an overflow)."""
    out: dict[str, Any] = {}
    for key, text in raw.items():
        if key not in FIELDS:
            out[key] = text  # make_config names it as unknown
            continue
        if key in INT_FIELDS:
            if not isinstance(text, str) or not _INTEGER.fullmatch(text):
                raise ConfigError(f"config.{key} must be an integer, got {_shown(text)}", field=key)
            if len(text.strip().lstrip("+-")) > 30:  # far outside every range; int() would be slow
                raise out_of_range(key, text)
            out[key] = check_value(key, int(text))
        else:
            try:
                number = float(text)
            except (TypeError, ValueError):
                raise ConfigError(f"config.{key} must be a number, got {_shown(text)}", field=key) from None
            out[key] = check_value(key, number)
    return out


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config file, unvalidated (clients that let a server validate use it)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    except ValueError as exc:  # e.g. an integer literal over Python's digit limit
        raise ConfigError(f"config file {path} could not be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f'config file {path} must be a JSON object of config keys, e.g. {{"batch_size": 64}}')
    return data


def load_config_file(path: str | Path) -> Config:
    return make_config(read_config_json(path))
