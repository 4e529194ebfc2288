"""What both REST apps share: the JSON content-type check and an OpenAPI schema without FastAPI's 422."""
from __future__ import annotations

from fastapi import FastAPI


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
