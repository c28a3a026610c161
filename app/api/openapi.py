"""The parts of the OpenAPI document FastAPI cannot infer: POST /tasks takes its body raw (an npz,
or a multipart form) and its config overrides as query parameters checked by learner.config."""

from __future__ import annotations

from typing import Any

from learner.backends import NAMES
from learner.config import BOUNDS, EXCLUSIVE, FIELDS, INT_FIELDS
from learner.kernels.tuned import PRECISIONS

from ..models import TaskAnswer, TaskSummary, error_responses
from ..tasks.options import MEASURE_PARAMS, NPZ_TYPE

DESCRIPTION = """Train the rev88 learner fresh on every uploaded task and return its predictions,
hashes, timing and (on an NVIDIA GPU) energy. The same npz and backend give byte-identical
predictions and hashes to `rev88 run`.

Errors are JSON `{"error": "...", "request_id": "..."}`: 400 not a zip / truncated / corrupt, 401
missing or wrong Bearer key (when REV88_API_KEY is set), 404 unknown task, 409 conflict (a reused
Idempotency-Key, a cancel of a finished task), 413 body or archive over the limits, 415 unsupported
content type, 422 invalid arrays, config, labels or diverged training, 503 queue full / not ready /
draining / ledger unavailable (with Retry-After), 504 task timeout."""


def config_schema(name: str) -> dict[str, Any]:
    """A config field's JSON schema: its type and its range from learner.config.BOUNDS."""
    low, high = BOUNDS[name]
    schema: dict[str, Any] = {"type": "integer" if name in INT_FIELDS else "number"}
    side = EXCLUSIVE.get(name)
    schema["exclusiveMinimum" if side == "low" else "minimum"] = low
    schema["exclusiveMaximum" if side == "high" else "maximum"] = high
    return schema


def task_params() -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = [
        {"name": "backend", "in": "query", "required": False,
         "schema": {"type": "string", "enum": list(NAMES)},
         "description": "backend to run on (default: the server's REV88_BACKEND)"},
        {"name": "include", "in": "query", "required": False, "schema": {"type": "string", "enum": ["scores"]},
         "description": "include=scores adds the (M, 10) float32 scores to the JSON answer"},
        {"name": "measure", "in": "query", "required": False, "schema": {"type": "string", "enum": ["energy"]},
         "description": "measure=energy runs the energy protocol (learner.measure) instead; see docs/energy.md"},
        {"name": "precision", "in": "query", "required": False, "schema": {"type": "string", "enum": list(PRECISIONS)},
         "description": "the products' precision (default: the backend's, the tuned table's on a GPU): ieee on "
                        "every backend, tf32x3 on fused only; said in the answer's backend_details.precision"},
        {"name": "webhook", "in": "query", "required": False,
         "schema": {"type": "string", "format": "uri", "maxLength": 2048},
         "description": "an http(s) URL to POST a signed Standard Webhooks message to (docs/webhooks.md); "
                        "a private or unresolvable target is 422"},
        {"name": "webhook_events", "in": "query", "required": False,
         "schema": {"type": "string", "pattern": "^(started|completed)(,(started|completed))*$"},
         "description": "comma list of started, completed (default: completed)"},
    ]
    for name, (kind, low, high, default) in MEASURE_PARAMS.items():
        params.append({"name": name, "in": "query", "required": False,
                       "schema": {"type": "integer" if kind is int else "number", "minimum": low, "maximum": high,
                                  "default": default},
                       "description": f"measure=energy only: {name}"})
    for name in FIELDS:
        params.append({"name": name, "in": "query", "required": False, "schema": config_schema(name),
                       "description": f"config override {name} (validated as in the CLI; unknown keys are 422)"})
    params += [
        {"name": "Prefer", "in": "header", "required": False, "schema": {"type": "string", "enum": ["respond-async"]},
         "description": "respond-async: answer 202 with Location: /tasks/{id} once the task is durable"},
        {"name": "Idempotency-Key", "in": "header", "required": False,
         "schema": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": "^[\\x21-\\x7e]+$"},
         "description": "the same key with the same body returns the same task (another body: 409)"},
    ]
    return params


NPZ_BODY = {"type": "string", "format": "binary",
            "description": "an npz (zip) with exactly train_images float32 (N,1,9,9), train_labels int (N,), "
                           "test_images float32 (M,1,9,9); an archive with query labels is refused (422)"}

TASK_OPENAPI: dict[str, Any] = {
    "parameters": task_params(),
    "requestBody": {
        "required": True,
        "description": "the task npz, raw or as the `file` field of a multipart form",
        "content": {
            "application/octet-stream": {"schema": NPZ_BODY},
            NPZ_TYPE: {"schema": NPZ_BODY},
            "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "additionalProperties": False,
                                               "properties": {
                "file": NPZ_BODY,
                "config": {"type": "string", "description": "JSON object of config overrides"},
            }}},
        },
    },
}

TASK_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": TaskAnswer, "description": "predictions, hashes, metadata, timing, energy (JSON; an npz of "
          "predictions and scores with Accept: application/x-npz)",
          "content": {NPZ_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
    202: {"model": TaskSummary, "description": "Prefer: respond-async: accepted and durable; poll Location"},
    **error_responses(400, 401, 408, 409, 413, 415, 422, 503, 504),
}
