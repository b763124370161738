"""The built-in web UI: plain HTML, CSS and JavaScript files shipped in the package, served read-only.

`GET /` is the page and `GET /ui/<name>` its other files. The files are read once, when the app is
built, into a table keyed by file name; a request is a lookup in that table, never a filesystem path,
so nothing outside `static/` can be reached (`..`, encoded slashes, absolute or Windows paths are
simply names that are not there: 404). Every response carries a strict Content-Security-Policy (only
this origin's own files and API, no inline script, no framing), so neither the page nor anything a
model writes into it can load or send elsewhere, and no other site can frame it. The page holds no
secret: the API key a user types stays in that browser's localStorage and goes out only as the
`Authorization` header of the UI's own API calls, which the server checks like any client's.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from litestar import Request, Response, get
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath

from wllm.entrypoints.openai.errors import APIError

# Litestar adds "; charset=utf-8" to the text types.
CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-cache",  # revalidate (cheap: ETag), so an upgraded server's files are picked up
}


class StaticFile:
    """One file of the UI, in memory."""

    def __init__(self, name: str, body: bytes) -> None:
        self.name = name
        self.body = body
        self.content_type = CONTENT_TYPES[name[name.rindex(".") :]]
        self.etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'


def load_static_files() -> dict[str, StaticFile]:
    """The UI's files by name: every file directly in the package's `static/` folder with a known type."""
    folder = resources.files(__package__).joinpath("static")
    files: dict[str, StaticFile] = {}
    for entry in folder.iterdir():
        name = entry.name
        if entry.is_file() and "." in name and name[name.rindex(".") :] in CONTENT_TYPES:
            files[name] = StaticFile(name, entry.read_bytes())
    if "index.html" not in files:
        raise RuntimeError(f"the web UI's index.html is missing from {folder}; reinstall wllm-server")
    return files


def _serve(request: Request[Any, Any, Any], file: StaticFile) -> Response[bytes]:
    headers = dict(SECURITY_HEADERS, ETag=file.etag)
    if request.headers.get("if-none-match") == file.etag:
        return Response(b"", status_code=304, headers=headers)
    return Response(file.body, media_type=file.content_type, headers=headers)


def ui_route_handlers(files: dict[str, StaticFile] | None = None) -> list[BaseRouteHandler]:
    """`GET /` (the page) and `GET /ui/{name}` (its files), serving `files` (default: the packaged ones)."""
    table = load_static_files() if files is None else files

    @get("/", include_in_schema=False, summary="The web UI")
    async def ui_index(request: Request[Any, Any, Any]) -> Response[bytes]:
        return _serve(request, table["index.html"])

    @get("/ui/{name:str}", include_in_schema=False, summary="A file of the web UI")
    async def ui_file(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
        file = table.get(name)
        if file is None:
            raise APIError(404, f"The web UI has no file {name!r}.", code="not_found", headers=dict(SECURITY_HEADERS))
        return _serve(request, file)

    return [ui_index, ui_file]
