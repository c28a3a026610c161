"""/datasets: task npz files stored once under their SHA-256, and their scoring labels
(app/tasks/datasets.py holds what these routes do; docs/sweeps.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from ..errors import Conflict, InvalidRequest, NotFound, UnsupportedMediaType
from ..http import uploads
from ..models import DatasetInfo, DatasetList, error_responses
from ..service import Service
from ..tasks.datasets import check_digest
from .deps import ServiceDep, TenantDep, tenant_of

router = APIRouter(tags=["datasets"])
Digest = Annotated[str, Path(pattern=r"^sha256:[0-9a-f]{64}$", description="sha256:<hex> of the npz bytes")]
RAW = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


async def _body(request: Request, service: Service) -> bytes | memoryview:
    """The raw body, read as a task's is: its content type, the body limit, the upload deadline and budget."""
    kind = uploads.media_type(request.headers.get("content-type"))
    if kind not in uploads.RAW_TYPES:
        given = request.headers.get("content-type")
        got = f"Content-Type {given!r}" if given else "no Content-Type"
        raise UnsupportedMediaType(f"unsupported content type: got {got}; send the file's bytes as "
                                   f"{' or '.join(uploads.RAW_TYPES)}", accepted=list(uploads.RAW_TYPES))
    settings = service.settings
    reservation = service.uploads.reservation()
    try:
        return await uploads.read_body(request, settings.max_body_bytes, timeout_s=settings.upload_timeout_s,
                                       min_rate=settings.upload_min_rate, reservation=reservation)
    finally:
        reservation.release()


def _described(record) -> dict:
    return {**record.describe(), "location": f"/datasets/{record.digest}"}


async def _store(request: Request, service: Service, claimed: str | None) -> JSONResponse:
    body = await _body(request, service)
    record, created = await run_in_threadpool(service.datasets.put, body, claimed, tenant_of(request).id)
    return JSONResponse(_described(record), status_code=201 if created else 200,
                        headers={"Location": f"/datasets/{record.digest}"})


@router.put("/datasets/{digest}", summary="Store a task npz under its SHA-256 (the same checks as a task's body)",
            response_model=DatasetInfo, status_code=201, openapi_extra={"requestBody": {"required": True, "content": RAW}},
            responses={200: {"model": DatasetInfo, "description": "already stored: nothing written"},
                       **error_responses(400, 401, 408, 413, 415, 422, 503)})
async def put_dataset(digest: Digest, request: Request, service: ServiceDep) -> JSONResponse:
    return await _store(request, service, check_digest(digest))


@router.post("/datasets", summary="Store a task npz; answers its digest", response_model=DatasetInfo,
             status_code=201, openapi_extra={"requestBody": {"required": True, "content": RAW}},
             responses={200: {"model": DatasetInfo, "description": "already stored: nothing written"},
                        **error_responses(400, 401, 408, 413, 415, 422, 503)})
async def post_dataset(request: Request, service: ServiceDep) -> JSONResponse:
    return await _store(request, service, None)


@router.head("/datasets/{digest}", summary="Whether the dataset is stored (200) or not (404)",
             responses=error_responses(401, 404, 422, 503))
async def head_dataset(digest: Digest, service: ServiceDep, tenant: TenantDep) -> Response:
    record = await run_in_threadpool(service.datasets.store.get, check_digest(digest))
    if record is not None and not await run_in_threadpool(service.datasets.visible, digest, tenant.owner):
        record = None  # another tenant's: as absent as a dataset never stored
    return Response(status_code=200 if record is not None else 404, media_type="application/json",
                    headers={"X-Dataset-Bytes": str(record.bytes)} if record else {})


@router.get("/datasets/{digest}", summary="A stored dataset: its size, counts, input hashes, labels (attached or not)",
            response_model=DatasetInfo, responses=error_responses(401, 404, 422, 503))
async def get_dataset(digest: Digest, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    record = await run_in_threadpool(service.datasets.get, digest, tenant.owner)
    sweeps = await run_in_threadpool(service.datasets.store.sweeps_of, digest)
    if tenant.owner is not None:  # (its own sweeps only)
        mine = await run_in_threadpool(service.datasets.store.list_sweeps, 500, None, tenant.owner)
        sweeps = [s for s in sweeps if s in {m.id for m in mine[0]}]
    return JSONResponse({**_described(record), "sweeps": sweeps})


@router.get("/datasets", summary="The stored datasets, newest first", response_model=DatasetList,
            responses=error_responses(401, 422, 503))
async def list_datasets(service: ServiceDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=500)] = 50,
                        cursor: Annotated[str | None, Query(pattern="^[A-Za-z0-9_-]+$", description=(
                            "next_cursor of the previous page, unchanged"))] = None) -> JSONResponse:
    try:
        if tenant.owner is None:
            records, next_cursor = await run_in_threadpool(service.datasets.store.list, limit, cursor)
        else:
            records, next_cursor = await run_in_threadpool(_own_page, service, tenant.owner, limit, cursor)
    except ValueError as exc:
        raise InvalidRequest(str(exc), field="cursor") from None
    return JSONResponse({"datasets": [_described(r) for r in records], "next_cursor": next_cursor})


def _own_page(service: Service, owner: str, limit: int, cursor: str | None):
    """(blocking) A tenant's page of its own datasets, newest first."""
    from ..ledger.datasets import decode_cursor, encode_cursor

    digests = service.datasets.owners.page(owner, limit + 1, None if cursor is None else decode_cursor(cursor))
    records = [r for r in (service.datasets.store.get(d) for d in digests[:limit]) if r is not None]
    more = len(digests) > limit and records
    return records, encode_cursor(records[-1].created_at, records[-1].digest) if more else None


@router.delete("/datasets/{digest}", summary="Delete a dataset and its labels (409 while unfinished tasks use it)",
               status_code=204, responses=error_responses(401, 404, 409, 422, 503))
async def delete_dataset(digest: Digest, service: ServiceDep, tenant: TenantDep) -> Response:
    check_digest(digest)
    if tenant.owner is not None:  # a tenant drops its own ownership; the bytes go with the last owner
        await run_in_threadpool(service.datasets.get, digest, tenant.owner)
        users = [t for t in await run_in_threadpool(service.ledger.unfinished)
                 if t.options.get("dataset") == digest and t.options.get("owner") == tenant.owner]
        if users:
            raise Conflict(f"dataset {digest} is used by {len(users)} unfinished task(s) of yours (e.g. {users[0].id}); "
                           "cancel them or wait for them to finish", tasks=[t.id for t in users[:20]])
        if await run_in_threadpool(service.datasets.owners.disown, digest, tenant.owner):
            return Response(status_code=204)  # (other tenants still have it)
    users = [t for t in await run_in_threadpool(service.ledger.unfinished) if t.options.get("dataset") == digest]
    if users:
        raise Conflict(f"dataset {digest} is used by {len(users)} unfinished task(s) (e.g. {users[0].id}); "
                       "cancel them or wait for them to finish", tasks=[t.id for t in users[:20]])
    if not await run_in_threadpool(service.datasets.store.delete, digest):
        raise NotFound(f"no dataset {digest} is stored here")
    await run_in_threadpool(service.datasets.owners.disown, digest, None)
    service.datasets.forget(digest)
    return Response(status_code=204)


@router.put("/datasets/{digest}/labels", summary="Attach the scoring labels of the queries (an .npy; never returned)",
            response_model=DatasetInfo, status_code=201, openapi_extra={"requestBody": {"required": True, "content": RAW}},
            responses={200: {"model": DatasetInfo, "description": "these labels were attached already"},
                       **error_responses(400, 401, 404, 408, 409, 413, 415, 422, 503)})
async def put_labels(digest: Digest, request: Request, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    check_digest(digest)
    await run_in_threadpool(service.datasets.get, digest, tenant.owner)  # (another tenant's: 404 before the body)
    body = await _body(request, service)
    record, created = await run_in_threadpool(service.datasets.put_labels, digest, body, tenant.owner)
    return JSONResponse(_described(record), status_code=201 if created else 200)
