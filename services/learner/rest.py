"""The learner service's REST API: POST /v1/score, GET /v1/status, POST /v1/control (pause/resume,
needs `Authorization: Bearer <token>`), GET /health, GET /metrics, the OpenAPI schema at /openapi.json."""
from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from ..common.rpc import token_ok
from ..common.metrics import add_metrics_route
from .runtime import LearnerRuntime

log = logging.getLogger("minite.auth")


class ScoreRequest(BaseModel):
    prompt_ids: list[int] = Field(..., min_length=1)
    completion_ids: list[int] = Field(..., min_length=1)
    temperature: float = Field(1.0, description="0 is read as 1, as the rollout engine reports logprobs")


class ControlRequest(BaseModel):
    action: Literal["pause", "resume"]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def build_app(rt: LearnerRuntime) -> FastAPI:
    app = FastAPI(title="miniTE learner", version="1", description="Learner logprobs, training status and control.")
    add_metrics_route(app, rt.metrics.registry)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(x) for x in e['loc'] if x != 'body') or 'body'}: {e['msg']}" for e in exc.errors()]
        return _error(400, "; ".join(parts) or "invalid request")

    @app.post("/v1/score")
    async def score(body: ScoreRequest):
        try:
            lps, version = await asyncio.to_thread(rt.score, body.prompt_ids, body.completion_ids, body.temperature or 1.0)
        except ValueError as e:
            return _error(400, str(e))
        return {"logprobs": lps, "weight_version": version}

    @app.get("/v1/status")
    async def status():
        return rt.status()

    @app.post("/v1/control")
    async def control(body: ControlRequest, authorization: str | None = Header(None)):
        if not token_ok(rt.settings.token, authorization):
            log.warning("refused /v1/control: %s token", "missing" if not authorization else "wrong")
            return _error(401, "missing or wrong token: send 'Authorization: Bearer <token>'")
        (rt.paused.set if body.action == "pause" else rt.paused.clear)()
        return rt.status()

    @app.get("/health")
    async def health():
        return {"status": "ok", "weight_version": rt.version, "step": rt.trainer.step_idx}

    return app
