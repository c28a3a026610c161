"""A task request's options: backend, include, measure=energy, precision and config overrides from the query,
and what its headers say of its body (its media type; none with ?dataset=) and of its answer (Accept).

Checked before the body is read, so a request that cannot succeed is refused before its upload.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from learner.backends import BackendUnavailable, resolve
from learner.config import Config, coerce_config_strings, make_config, unknown_text
from learner.kernels.tuned import PRECISIONS

from ..errors import InvalidRequest
from ..http.uploads import check_content_type
from ..ledger.datasets import DIGEST, not_a_digest

SERVICE_PARAMS = ("backend", "include", "measure", "dataset", "webhook", "webhook_events", "precision")
MEASURE_PARAMS = {  # name: (type, lowest, highest, default) — keep one measurement well under an hour
    "trials": (int, 1, 10, 3),
    "target_seconds": (float, 0.1, 60.0, 5.0),
    "settle_seconds": (float, 0.0, 30.0, 3.0),
    "idle_seconds": (float, 0.0, 30.0, 3.0),
    "reference_seconds": (float, 0.1, 30.0, 10.0),
    "sham_seconds": (float, 0.1, 30.0, 5.0),
}
# The gated protocol's own windows (learner.measure.gated, docs/energy.md): in a measurement's
# arguments only when the request gives them -- otherwise the protocol's defaults apply, and the
# measurement's plan records the values used -- so the arguments stored for earlier
# measurements (the ledger's options) stay what they were.
GATED_WINDOW_PARAMS = ("reference_seconds", "sham_seconds")
INCLUDES = ("scores",)
NPZ_TYPE = "application/x-npz"



@dataclasses.dataclass(frozen=True)
class TaskOptions:
    config_overrides: dict[str, Any]  # from the query, already type-coerced and checked
    backend: str  # concrete: a name from learner.backends.NAMES other than "auto"
    query_config: Config  # the config the query alone makes (made and checked by parse_options)
    include_scores: bool = False
    measure: dict[str, Any] | None = None  # protocol arguments for ?measure=energy
    dataset: str | None = None  # ?dataset=sha256:...: the stored dataset to train on (no body)
    webhook: str | None = None  # ?webhook=<url>: checked by the webhooks' guard (app/webhooks/targets.py)
    webhook_events: str | None = None  # ?webhook_events=started,completed (default completed)
    precision: str | None = None  # ?precision=ieee|tf32x3: the products' precision (None: the backend's tuned one)
    kind: str | None = None  # the body's media type (app/http/uploads.py); None: no body (?dataset=), or no headers read
    npz: bool = False  # Accept asks for application/x-npz at least as much as for JSON (``wants_npz``)

    def config(self, form_config: dict[str, Any] | None = None) -> Config:
        """Query overrides merged with a multipart ``config`` field; a key in both is an error."""
        if not form_config:
            return self.query_config
        both = sorted(set(form_config) & set(self.config_overrides))
        if both:
            raise InvalidRequest(f"config key(s) given both as query parameter and in the 'config' field: {', '.join(both)}")
        return make_config({**form_config, **self.config_overrides})


def parse_options(items: list[tuple[str, str]], default_backend: str, headers: Any = None) -> TaskOptions:
    """Query parameters -> options. Anything not a service parameter is a config key (unknown -> 422).
    With a POST /tasks request's ``headers``: its body's media type (415 unless an npz or a form; a
    body beside ?dataset= is a 422) and whether its answer is wanted as the npz."""
    keys = [k for k, _ in items]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise InvalidRequest(f"query parameter(s) given more than once: {', '.join(repeated)}")
    query = dict(items)
    npz = headers is not None and wants_npz(headers.get("accept"))
    backend = check_backend(query.pop("backend", default_backend))
    include = [p.strip() for p in query.pop("include", "").split(",") if p.strip()]
    unknown = [p for p in include if p not in INCLUDES]
    if unknown:
        raise InvalidRequest(f"include={unknown_text(unknown, INCLUDES)} is not known; allowed: {', '.join(INCLUDES)}")
    precision = check_precision(query.pop("precision", None), backend)
    dataset = query.pop("dataset", None)
    if dataset is not None and not DIGEST.match(dataset):
        raise InvalidRequest(f"dataset= takes a stored dataset's digest: {not_a_digest(dataset)}", field="dataset")
    webhook, webhook_events = query.pop("webhook", None), query.pop("webhook_events", None)
    measure = query.pop("measure", None)
    protocol = {name: query.pop(name) for name in list(query) if name in MEASURE_PARAMS}
    if measure is None and protocol:
        raise InvalidRequest(f"{', '.join(sorted(protocol))} only apply with measure=energy")
    if measure is not None and measure != "energy":
        raise InvalidRequest(f"measure={measure!r} is not known; the one measurement is measure=energy")
    overrides = coerce_config_strings(query)
    kind = None
    if headers is not None and dataset is None:
        kind = check_content_type(headers.get("content-type"))
    elif headers is not None and (headers.get("content-length") not in (None, "0") or headers.get("transfer-encoding")):
        raise InvalidRequest("POST /tasks?dataset= trains on the stored dataset and takes no body; send either "
                             "the npz as the body or dataset=<digest>, not both", field="dataset")
    return TaskOptions(
        config_overrides=overrides,
        backend=backend,
        query_config=make_config(overrides),  # checked now, before the upload is read
        include_scores="scores" in include,
        measure=None if measure is None else measure_arguments(protocol),
        dataset=dataset,
        webhook=webhook,
        webhook_events=webhook_events,
        precision=precision,
        kind=kind,
        npz=npz,
    )


def check_precision(precision: str | None, backend: str) -> str | None:
    """?precision=: one of learner.kernels.tuned.PRECISIONS (422 otherwise); a precision other than
    ieee only where the backend has it (the fused backend's tensor-core products)."""
    if precision is None:
        return None
    if precision not in PRECISIONS:
        raise InvalidRequest(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}", field="precision")
    if precision != "ieee" and backend != "fused":
        raise InvalidRequest(f"precision={precision} is the fused backend's; backend {backend!r} computes its products "
                             "in fp32 (precision=ieee)", field="precision")
    return precision


def measure_arguments(raw: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (kind, low, high, default) in MEASURE_PARAMS.items():
        if name not in raw:
            if name not in GATED_WINDOW_PARAMS:
                out[name] = default
            continue
        try:
            value = kind(raw[name])
        except ValueError:
            raise InvalidRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw[name]!r}") from None
        if not low <= value <= high:  # also rejects nan
            raise InvalidRequest(f"{name} must be in [{low:g}, {high:g}], got {raw[name]}")
        out[name] = value
    return out


def measure_timeout_s(arguments: dict[str, Any], task_timeout_s: float) -> float:
    """A measurement's timeout: every phase of the gated protocol -- the cold idle window before
    any work, two reference windows, the sham, the harness control (a target-length window) and
    the trials, each framed by 2 x (settle + idle; a settle ends at its cap at the latest) --
    plus the protocol's allowance for the reference matmul's preparation
    and the sampler process's start and stop, plus the task timeout for each single run it makes
    outside the windows (first, calibration, after) and for each trial's last repeat."""
    from learner.measure.gated import OVERHEAD_ALLOWANCE_S

    a = {name: arguments.get(name, spec[3]) for name, spec in MEASURE_PARAMS.items()}
    frame = 2 * (a["settle_seconds"] + a["idle_seconds"])
    windows = (a["idle_seconds"] + 2 * (a["reference_seconds"] + frame) + (a["sham_seconds"] + frame)
               + (a["trials"] + 1) * (a["target_seconds"] + frame))
    return windows + OVERHEAD_ALLOWANCE_S + (3 + a["trials"]) * task_timeout_s


def check_backend(name: str) -> str:
    """A name from learner.backends.NAMES -> a concrete backend this machine can run,
    else BackendUnavailable (422 for a request; at startup it stops the service)."""
    concrete = resolve(name)
    if concrete in ("cuda", "fused") and not torch.cuda.is_available():
        raise BackendUnavailable(
            f"backend {concrete!r} needs a CUDA GPU and none is available on this server; use backend=cpu"
        )
    if concrete == "fused" and importlib.util.find_spec("triton") is None:
        raise BackendUnavailable(
            "backend 'fused' needs triton, which is not installed on this server (pip install 'rev88[gpu]'); "
            "use backend=cuda"
        )
    if concrete == "cpu-fast":
        from learner.backends.cpu_fast import KERNEL_ERROR, kernel_available

        if not kernel_available():
            raise BackendUnavailable(f"backend 'cpu-fast' is unavailable on this server: {KERNEL_ERROR}; use backend=cpu")
    return concrete


def wants_npz(accept: str | None) -> bool:
    """True when Accept asks for application/x-npz at least as much as for JSON."""
    best: dict[str, float] = {}
    for part in (accept or "").split(","):
        fields = [f.strip() for f in part.split(";")]
        kind = fields[0].lower()
        q = 1.0
        for f in fields[1:]:
            if f.lower().startswith("q="):
                try:
                    q = float(f[2:])
                except ValueError:
                    q = 0.0
        if kind:
            best[kind] = max(q, best.get(kind, 0.0))
    npz = best.get(NPZ_TYPE, 0.0)
    return npz > 0 and npz >= best.get("application/json", 0.0)
