"""An evaluation's report (app/tasks/evaluations.py): each draw's row from its task's record, the
grade over the draws (counts, Wilson intervals, seeds), the document GET /evaluations/<id> answers,
its status, and the leaderboard's row."""

from __future__ import annotations

import logging
import statistics
from typing import Any

from learner.config import Config
from learner.evaluate import DRAW_SEED_BASE, dataset_seed, totals

from ..ledger.evaluations import EvaluationRecord

log = logging.getLogger("rev88." + __name__)

FINISHED = ("succeeded", "failed", "cancelled")
PROTOCOL = {
    "dataset_seed": f"{DRAW_SEED_BASE} + k",
    "data": "MNIST training split; rows order[:10000] train, order[10000:20000] queries; 9x9 box-area",
    "labels": "query labels stay with the evaluator; the learner sees only the three task arrays",
}


def config_changes(config: dict[str, Any]) -> dict[str, Any]:
    """The config's difference from the default (what a leaderboard row shows)."""
    default = Config().as_dict()
    return {k: v for k, v in config.items() if default.get(k) != v}



def cell_status(record: Any) -> str:
    return "queued" if record is None else record.status


def draw_row(cell: dict[str, Any], record: Any, measured: Any) -> dict[str, Any]:
    """A draw's row: the figures of ``rev88 evaluate``'s per-draw record, from its task's answer."""
    row: dict[str, Any] = {"draw": cell["draw"], "dataset_seed": dataset_seed(cell["draw"]),
                           "dataset": cell["dataset"], "task_id": cell["task_id"], "status": cell_status(record),
                           **({"seed": cell["seed"]} if "seed" in cell else {}),
                           "input_hashes": cell.get("input_hashes"),
                           "query_labels_sha256": cell.get("query_labels_sha256")}
    answer = record.answer if record is not None and record.status == "succeeded" else None
    if answer is not None:
        meta = answer.get("metadata") or {}
        timing = answer.get("timing") or {}
        row.update({
            "correct": answer["correct"], "total": answer["total"], "accuracy": answer["correct"] / answer["total"],
            "predictions_sha256": answer.get("predictions_sha256"),
            "training_prediction_seconds": meta.get("training_prediction_seconds"),
            "preparation_seconds": meta.get("preparation_seconds"),
            "run_ms": timing.get("run_ms"), "run_clock": timing.get("run_clock"),
            "tasks_in_launch": timing.get("tasks_in_launch"), "timing": timing,
            "backend": meta.get("backend"), "device": answer.get("device"), "versions": answer.get("versions"),
        })
        if meta.get("input_hashes") not in (None, row["input_hashes"]):  # (cannot happen: the dataset is the draw)
            row["input_hashes_mismatch"] = meta["input_hashes"]
    elif record is not None and record.error:
        row["error"] = record.error.get("error")
    if "measure_task_id" in cell:
        row["measure_task_id"] = cell["measure_task_id"]
        row["energy"] = energy_of(measured, row.get("predictions_sha256"))
    return row


def energy_of(record: Any, predictions_sha256: str | None) -> dict[str, Any]:
    """A draw's measurement: its status, gates and mJ per task (valid only when every gate passed
    and its predictions hash as the draw's task's did)."""
    status = cell_status(record)
    out: dict[str, Any] = {"status": status, "valid": None, "mj_per_task": None}
    if record is None or status != "succeeded" or not record.answer:
        if record is not None and record.error:
            out["error"] = record.error.get("error")
        return out
    doc = record.answer.get("measurement") or {}
    headline = ((doc.get("figures") or {}).get("headline") or {}).get("net_mj_per_task") or {}
    same = doc.get("predictions_sha256") == predictions_sha256
    out.update({
        "valid": bool(doc.get("valid")) and same if doc.get("valid") is not None else None,
        "failed_gates": doc.get("failed_gates"), "gates": doc.get("gates"),
        "gates_reason": doc.get("gates_reason"), "energy_reason": record.answer.get("energy_reason"),
        "mj_per_task": headline.get("mean"), "mj_sd": headline.get("sample_sd"),
        "ms_per_task": _mean((doc.get("timing") or {}).get("wall_ms_per_task")),
        "predictions_match_task": same,
    })
    return out


def _mean(stats: Any) -> float | None:
    """A timing figure's mean (the measurement gives mean, median, SD... or a number)."""
    return stats.get("mean") if isinstance(stats, dict) else stats


def grade(ev: EvaluationRecord, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluation's figures from its draws' rows (totals only when every draw succeeded)."""
    done = [r for r in rows if r["status"] == "succeeded"]
    complete = len(done) == len(rows)
    figures: dict[str, Any] = {"totals": None, "time": None, "energy": None}
    if complete:
        pooled = per_draw(rows)
        figures["totals"] = totals([p["correct"] for p in pooled], [p["total"] for p in pooled])
        if ev.definition.get("seeds"):
            figures["seeds"] = seed_figures(rows)
    run_ms = [r["run_ms"] for r in done if r.get("run_ms") is not None]
    if run_ms:
        figures["time"] = {"ms_per_task": statistics.mean(run_ms),
                           "ms_sd": statistics.stdev(run_ms) if len(run_ms) > 1 else None,
                           "clock": sorted({r["run_clock"] for r in done if r.get("run_clock")}),
                           "scope": "the learner's own run per task (timing.run_ms of each draw's answer)"}
    if ev.definition.get("measure") and complete:
        energies = [r["energy"] for r in rows]
        valid = all(e.get("valid") for e in energies)
        values = [e["mj_per_task"] for e in energies if e.get("mj_per_task") is not None]
        figures["energy"] = {
            "valid": valid,
            "mj_per_task": statistics.mean(values) if valid and values else None,
            "draws_valid": sum(1 for e in energies if e.get("valid")),
            "reason": None if valid else "a draw's measurement is not valid (its gates, its predictions, or no "
                                         "energy meter: see each draw's energy)",
        }
    devices = sorted({str(r.get("device")) for r in done if r.get("device")})
    versions = next((r["versions"] for r in done if r.get("versions")), None)
    figures["device"] = devices[0] if len(devices) == 1 else (devices or None)
    figures["versions"] = versions
    figures["backends_used"] = sorted({r["backend"] for r in done if r.get("backend")})
    figures["comparison"] = comparison_label(figures["device"], versions, ev.definition["draws"],
                                             ev.definition.get("seeds"))
    return figures


def per_draw(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each draw's count, its seeds' runs pooled (one run per draw without seeds: its own), in
    draw order: a draw's accuracy is then the mean of its seeds' (every run has the same total)."""
    pooled: dict[int, dict[str, Any]] = {}
    for r in rows:
        p = pooled.setdefault(r["draw"], {"draw": r["draw"], "correct": 0, "total": 0, "runs": 0})
        p["correct"] += r["correct"]
        p["total"] += r["total"]
        p["runs"] += 1
    return [pooled[k] for k in sorted(pooled)]


def seed_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """With seeds: each seed's mean accuracy over the draws, and how much the seed moves it."""
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], []).append(r)
    each = []
    for seed in sorted(by_seed):
        t = totals([r["correct"] for r in by_seed[seed]], [r["total"] for r in by_seed[seed]])
        each.append({"seed": seed, "correct": t["correct"], "total": t["total"], "mean_accuracy": t["mean_accuracy"],
                     "sd_accuracy_pp": t["sd_accuracy_pp"]})
    means = [e["mean_accuracy"] for e in each]
    return {"seeds": sorted(by_seed), "runs": len(rows), "by_seed": each,
            "sd_across_seeds_pp": statistics.stdev(means) * 100 if len(means) > 1 else None,
            "rule": "totals pool each draw's seeds (its accuracy the mean of its seeds'); by_seed: the mean over "
                    "the draws at each seed, and sd_across_seeds_pp the sample SD of those means"}


def draw_set(draws: list[int]) -> str:
    """The draws (or seeds) as ranges, as ``draws`` takes them: [0, 1, ..., 10] -> "0-10", [0, 3, 4, 5] -> "0,3-5"."""
    runs: list[list[int]] = []
    for k in sorted(draws):
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def comparison_label(device: Any, versions: dict[str, Any] | None, draws: list[int],
                     seeds: list[int] | None = None) -> str | None:
    """What must match for two evaluations to be ranked together: the device, the versions, the
    draws and the seeds (accuracies over other draws are not comparable: a 3-draw mean is not
    ranked against an 11-draw one, nor a mean over 12 seeds against one seed's)."""
    if device is None or versions is None:
        return None
    hardware = versions.get("gpu_name") or device
    parts = [str(hardware), f"rev88 {versions.get('rev88')}", f"torch {versions.get('torch')}"]
    if versions.get("cuda"):
        parts.append(f"CUDA {versions['cuda']}")
    parts.append(f"draws {draw_set(draws)}")
    if seeds:
        parts.append(f"seeds {draw_set(seeds)}")
    return " · ".join(parts)


def comparison_of(ev: EvaluationRecord) -> str | None:
    """A graded evaluation's comparison label, from its result's device and versions and its
    draws (made now, so that a result recorded before the draws were part of it reads the same)."""
    result = ev.result or {}
    return comparison_label(result.get("device"), result.get("versions"), ev.definition["draws"],
                            ev.definition.get("seeds"))


def status_of(ev: EvaluationRecord, rows: list[dict[str, Any]]) -> str:
    statuses = [r["status"] for r in rows] + [r["energy"]["status"] for r in rows if "energy" in r]
    if any(s not in FINISHED for s in statuses):
        return "queued" if all(s == "queued" for s in statuses) else "running"
    if all(s == "succeeded" for s in statuses):
        return "completed"
    return "cancelled" if ev.cancelled_at is not None or "cancelled" in statuses else "failed"


def document(ev: EvaluationRecord, rows: list[dict[str, Any]] | None = None,
             status: str | None = None) -> dict[str, Any]:
    """GET /evaluations/<id>: the definition, the status and, once graded, every figure."""
    result = ev.result or {}
    rows = result.get("draws", rows or [])
    doc = {"id": ev.id, "name": ev.name, "status": status or ev.status, "created_at": ev.created_at,
           "finished_at": ev.finished_at, "cancelled_at": ev.cancelled_at, "definition": ev.definition,
           "config": ev.definition["config"], "config_changes": config_changes(ev.definition["config"]),
           "backend": {"requested": ev.definition["backend"], "used": result.get("backends_used")},
           "measure": ev.definition.get("measure"), "protocol": PROTOCOL,
           "counts": counts(rows), "draws": rows, "totals": result.get("totals"), "time": result.get("time"),
           "energy": result.get("energy"), "device": result.get("device"), "versions": result.get("versions"),
           "comparison": comparison_of(ev), "draw_set": draw_set(ev.definition["draws"]),
           "seeds": result.get("seeds") if result.get("seeds") is not None else ev.definition.get("seeds"),
           "location": f"/evaluations/{ev.id}",
           "report": f"/evaluations/{ev.id}/report", "chart": f"/evaluations/{ev.id}/accuracy.svg"}
    return doc


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    out = dict.fromkeys(("queued", "running", "succeeded", "failed", "cancelled"), 0)
    for row in rows:
        out[row["status"]] += 1
    return out


def cell_ids(ev: EvaluationRecord) -> list[str]:
    """Every task of an evaluation: each draw's, then each measurement's."""
    return [c["task_id"] for c in ev.cells] + [c["measure_task_id"] for c in ev.cells if "measure_task_id" in c]


def progress(ev: EvaluationRecord, statuses: dict[str, str]) -> tuple[str, dict[str, int]]:
    """An ungraded evaluation's status and its draws' counts, from its tasks' statuses alone
    (``statuses``: task id -> status; a task not recorded yet is queued, or cancelled once the
    evaluation is: app/tasks/sweeps.py ``NeverRecorded``). The status is
    ``status_of``'s while a task is unfinished; "graded" when every one has finished (its
    grade, ``_grade``, then decides completed, failed or cancelled)."""
    unrecorded = "queued" if ev.cancelled_at is None else "cancelled"  # (a cancelled one's never run)
    of = [statuses.get(t, unrecorded) for t in cell_ids(ev)]
    draws = counts([{"status": statuses.get(c["task_id"], unrecorded)} for c in ev.cells])
    if all(s in FINISHED for s in of):
        return "graded", draws
    return ("queued" if all(s == "queued" for s in of) else "running"), draws


def leaderboard_row(ev: EvaluationRecord, live: tuple[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """An evaluation in GET /evaluations: what the leaderboard shows (no draw rows); ``live``: an
    ungraded one's (status, counts) from ``progress``."""
    result = ev.result or {}
    t = result.get("totals") or {}
    energy = result.get("energy") or {}
    status, draw_counts = live if live is not None and ev.result is None else (ev.status, counts(result.get("draws", [])))
    return {"id": ev.id, "name": ev.name, "status": status, "counts": draw_counts, "created_at": ev.created_at,
            "finished_at": ev.finished_at, "draws": ev.definition["draws"], "draw_set": draw_set(ev.definition["draws"]),
            "seed_set": draw_set(ev.definition["seeds"]) if ev.definition.get("seeds") else None,
            "config_changes": config_changes(ev.definition["config"]), "backend": ev.definition["backend"],
            "device": result.get("device"), "comparison": comparison_of(ev),
            "correct": t.get("correct"), "total": t.get("total"), "correct_over_total": t.get("correct_over_total"),
            "mean_accuracy": t.get("mean_accuracy"), "sd_accuracy_pp": t.get("sd_accuracy_pp"),
            "ms_per_task": ev.ms_per_task, "mj_per_task": ev.mj_per_task,
            "energy_valid": energy.get("valid"), "measure": ev.definition.get("measure"),
            "location": f"/evaluations/{ev.id}", "report": f"/evaluations/{ev.id}/report"}


# --------------------------------------------------------------------------- the service's part
