"""The web page: a single-page app of static files, served at ``/``; and the interactive API docs at
``/docs``, whose Swagger UI assets are served from this server too (the ``fastapi-offline``
package ships them), so both work without a network. Neither is part of the OpenAPI schema."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"
DOCS_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
DOCS_ASSETS_URL = "/docs-assets"
# Everything the page loads comes from this server: it works offline and runs no foreign script.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")

router = APIRouter(include_in_schema=False)


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})


def static_files() -> StaticFiles:
    """The page's scripts and styles, mounted at ``/static``."""
    return StaticFiles(directory=STATIC)


@router.get("/docs")
async def api_docs(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title="PRISM-TDA API",
                               swagger_js_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui.css",
                               swagger_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png")


def docs_assets() -> StaticFiles:
    """Swagger UI's script, styles and icon, mounted at ``/docs-assets``."""
    return StaticFiles(directory=DOCS_ASSETS)
