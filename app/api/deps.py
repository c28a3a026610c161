"""What a route may ask for: the service the app was built around (``ServiceDep``) and the tenant
the request's key is (``TenantDep``: app/tasks/tenants.py; ``OPEN`` when the service has no key)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..service import Service
from ..tasks.tenants import OPEN, Tenant


async def get_service(request: Request) -> Service:
    """``async``: FastAPI runs a plain ``def`` dependency in a worker thread, for every request."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


def tenant_of(request: Request) -> Tenant:
    """The request's tenant (the middleware resolved it; OPEN on a service without API keys)."""
    return request.scope.get("state", {}).get("tenant") or OPEN


async def get_tenant(request: Request) -> Tenant:
    return tenant_of(request)


TenantDep = Annotated[Tenant, Depends(get_tenant)]


def visible(tenant: Tenant, owner: str | None) -> bool:
    """Whether ``tenant`` may see what ``owner`` made: its own, or anything for the admin (and
    everyone on an open service)."""
    return tenant.owner is None or tenant.owner == owner
