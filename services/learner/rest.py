"""The learner service's REST API: POST /v1/score, GET /v1/status, POST /v1/control (pause/resume), GET
/health, GET /metrics, the OpenAPI schema at /openapi.json. With a token configured, /v1/score and
/v1/control need `Authorization: Bearer <token>` (scoring costs the training loop compute), checked before
any of the body is read; a body over --max-body-mb is refused (413) before it is read.

Errors are {"error": {"message", "code"}} with 400 (bad request), 401 (missing or wrong token), 404
(unknown path), 405 (wrong method), 413 (a body over the limit), 415 (a body that is not JSON), as the OpenAPI schema lists them;
request bodies are validated strictly (no "3" for an integer). GET /health answers 503 once the training
loop has stopped on an error (the service still answers Score and Status, but no longer trains)."""
from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minite_core.engine.rollout import MAX_TEMPERATURE, MIN_TEMPERATURE

from ..common.rpc import token_ok
from ..common.http import MIB, BodyLimit, is_json, strip_422
from ..common.metrics import add_metrics_route
from .runtime import LearnerRuntime, UnknownVersion

log = logging.getLogger("minite.auth")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # no coercion: "3" is not a token id

    prompt_ids: list[int] = Field(..., min_length=1)
    completion_ids: list[int] = Field(..., min_length=1)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="0 is read as 1, as the rollout engine "
                               f"reports logprobs; else at least {MIN_TEMPERATURE:g}")
    weight_version: int = Field(0, ge=0, le=2**63 - 1, description="score at this recent weight version "
                                "(0: the current one); 404 when the learner no longer keeps it")


class ControlRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    action: Literal["pause", "resume"]


class ErrorDetail(BaseModel):
    message: str
    code: int


class ErrorBody(BaseModel):
    error: ErrorDetail


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message or "error", "code": status}}, status_code=status)


def _errors(*statuses: int) -> dict:
    what = {400: "bad request (the message says which field and why)", 401: "missing or wrong token",
            404: "a weight version the learner no longer keeps", 413: "the body is larger than --max-body-mb",
            415: "the body is not JSON", 503: "the training loop stopped on an error, or the learner is shutting down"}
    return {s: {"model": ErrorBody, "description": what[s]} for s in statuses}


def loop_failed(rt: LearnerRuntime) -> bool:
    """Has the training loop ended on an error (not finished, not stopped, not still waiting for a replica)?"""
    t = rt.thread
    return bool(rt.last_error) and not rt.running and not rt.done and t.ident is not None and not t.is_alive()


class TokenFirst:
    """ASGI middleware: a POST to one of `paths` without the token is answered 401 before the app reads any
    of its body (a FastAPI dependency runs only after the body was read and parsed)."""

    def __init__(self, app, token: str | None, paths: tuple[str, ...]):
        self.app, self.token, self.paths = app, token, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not token_ok(self.token, header):
                log.warning("refused %s: %s token", scope["path"], "missing" if not header else "wrong")
                return await _error(401, "missing or wrong token: send 'Authorization: Bearer <token>'")(
                    scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(rt: LearnerRuntime) -> FastAPI:
    app = FastAPI(title="miniTE learner", version="1", description="Learner logprobs, training status and control.")
    add_metrics_route(app, rt.metrics.registry)
    app.add_middleware(BodyLimit, limit=int(rt.settings.max_body_mb * MIB), setting="--max-body-mb", error=_error)
    app.add_middleware(TokenFirst, token=rt.settings.token, paths=("/v1/score", "/v1/control"))  # (runs first)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and not is_json(ctype):
            return _error(415, f"the request body must be JSON (Content-Type: application/json), got "
                          f"{ctype or 'no Content-Type'}")
        parts = [f"{'.'.join(str(x) for x in e['loc'] if x != 'body') or 'body'}: {e['msg']}" for e in exc.errors()]
        return _error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.post("/v1/score", responses=_errors(400, 401, 404, 413, 415))
    async def score(body: ScoreRequest):
        try:
            lps, version = await asyncio.to_thread(rt.score, body.prompt_ids, body.completion_ids,
                                                   body.temperature or 1.0, body.weight_version)
        except ValueError as e:
            return _error(400, str(e))
        except UnknownVersion as e:
            return _error(404, str(e))
        return {"logprobs": lps, "weight_version": version}

    @app.get("/v1/status")
    async def status():
        return rt.status()

    @app.post("/v1/control", responses=_errors(400, 401, 413, 415), openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": ControlRequest.model_json_schema()}}}})
    async def control(request: Request):
        ctype = request.headers.get("content-type", "")
        if not is_json(ctype):
            return _error(415, f"the request body must be JSON (Content-Type: application/json), got "
                          f"{ctype or 'no Content-Type'}")
        try:
            body = ControlRequest.model_validate_json(await request.body())
        except ValidationError as e:
            return _error(400, "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}"
                                         for err in e.errors()) or "invalid request")
        (rt.paused.set if body.action == "pause" else rt.paused.clear)()
        return rt.status()

    @app.get("/health", responses=_errors(503))
    async def health():
        if loop_failed(rt):
            return JSONResponse({"status": "failed", "weight_version": rt.version, "step": rt.trainer.step_idx,
                                 "error": {"message": f"the training loop stopped: {rt.last_error}", "code": 503}},
                                status_code=503)
        if rt.stopping.is_set():
            return JSONResponse({"status": "draining", "weight_version": rt.version, "step": rt.trainer.step_idx,
                                 "error": {"message": "the learner is shutting down", "code": 503}}, status_code=503)
        return {"status": "ok", "weight_version": rt.version, "step": rt.trainer.step_idx}

    strip_422(app)
    return app
