"""The interactive API docs, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served whole by this
server: a GPU node is often offline, and FastAPI's own pages load both from a CDN (a blank page
without the internet).

Their scripts and styles come from the ``fastapi-offline`` package (a dependency in
pyproject.toml: Swagger UI's and ReDoc's release bundles, as files in its ``static`` folder),
mounted at ``ASSETS_PATH``; the pages are FastAPI's own HTML pointed at them, with Swagger UI's
validator badge (a request to validator.swagger.io) and ReDoc's Google Fonts turned off. Their
Content-Security-Policy lets the page reach this origin only, so a browser refuses any request
elsewhere. Like ``/openapi.json``, the two pages need the API key when one is set
(app/http/middleware.py); their static files are open, as the web page's are.

app/main.py creates the app with ``docs_url=None, redoc_url=None`` and app/web ``install`` calls
``install`` here (before the web page's own ``/static`` mount, which would otherwise answer for
``ASSETS_PATH``).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
ASSETS_PATH = "/static/api-docs"
ASSET_NAMES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")

# Inline scripts and styles (the two pages start their bundle inline; ReDoc styles inline) from
# this origin only; ReDoc's search runs in a worker made from a blob.
DOCS_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data: blob:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def assets_dir() -> Path:
    """The folder of Swagger UI's and ReDoc's files (installed with fastapi-offline)."""
    folder = Path(str(files(fastapi_offline) / "static"))
    missing = [name for name in ASSET_NAMES if not (folder / name).is_file()]
    if missing:
        raise RuntimeError(f"the API docs' files {', '.join(missing)} are missing from {folder} "
                           "(reinstall the fastapi-offline package: pip install -e .)")
    return folder


def install(app: FastAPI) -> None:
    app.mount(ASSETS_PATH, StaticFiles(directory=str(assets_dir())), name="api-docs-assets")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        page = get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"), title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon.png",
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None})
        page.headers.update(DOCS_HEADERS)
        return page

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        page = get_redoc_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"), title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_PATH}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_PATH}/favicon.png", with_google_fonts=False)
        page.headers.update(DOCS_HEADERS)
        return page

    app.add_api_route(DOCS_URL, swagger_ui, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)
    app.add_api_route(REDOC_URL, redoc, methods=["GET"], include_in_schema=False, response_class=HTMLResponse)
