"""What both REST apps share: the JSON content-type check, an OpenAPI schema without FastAPI's 422, and a
request body size limit (BodyLimit)."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, HTTPException
from starlette.responses import Response


def is_json(content_type: str) -> bool:
    """Is this Content-Type JSON (application/json or application/*+json)?"""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def strip_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every operation with input; our apps answer 400 instead (documented)."""
    build = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema
    app.openapi = openapi


MIB = 1 << 20


class BodyTooLarge(HTTPException):
    """A request body over the limit (413). An HTTPException: FastAPI re-raises it from its body reading (any
    other error there becomes a 400), so the app's own HTTPException handler words the answer."""

    def __init__(self, limit: int, setting: str):
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes ({limit / MIB:g} MiB, "
                              f"{setting})")


class BodyLimit:
    """ASGI middleware: a request body larger than `limit` bytes is refused with 413 before it is read.

    A Content-Length over the limit is answered before the app runs: none of the body is read (uvicorn
    discards what the client still sends). A body without one (chunked) is counted as the app reads it and
    refused once it passes the limit: at most `limit` bytes of it are ever held. Without this, a body of any
    size was read, parsed and (a text prompt) tokenized: one 10 MB request took the rollout to 4 GB.
    `error(status, message)` renders the 413 in the app's own error shape; `setting` names the knob."""

    def __init__(self, app, limit: int, error: Callable[[int, str], Response], setting: str):
        self.app, self.limit, self.error, self.setting = app, limit, error, setting

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        read = 0

        async def limited():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.limit:
                    raise BodyTooLarge(self.limit, self.setting)
            return message

        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, tracked)
        except BodyTooLarge:  # (FastAPI's routes answer it themselves; this is for whatever else reads a body)
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        await self.error(413, str(BodyTooLarge(self.limit, self.setting).detail))(scope, receive, send)
