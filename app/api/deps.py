"""What a route may ask for: the service the app was built around (``ServiceDep``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..service import Service


async def get_service(request: Request) -> Service:
    """``async``: FastAPI runs a plain ``def`` dependency in a worker thread, for every request."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]
