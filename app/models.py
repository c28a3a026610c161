"""The routes' contracts: what each takes and returns, as pydantic models (and so /openapi.json).

The task answer is large (a prediction per query) and byte-exact; routes build it as plain
JSON and these models document it (``responses=``) rather than re-validate it per request.
Models allow extra fields: a client may rely on what is declared here, and newer fields may be
added beside it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, create_model

from .task_row import API_COLUMNS, REQUIRED, Status


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(Open):
    error: str = Field(description="what is wrong, naming the limit or variable involved")
    request_id: str | None = None


class Timing(Open):
    receive_ms: float
    parse_ms: float
    queue_wait_ms: float
    run_ms: float | None = None
    run_clock: str | None = Field(None, description="cuda_events or perf_counter")
    device_ms: float
    tasks_in_launch: int | None = None
    total_ms: float


class TaskAnswer(Open):
    """POST /tasks (synchronous) and GET /tasks/{id} once succeeded."""

    id: str
    request_id: str | None = None
    status: Literal["succeeded"] | None = Field(None, description="only in GET /tasks/{id}")
    predictions: list[int] = Field(description="one class 0..9 per query, in order")
    predictions_sha256: str
    scores_sha256: str
    scores: list[list[float]] | None = Field(None, description="with include=scores: (M, 10) float32 values")
    metadata: dict[str, Any] = Field(description="config, hashes, timing scope, backend, device, versions")
    timing: Timing
    energy: dict[str, Any] | None = Field(
        None, description="on a GPU, the per-request estimate (docs/energy.md, per-request energy): gross_j from "
        "NVML's counter or, below its resolution, power x duration (gross_source; method "
        "nvml-total-energy-counter-delta or power-at-window-end-x-duration, then the idle baseline used); "
        "idle_adjusted_j is null with idle_adjusted_reason rather than negative or zero; cold_idle_w beside "
        "the baseline; never gated (gated: false). null elsewhere, with energy_reason")
    energy_reason: str | None = Field(None, description="why energy is null")
    device: str
    versions: dict[str, Any]
    dataset: str | None = Field(None, description="POST /tasks?dataset=: the dataset's digest")
    correct: int | None = Field(None, description="with the dataset's scoring labels: predictions right")
    total: int | None = Field(None, description="with the dataset's scoring labels: queries scored")
    accuracy: float | None = None


def _task_summary() -> type[BaseModel]:
    """The API model of a listed task, from the task row's definition (app/task_row.py): a field per
    column the API shows, with its annotation, default and description."""
    fields = {}
    for c in API_COLUMNS:
        default = ... if c.default is REQUIRED else c.default
        fields[c.name] = (c.api, Field(default, description=c.description) if c.description else default)
    return create_model("TaskSummary", __base__=Open, __doc__="A ledger record without its answer (lists, 202 Accepted).",
                        __module__=__name__, **fields)


TaskSummary = _task_summary()


class TaskStatus(TaskSummary):
    """GET /tasks/{id} while queued or running, or once failed or cancelled; POST /tasks/{id}/cancel."""

    error: dict[str, Any] | None = Field(None, description="failed or cancelled: {status, error, ...}")


class TaskList(BaseModel):
    tasks: list[TaskSummary]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null at the end")


class DatasetLabels(Open):
    attached: bool
    sha256: str | None = Field(None, description="the labels .npy's SHA-256 (never the labels themselves)")


class DatasetInfo(Open):
    digest: str = Field(description="sha256:<hex> of the npz bytes")
    bytes: int
    train_count: int
    test_count: int
    input_hashes: dict[str, str]
    created_at: float
    labels: DatasetLabels
    location: str | None = None
    sweeps: list[str] | None = Field(None, description="GET /datasets/<digest>: the sweeps on it")


class DatasetList(BaseModel):
    datasets: list[DatasetInfo]
    next_cursor: str | None


class SweepRequest(BaseModel):
    """POST /sweeps: one stored dataset, a grid of config values × seeds."""

    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(pattern=r"^sha256:[0-9a-f]{64}$", description="a stored dataset's digest")
    config: dict[str, int | float] = Field(default_factory=dict, description="base config overrides")
    grid: dict[str, list[int | float]] = Field(default_factory=dict,
                                               description="config key -> its values; the cells are their product")
    seeds: list[int] | dict[str, int] = Field(default_factory=lambda: [0],
                                             description="a list, or {\"start\": S, \"count\": N}")
    backend: str | None = None
    include_scores: bool = False
    name: str | None = Field(None, max_length=200)
    webhook: str | None = Field(None, max_length=2048, description="an http(s) URL for sweep.completed "
                                "(docs/webhooks.md)")
    webhook_events: str | list[str] | None = Field(None, description="completed (the default and the one event)")


class SweepCell(Open):
    task_id: str
    config: dict[str, Any]
    status: Status
    backend: str | None = Field(None, description="the backend its task runs on")
    device: str | None = Field(None, description="the device it ran on, as its answer says (once succeeded)")
    predictions_sha256: str | None = None
    timing: dict[str, Any] | None = None
    correct: int | None = None
    total: int | None = None
    accuracy: float | None = None


SweepStatus = Literal["queued", "running", "completed", "cancelled"]
EvaluationStatus = Literal["queued", "running", "completed", "failed", "cancelled"]


class SweepState(Open):
    id: str
    status: SweepStatus
    dataset: str
    created_at: float
    cancelled_at: float | None = None
    definition: dict[str, Any]
    counts: dict[Status, int] = Field(description="cells by task status (every status, zeros included)")
    cells: list[SweepCell]


class SweepAccepted(Open):
    id: str
    status: Literal["accepted"]
    cells: int
    location: str


class SweepSummary(Open):
    id: str
    status: SweepStatus
    dataset: str
    created_at: float
    cancelled_at: float | None = None
    definition: dict[str, Any]
    cells: int
    counts: dict[Status, int] = Field(description="cells by task status (every status, zeros included)")
    location: str


class SweepList(BaseModel):
    sweeps: list[SweepSummary]
    next_cursor: str | None


class EvaluationRequest(BaseModel):
    """POST /evaluations: the published draws for one config (docs/evaluations.md)."""

    model_config = ConfigDict(extra="forbid")
    draws: StrictStr | list[StrictInt] = Field(
        "0-10", description="published draws k in 0..10: \"0-10\", \"0,3,5\", \"2\", or a list [0, 3, 5]")
    config: dict[str, int | float] = Field(default_factory=dict, description="config overrides (as a task takes)")
    seeds: list[StrictInt] | dict[str, StrictInt] | None = Field(
        None, description="run each draw at each of these seeds: a list, or {\"start\": S, \"count\": N} "
        "(default: one run per draw at the config's seed)")
    backend: str | None = Field(None, description="learner backend (default: the server's)")
    name: str | None = Field(None, max_length=200, description="a label for the leaderboard")
    measure: Literal["energy"] | None = Field(None, description="energy: each draw also measured (docs/energy.md)")
    protocol: dict[str, int | float] | None = Field(
        None, description="the measurement's arguments (trials, target_seconds, ...; measure=energy only)")
    webhook: str | None = Field(None, max_length=2048, description="an http(s) URL for evaluation.completed "
                                "(docs/webhooks.md)")
    webhook_events: str | list[str] | None = Field(None, description="completed (the default and the one event)")


class EvaluationAccepted(Open):
    id: str
    status: Literal["accepted"]
    draws: list[int]
    location: str
    report: str


class EvaluationDraw(Open):
    draw: int
    seed: int | None = Field(None, description="the run's seed (evaluations with seeds: one row per draw and seed)")
    dataset_seed: int
    dataset: str
    task_id: str
    status: Status
    correct: int | None = None
    total: int | None = None
    accuracy: float | None = None
    predictions_sha256: str | None = None
    run_ms: float | None = None
    energy: dict[str, Any] | None = None


class EvaluationState(Open):
    id: str
    name: str | None = None
    status: EvaluationStatus
    created_at: float
    finished_at: float | None = None
    cancelled_at: float | None = None
    definition: dict[str, Any]
    config: dict[str, Any]
    config_changes: dict[str, Any]
    backend: dict[str, Any]
    counts: dict[Status, int] = Field(description="draws by task status (every status, zeros included)")
    draws: list[EvaluationDraw]
    totals: dict[str, Any] | None = Field(None, description="as rev88 evaluate's summary.json: once every draw succeeded")
    time: dict[str, Any] | None = None
    energy: dict[str, Any] | None = None
    device: Any = None
    versions: dict[str, Any] | None = None
    comparison: str | None = Field(None, description="device, versions and draws: rows ranked together share it")
    draw_set: str | None = Field(None, description="the draws as ranges (\"0-10\")")
    seeds: Any = Field(None, description="with seeds: each seed's mean over the draws and their SD once graded "
                       "(the list of seeds before)")


class EvaluationRow(Open):
    id: str
    name: str | None = None
    status: EvaluationStatus
    counts: dict[Status, int] = Field(description="draws by task status (every status, zeros included)")
    created_at: float
    draws: list[int]
    draw_set: str | None = Field(None, description="the draws as ranges (\"0-10\")")
    seed_set: str | None = Field(None, description="with seeds: the seeds as ranges (\"0-11\")")
    config_changes: dict[str, Any]
    backend: str
    device: Any = None
    comparison: str | None = Field(None, description="device, versions and draws: rows ranked together share it")
    correct: int | None = None
    total: int | None = None
    mean_accuracy: float | None = None
    sd_accuracy_pp: float | None = None
    ms_per_task: float | None = None
    mj_per_task: float | None = None


class EvaluationList(BaseModel):
    evaluations: list[EvaluationRow]
    next_cursor: str | None


class KeyCreate(BaseModel):
    """POST /keys: a tenant's key (docs/tenants.md)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9 ._@:-]+$",
                      description="who it is for (letters, digits, space and ._@:-)")
    scopes: list[Literal["read", "write", "admin"]] | None = Field(
        None, min_length=1, description="read (GET, HEAD), write (submit, upload, cancel), admin (keys); "
        "default read and write")
    expires_at: float | None = Field(None, description="epoch seconds after which the key is refused")
    max_queued: int | None = Field(None, ge=1, le=1_000_000,
                                   description="unfinished tasks (sweep and evaluation cells included) at once")
    max_running: int | None = Field(None, ge=1, le=10_000, description="tasks on the devices at once")
    rate_per_minute: float | None = Field(None, gt=0, le=100_000,
                                          description="write requests (submit, upload, cancel) a minute, in bursts "
                                          "of up to as many")
    weight: float | None = Field(None, gt=0, le=1000, description="fair share of the devices (default 1)")


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_seconds: float | None = Field(None, ge=0, le=7 * 86400,
                                        description="how long the old secret keeps working (default 3600)")


class KeyView(Open):
    id: str
    name: str
    scopes: list[str]


class KeyCreated(KeyView):
    key: str = Field(description="the secret, shown this once")
    prefix: str


class KeyList(BaseModel):
    keys: list[KeyView]


class UsageRow(Open):
    tenant: str
    name: str
    day: str
    tasks: int
    succeeded: int
    device_seconds: float
    joules: float | None = None


class UsageReport(Open):
    since: float
    days: int
    usage: list[UsageRow]


class Health(Open):
    status: str
    ready: bool
    device: str
    backend: str
    gpu: dict[str, Any] | None = None
    queue: dict[str, Any]
    admission: dict[str, Any] | None = Field(
        None, description="the device queue, the ledger's backlog and each tenant's queued, waiting, running "
        "tasks and share of the device queue")
    limits: dict[str, Any]
    workers: dict[str, Any]
    ledger: dict[str, Any] | None = None
    uploads: dict[str, Any] | None = None
    versions: dict[str, Any]


class Probe(Open):
    status: str
    error: str | None = None


class WebhookSecret(Open):
    key: str = Field(description="whsec_...: the tenant's Standard Webhooks signing secret")
    previous_valid_until: float | None = Field(
        None, description="after a rotation: the old secret also signs until then (epoch seconds)")


class DeliveryAttempt(Open):
    n: int
    at: float
    url: str
    address: str | None = Field(None, description="the checked address the request went to")
    status_code: int | None = None
    duration_ms: float | None = None
    error: str | None = None
    outcome: Literal["delivered", "retry", "failed", "stopped"]
    next_at: float | None = Field(None, description="outcome retry: when the next attempt is due")
    replica: str | None = None


class DeliveryMessage(Open):
    id: str = Field(description="the webhook-id of every attempt")
    event: Literal["started", "completed"]
    type: str | None = Field(None, description="task.succeeded, ...; None until the event has happened")
    url: str
    state: Literal["waiting", "pending", "delivered", "failed", "stopped", "skipped"]
    created_at: float
    ready_at: float | None = None
    next_attempt_at: float | None = None
    finished_at: float | None = None
    last_error: str | None = None
    next: str = Field(description="what happens next, in words")
    attempt_count: int
    attempts: list[DeliveryAttempt]


class DeliveryLog(Open):
    kind: Literal["task", "sweep", "evaluation"]
    id: str
    messages: list[DeliveryMessage]


class Redelivered(Open):
    redelivered: list[str] = Field(description="the message ids sent again (their ids and bodies unchanged)")


class StoppedWebhooks(Open):
    stopped: list[dict[str, Any]] = Field(description="URLs that answered 410 Gone: url, stopped_at, message_id")


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    texts = {
        400: "not a zip/npz (or, for a JSON body, not JSON), truncated or corrupt", 401: "missing or wrong Bearer key (REV88_API_KEY)",
        408: "the body did not arrive within the upload timeout (REV88_UPLOAD_TIMEOUT_S); the connection is closed",
        403: "the key lacks the scope the request needs (read, write, admin)",
        429: "over the key's max_queued or rate_per_minute (Retry-After, RateLimit-Policy, RateLimit)",
        404: "no such task, sweep, evaluation or dataset here (another tenant's is as absent); a path that is no "
             "route: a hint where the routes are listed", 409: "conflict (idempotency key reused, task finished)",
        413: "body, archive or estimated memory over the limits", 415: "unsupported content type",
        422: "invalid arrays, members, config, budget or diverged training",
        503: "queue full, not ready, draining or the ledger unavailable (Retry-After)", 504: "task timeout",
    }
    return {code: {"model": ErrorBody, "description": texts[code]} for code in codes}
