"""Re-analysis of a stored energy record from its raw readings alone.

``analyze(record)`` recomputes every figure and gate and compares them, value by value, with
what the record says:

- a gated record (``record_format`` rev88-gated-energy/2; a /1 record, written before the cold
  idle and the slope-tested settles, is refused with that reason): ``figures.derive`` on the record's
  ``raw``, ``plan`` and ``thresholds`` -- the function that wrote the record -- so every value
  must match exactly (compared as JSON text, so 1 and 1.0 differ); ``plan_sha256`` and
  ``raw_sha256`` are recomputed too, and the recorded thresholds are compared with the ones this
  code sets for the record's board (``thresholds_match_code``: a record whose thresholds were
  loosened after the fact shows here).
- a paired-idle record without gates (the reference record's ``energy`` object: per trial
  the counter readings at each window's edges): each window's duration, energy and power,
  each trial's paired idle power and mJ per task, and the summary are recomputed with
  ``learner.measure.paired``'s functions and compared exactly; the gates such a record has readings
  for (``round_spread`` on its idle-adjusted figures, ``task_verified`` on its before/after
  hashes) are evaluated, every other gate is ``missing`` (no readings for it), so it is never
  valid. Its CUDA ms per task cannot be recomputed (the record keeps no CUDA-event times).
"""

from __future__ import annotations

import json

from . import gates as gates_mod
from . import paired as measure
from .figures import DERIVED_PLACES, RECORD_FORMAT, canonical_sha256, derive, normalized, task_repeat_check

_MISSING = object()


class AnalyzeError(ValueError):
    """The document is not a record this module can re-analyze."""


def _get(doc, path):
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return _MISSING
        doc = doc[key]
    return doc


def _leaves(value, path: str):
    if isinstance(value, dict):
        if not value:
            yield path, value
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}")
    elif isinstance(value, list):
        if not value:
            yield path, value
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _text(value) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False)


def compare(name: str, recorded, recomputed) -> tuple[int, list[dict]]:
    """(values compared, differences) between a recorded part and its recomputation."""
    if recorded is _MISSING:
        return 0, [{"path": name, "recorded": "(absent)", "recomputed": recomputed}]
    mine = dict(_leaves(normalized(recomputed), name))
    theirs = dict(_leaves(recorded, name))
    differences = [{"path": p, "recorded": theirs.get(p, "(absent)"), "recomputed": mine.get(p, "(absent)")}
                   for p in sorted(set(mine) | set(theirs))
                   if p not in mine or p not in theirs or _text(mine[p]) != _text(theirs[p])]
    return len(mine), differences


def analyze(record: dict) -> dict:
    if not isinstance(record, dict):
        raise AnalyzeError("a record is a JSON object")
    if record.get("record_format") == RECORD_FORMAT:
        return _gated(record)
    if str(record.get("record_format", "")).startswith("rev88-gated-energy/"):
        raise AnalyzeError(f"a {record['record_format']} record: this code writes and re-analyzes {RECORD_FORMAT} "
                           "(/2 added the cold idle and the slope-tested settles); re-analyze it with the code that "
                           "wrote it (its git history)")
    trials = _get(record, ("energy", "trials"))
    if isinstance(trials, list) and trials and isinstance(trials[0], dict) and "active" in trials[0]:
        return _paired_idle(record)
    raise AnalyzeError(f"not a gated energy record ({RECORD_FORMAT}) nor a paired-idle record with raw readings "
                       "(energy.trials[].active.start/end)")


def _gated(record: dict) -> dict:
    for key in ("raw", "plan", "thresholds"):
        if not isinstance(record.get(key), dict):
            raise AnalyzeError(f"the gated record has no {key!r} object")
    derived = derive(record["raw"], record["plan"], record["thresholds"])
    compared, differences = 0, []
    for name, place in DERIVED_PLACES.items():
        n, diff = compare(".".join(place), _get(record, place), derived[name])
        compared += n
        differences.extend(diff)
    board = record.get("board") or {}
    expected = normalized(gates_mod.thresholds_for(board.get("kind", "nvml"), (record.get("hardware") or {}).get("gpu")))
    return {
        "format": RECORD_FORMAT,
        "reproduced": not differences,
        "values_compared": compared,
        "differences": differences,
        "thresholds_match_code": expected == record["thresholds"],
        "valid": derived["valid"],
        "failed_gates": derived["failed_gates"],
        "gates": derived["gates"],
        "figures": derived["figures"],
        "board": board,
        "plan_sha256": derived["plan_sha256"],
        "raw_sha256": derived["raw_sha256"],
    }


def _paired_idle(record: dict) -> dict:
    energy = record["energy"]
    compared, differences = 0, []
    trials = []
    for i, t in enumerate(energy["trials"]):
        ib, active, ia = (measure.window(t[k]["start"], t[k]["end"], t[k].get("settle_seconds") if k != "active" else None)
                          for k in ("idle_before", "active", "idle_after"))
        for key, ours in (("idle_before", ib), ("active", active), ("idle_after", ia)):
            for field in ("duration_s", "energy_j", "average_power_w"):
                n, diff = compare(f"energy.trials[{i}].{key}.{field}", _get(t, (key, field)), ours[field])
                compared, differences = compared + n, differences + diff
        cuda = t.get("cuda_ms_per_task")
        figures = measure.trial_figures(ib, active, ia, t["invocations"], None if cuda is None else cuda * t["invocations"])
        for field in ("paired_idle_w", "idle_adjusted_mj_per_task", "unadjusted_mj_per_task", "wall_ms_per_task"):
            n, diff = compare(f"energy.trials[{i}].{field}", _get(t, (field,)), figures[field])
            compared, differences = compared + n, differences + diff
        figures["cuda_ms_per_task"] = cuda  # not recomputable: the record keeps no CUDA-event times
        trials.append({"trial": t.get("trial", i), "invocations": t["invocations"], **figures})
    summary = measure.summary(trials)
    if isinstance(energy.get("summary"), dict):
        for key in measure.SUMMARY_KEYS:
            n, diff = compare(f"energy.summary.{key}", _get(energy, ("summary", key)), summary[key])
            compared, differences = compared + n, differences + diff
    th = gates_mod.thresholds_for("nvml", (energy.get("hardware") or {}).get("gpu"))
    gates = {name: {"status": "missing", "passed": False, "threshold": th[name], "measured": None,
                    "reason": "the record holds no readings for this gate (a paired-idle record without "
                              "power samples, reference windows, sham, harness control or process checks)"}
             for name in gates_mod.GATE_NAMES}
    values = [t["idle_adjusted_mj_per_task"] for t in trials]
    gates["round_spread"] = gates_mod.round_spread_gate(values, th["round_spread"])
    gates["round_spread"]["reason"] += " (on idle-adjusted mJ per task: this record has no harness control)"
    before, after = energy.get("before_metadata"), energy.get("after_metadata")
    if isinstance(before, dict) and isinstance(after, dict):
        task = task_repeat_check({"before": {k: before.get(k) for k in measure.STATE_HASH_KEYS},
                      "after": {k: after.get(k) for k in measure.STATE_HASH_KEYS},
                      "predictions_array_equal": bool(energy.get("repeat_predictions_equal"))})
        gates["task_verified"] = gates_mod.task_verified_gate(task, th["task_verified"])
    failed = [name for name in gates_mod.GATE_NAMES if not gates[name]["passed"]]
    return {
        "format": "paired-idle (no gates recorded)",
        "reproduced": not differences,
        "values_compared": compared,
        "differences": differences,
        "not_recomputable": ["energy.trials[].cuda_ms_per_task (no CUDA-event times in the record)",
                             "energy.summary.cuda_ms_per_task is recomputed from the recorded per-trial values"],
        "thresholds_match_code": None,
        "valid": False,
        "failed_gates": failed,
        "gates": normalized(gates),
        "figures": normalized({"trials": trials, "summary": summary}),
        "board": {"kind": "nvml", "gpu": (energy.get("hardware") or {}).get("gpu")},
        "raw_sha256": canonical_sha256(energy["trials"]),
    }
