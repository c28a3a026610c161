"""/keys: tenants' API keys, made and revoked by the admin (REV88_API_KEY); app/tasks/tenants.py
holds what these routes do; docs/tenants.md."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from ..errors import Conflict, Forbidden
from ..models import KeyCreate, KeyCreated, KeyList, KeyRotate, KeyView, error_responses
from ..tasks.tenants import Tenant
from .deps import ServiceDep, TenantDep

router = APIRouter(tags=["keys"])
SHOWN_ONCE = "the secret is shown this once: keep it now (only its SHA-256 is stored)"


def _admin(service, tenant: Tenant) -> None:
    if service.settings.api_key is None:
        raise Conflict("this service has no REV88_API_KEY: it is open and checks no key; set REV88_API_KEY "
                       "(the admin key) to give tenants keys")
    if not tenant.admin:
        raise Forbidden(f"key {tenant.name!r} lacks the admin scope the keys need")


@router.post("/keys", summary="A new tenant key (admin): its secret shown once", status_code=201,
             response_model=KeyCreated, responses=error_responses(400, 401, 403, 409, 422, 503))
async def create_key(body: KeyCreate, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    _admin(service, tenant)
    record, secret = await run_in_threadpool(service.keys.create, body.model_dump(exclude_none=True))
    return JSONResponse({**record.describe(), "key": secret, "note": SHOWN_ONCE}, status_code=201,
                        headers={"Location": f"/keys/{record.id}"})


@router.get("/keys", summary="Every key (admin): never a secret", response_model=KeyList,
            responses=error_responses(401, 403, 409, 422, 503))
async def list_keys(service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    _admin(service, tenant)
    records = await run_in_threadpool(service.keys.store.list)
    return JSONResponse({"keys": [r.describe() for r in records]})


@router.get("/key", summary="The key this request was made with (any key)", response_model=KeyView,
            responses=error_responses(401, 422, 503))
async def my_key(service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    if tenant.key is None:  # the admin key, or an open service
        return JSONResponse({"id": tenant.id, "name": tenant.name, "scopes": sorted(tenant.scopes),
                             "admin": tenant.admin, "open": service.settings.api_key is None})
    record = await run_in_threadpool(service.keys.get, tenant.id)
    return JSONResponse({**record.describe(), "admin": tenant.admin, "open": False})


@router.delete("/keys/{key_id}", summary="Revoke a key (admin): refused from then on, on every replica",
               response_model=KeyView, responses=error_responses(401, 403, 404, 409, 422, 503))
async def revoke_key(key_id: str, service: ServiceDep, tenant: TenantDep) -> JSONResponse:
    _admin(service, tenant)
    record = await run_in_threadpool(service.keys.revoke, key_id)
    return JSONResponse(record.describe())


@router.post("/keys/{key_id}/rotate", summary="A new secret for a key (admin); the old one works for a grace period",
             response_model=KeyCreated, responses=error_responses(400, 401, 403, 404, 409, 422, 503))
async def rotate_key(key_id: str, service: ServiceDep, tenant: TenantDep, body: KeyRotate | None = None) -> JSONResponse:
    _admin(service, tenant)
    grace = body.grace_seconds if body is not None else None
    record, secret = await run_in_threadpool(service.keys.rotate, key_id, grace)
    return JSONResponse({**record.describe(), "key": secret, "note": SHOWN_ONCE})
