"""The rollout service's REST API (FastAPI): OpenAI-compatible completions and chat completions.

POST /v1/completions, POST /v1/chat/completions (logprobs, `stream: true` as server-sent events, seed,
n, stop, plus vLLM's top_k and stop_token_ids), GET /v1/models, GET /v1/weight_version, GET /health,
GET /metrics (Prometheus), the OpenAPI schema at /openapi.json. Every response carries the token ids
of the prompt and of each completion (as vLLM's `return_token_ids`) and the weight version used (as
SGLang's `weight_version`). Errors are OpenAI-shaped: {"error": {"message", "type", "code"}} with 400
(bad request), 404 (unknown model or path), 405 (wrong method), 413 (a body over --max-body-mb), 415 (a
body that is not JSON), 429 (queue full), 503 (shutting down); the OpenAPI schema lists them (and no 422:
validation errors are 400).
Request bodies are validated strictly: a field of the wrong JSON type ("3" for an integer, 1 for a
boolean) is refused, not coerced.

Prompts. A text prompt of /v1/completions is encoded with the tokenizer's special tokens (vLLM's
`add_special_tokens=True`). /v1/chat/completions renders the model's chat template
(`minite_core.tokenizer`, as transformers' `apply_chat_template`) with `add_generation_prompt` (default
true) and vLLM's `chat_template_kwargs` (e.g. {"enable_thinking": false}), so its `prompt_token_ids` equal
`Tokenizer.apply_chat_template` (the learner's) and transformers'; a template that fails to render is a 400
naming the template file. A model whose tokenizer has no chat template (the built-in tiny model) gets its
messages' contents concatenated, in order.

Bounds: what a request costs is bounded before any work is done on it, since one unbounded request could
take the whole replica (a 10 MB text prompt used to be read, parsed and tokenized into 4 GB). The body is
limited (--max-body-mb; 413, refused from its Content-Length before it is read, or once a chunked body
passes it); a text prompt (/v1/completions' prompt, the messages' contents of /v1/chat/completions, gRPC's
`text`) may have at most as many characters as could fit the context (InputBounds), checked before it is
tokenized; a token-id prompt longer than the context is refused before its ids are looked at; `stop` and
`stop_token_ids` are bounded (--max-stop, --max-stop-chars, --max-stop-token-ids). Tokenizing and
rendering the chat template run on a worker thread, so /health and the other requests keep being answered.

Stopping. As vLLM: generation stops on the model's eos ids (generation_config.json's eos_token_id, else
config.json's, else the tokenizer's eos_token) and on `stop_token_ids` / `stop` strings; `ignore_eos: true`
turns the eos ids off (not stop_token_ids).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from minite_core.engine import SamplingParams
from minite_core.engine.rollout import MAX_TEMPERATURE, MIN_TEMPERATURE
from minite_core.tokenizer import ChatTemplateError

from ..common.http import MIB, BodyLimit, is_json, strip_422
from ..common.metrics import add_metrics_route
from .runtime import Overloaded, RolloutRuntime


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        self.status, self.message, self.code = status, message, code


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message or "error", "type": code, "code": status}}, status_code=status)


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorBody(BaseModel):
    error: ErrorDetail


def _errors(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses (the body every error has)."""
    what = {400: "bad request (the message says which field and why)", 404: "unknown model",
            413: "the body is larger than --max-body-mb", 415: "the body is not JSON",
            429: "the queue is full: retry later", 503: "shutting down"}
    return {s: {"model": ErrorBody, "description": what[s]} for s in statuses}


INT64 = 2**63

# -- input bounds (REST and gRPC): refused by size before any work ------------------------------------------
CHAR_SLACK = 2  # characters per token beyond the longest token's: normalizers that compose ("e" + U+0301 -> "é")


class InputBounds:
    """The size limits a request meets before any work is done on it; each check raises ValueError naming
    the field, its size and the limit.

    Text prompts: the tokenizers of generative models are lossless (byte-level BPE, SentencePiece with
    byte fallback, the tiny model's characters): every character of a text ends up in some token, and a
    token covers at most as many characters as its vocabulary string has (byte-level BPE writes one
    character per byte, and a character is at least one byte; added tokens are their own text). So a text
    that fits the context has at most context x (the longest vocabulary string) characters; CHAR_SLACK
    doubles that for normalizers that compose characters (Qwen's NFC). A longer text can never be served,
    and tokenizing it first cost ~400 bytes of memory per character (a 10 MB prompt: 4 GB), in a call that
    cannot be interrupted: it is refused on its length alone."""

    def __init__(self, settings, tokenizer, context: int):
        self.settings, self.context = settings, context
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.chars_per_token = CHAR_SLACK * max(longest, 1)
        self.text_chars = context * self.chars_per_token

    def text(self, chars: int, what: str = "the prompt text") -> None:
        if chars > self.text_chars:
            raise ValueError(f"{what}: {chars} characters, more than the {self.text_chars} that could fit the "
                             f"context of {self.context} tokens (at most {self.chars_per_token} characters per token "
                             "with this tokenizer)")

    def prompt_ids(self, n: int) -> None:
        if n > self.context:
            raise ValueError(f"the prompt has {n} token ids: more than the context of {self.context} tokens")

    def stops(self, n_ids: int, stops=()) -> None:
        s = self.settings
        if n_ids > s.max_stop_token_ids:
            raise ValueError(f"stop_token_ids has {n_ids} ids: at most {s.max_stop_token_ids} (--max-stop-token-ids)")
        if len(stops) > s.max_stop:
            raise ValueError(f"stop has {len(stops)} strings: at most {s.max_stop} (--max-stop)")
        for i, x in enumerate(stops):
            if len(x) > s.max_stop_chars:
                raise ValueError(f"stop string {i} has {len(x)} characters: at most {s.max_stop_chars} "
                                 "(--max-stop-chars)")


class _Sampling(BaseModel):
    model_config = ConfigDict(strict=True)  # no coercion: "3" is not an integer, 1 is not a boolean

    model: str | None = None
    max_tokens: int = Field(16, ge=1, description="tokens to sample per choice; prompt + max_tokens must fit the "
                            "context (GET /v1/models: max_model_len)")
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="0: greedy (logprobs are then reported at "
                               f"temperature 1); else at least {MIN_TEMPERATURE:g}")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="vLLM extension: 0 keeps the whole vocabulary")
    n: int = 1
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="a 64-bit signed integer")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: do not stop on the model's eos token ids")
    stream: bool = False

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v):
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    def sampling(self, eos: tuple[int, ...] = ()) -> SamplingParams:
        """`eos`: the model's eos ids, added to stop_token_ids unless ignore_eos."""
        stop_ids = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else tuple(eos))
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, n=self.n, stop_token_ids=tuple(dict.fromkeys(stop_ids)))

    def stops(self) -> tuple[str, ...]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not x for x in s):
            raise ApiError(400, "stop strings must be non-empty")
        return tuple(s)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(..., description="text, or token ids")
    logprobs: int | None = Field(None, ge=0, description="include the sampled tokens' logprobs (any value >= 0)")
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens (wins if set)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob is available")
    add_generation_prompt: bool = Field(True, description="vLLM extension: end the prompt with the template's "
                                        "assistant header")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: extra variables for the "
                                                        "chat template, e.g. {\"enable_thinking\": false}")


def build_app(rt: RolloutRuntime) -> FastAPI:
    app = FastAPI(title="miniTE rollout", version="1", description="OpenAI-compatible sampling with exact logprobs "
                  "and weight versions (minite.v1.RolloutService over REST).")
    add_metrics_route(app, rt.metrics.registry)
    name = rt.settings.model_name
    bounds = InputBounds(rt.settings, rt.tokenizer, rt.context)
    app.add_middleware(BodyLimit, limit=int(rt.settings.max_body_mb * MIB), setting="--max-body-mb",
                       error=lambda status, message: _error(status, message, "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        rt.metrics.requests.labels("rest", "error").inc()
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and not is_json(ctype):
            return _error(415, f"the request body must be JSON (Content-Type: application/json), got "
                          f"{ctype or 'no Content-Type'}", "invalid_request_error")
        parts = [f"{'.'.join(str(x) for x in e['loc'] if x != 'body') or 'body'}: {e['msg']}" for e in exc.errors()]
        return _error(400, "; ".join(parts) or "invalid request", "invalid_request_error")

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        rt.metrics.requests.labels("rest", "error").inc()
        return _error(exc.status, exc.message, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found_error", 413: "invalid_request_error"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, str(exc.detail), code)

    def bounded(body: _Sampling, text_chars: int | None = None, n_ids: int | None = None) -> None:
        """The request's sizes within InputBounds (400 otherwise), checked before any tokenizing."""
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        try:
            bounds.stops(len(body.stop_token_ids or ()), stops)
            if text_chars is not None:
                bounds.text(text_chars, "the prompt text" if isinstance(body, CompletionRequest) else
                            "the messages' contents")
            if n_ids is not None:
                bounds.prompt_ids(n_ids)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def tokens_of(prompt) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if rt.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids")
        try:
            return rt.tokenizer.encode(prompt, add_special_tokens=True)
        except Exception as e:  # the tokenizer refuses what it cannot read (e.g. lone surrogates)
            raise ApiError(400, f"cannot tokenize the prompt: {e}") from None

    def chat_prompt(body: ChatRequest) -> list[int]:
        """The chat template rendered to ids (as the learner's); without one, the contents concatenated."""
        if rt.tokenizer is None or rt.tokenizer.chat_template is None:
            return tokens_of("".join(m.content for m in body.messages))
        messages = [m.model_dump() for m in body.messages]
        kwargs = body.chat_template_kwargs or {}
        for k in ("messages", "add_generation_prompt"):
            if k in kwargs:
                raise ApiError(400, f"chat_template_kwargs cannot set {k!r}: the request's own field does")
        try:
            return rt.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # the tokenizer refuses what it cannot read (e.g. lone surrogates)
            raise ApiError(400, f"cannot tokenize the rendered chat: {e}") from None

    def text_of(ids) -> str:
        return rt.tokenizer.decode(list(ids)) if rt.tokenizer is not None else ""

    def piece(tok: int) -> str:
        return rt.tokenizer.id_to_token(tok) or "" if rt.tokenizer is not None else ""

    async def start(body: _Sampling, prompt: list[int], events: asyncio.Queue | None):
        """Submit; returns (request, a future done when every choice finished)."""
        if body.model not in (None, "", name):
            raise ApiError(404, f"unknown model {body.model!r}; this service serves {name!r}", "model_not_found")
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        on_token = (lambda *a: loop.call_soon_threadsafe(events.put_nowait, a)) if events is not None else None

        def on_done(r):
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(r))
            if events is not None:
                loop.call_soon_threadsafe(events.put_nowait, None)  # after every token: the end marker
        try:
            params, stops = body.sampling(rt.eos_token_ids), body.stops()
            rt.check(prompt, params)  # bad input (400) before a full queue (429)
            rt.check_admission(params.n)  # a refusal costs no worker thread and no wait for the engine
            req = await asyncio.to_thread(rt.submit, prompt, params, on_token=on_token, on_done=on_done, stop=stops)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except Overloaded as e:
            raise ApiError(429, str(e), "rate_limit_error") from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        return req, finished

    async def wait(req, finished, request: Request):
        while not finished.done():  # cancel the work if the client hangs up
            if await request.is_disconnected():
                await asyncio.to_thread(rt.cancel, req)
                raise ApiError(499, "client closed the request")
            await asyncio.wait({finished}, timeout=0.25)
        rt.metrics.requests.labels("rest", "ok").inc()

    def usage(req) -> dict:
        gen = sum(len(q.tokens) for q in req.seqs)
        return {"prompt_tokens": len(req.prompt), "completion_tokens": gen, "total_tokens": len(req.prompt) + gen}

    def trim(text: str, stops) -> str:
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        return text

    async def sse(kind: str, body, req, events: asyncio.Queue, request: Request):
        rid, created = f"{'cmpl' if kind == 'cmpl' else 'chatcmpl'}-{uuid.uuid4().hex[:16]}", int(time.time())
        obj = "text_completion" if kind == "cmpl" else "chat.completion.chunk"
        stops = body.stops()
        sent = {q.sample_index: "" for q in req.seqs}  # text streamed so far per choice
        toks: dict[int, list[int]] = {q.sample_index: [] for q in req.seqs}
        ended: set[int] = set()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if ev is None:  # on_done: every token is already in the queue before this marker
                    break
                i, tok, lp, finish = ev
                toks[i].append(tok)
                # the text so far, cut at a stop string: the delta is what was not streamed yet (a stop string
                # of several tokens may have begun streaming before it was complete)
                text = trim(text_of(toks[i]), stops)
                delta = text[len(sent[i]):]
                sent[i] = sent[i] + delta
                if finish:
                    ended.add(i)
                yield _chunk(rid, obj, created, name, kind, i, tok, lp, finish, req, delta, piece(tok), body)
            for q in req.seqs:  # samples that ended without a token of their own (aborted)
                if q.sample_index not in ended:
                    yield _chunk(rid, obj, created, name, kind, q.sample_index, None, None, q.finish, req)
            rt.metrics.requests.labels("rest", "ok").inc()
            yield "data: [DONE]\n\n"
        finally:
            if not all(q.finish for q in req.seqs):
                await asyncio.to_thread(rt.cancel, req)

    async def serve(kind: str, body: _Sampling, prompt: list[int], request: Request):
        """Submit; an SSE response when streaming, else the finished request."""
        events = asyncio.Queue() if body.stream else None
        req, finished = await start(body, prompt, events)
        if body.stream:
            return StreamingResponse(sse(kind, body, req, events, request), media_type="text/event-stream")
        await wait(req, finished, request)
        return req

    def envelope(obj: str, prefix: str, choices: list, req, prompt: list[int]) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex[:16]}", "object": obj, "created": int(time.time()), "model": name,
                "choices": choices, "usage": usage(req), "prompt_token_ids": prompt, "weight_version": req.version}

    @app.post("/v1/completions", responses={**STREAM, **_errors(400, 404, 413, 415, 429, 503)})
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str) and not body.prompt:
            raise ApiError(400, "prompt is empty")
        if isinstance(body.prompt, str):
            bounded(body, text_chars=len(body.prompt))
            prompt = await asyncio.to_thread(tokens_of, body.prompt)  # off the event loop: /health keeps answering
        else:
            bounded(body, n_ids=len(body.prompt))
            prompt = body.prompt
        req = await serve("cmpl", body, prompt, request)
        if isinstance(req, StreamingResponse):
            return req
        stops = body.stops()
        choices = []
        for c in req.completions():
            text = trim(text_of(c.token_ids), stops)
            choice = {"index": c.sample_index, "text": (text_of(prompt) + text) if body.echo else text,
                      "finish_reason": c.finish_reason, "token_ids": c.token_ids, "weight_version": c.weight_version,
                      "logprobs": None}
            if body.logprobs is not None:
                choice["logprobs"] = {"tokens": [piece(t) for t in c.token_ids], "token_logprobs": c.logprobs.tolist(),
                                      "top_logprobs": None, "text_offset": None}
            choices.append(choice)
        return envelope("text_completion", "cmpl", choices, req, prompt)

    @app.post("/v1/chat/completions", responses={**STREAM, **_errors(400, 404, 413, 415, 429, 503)})
    async def chat(body: ChatRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        bounded(body, text_chars=sum(len(m.content) for m in body.messages))
        prompt = await asyncio.to_thread(chat_prompt, body)  # off the event loop: /health keeps answering
        if not prompt:
            raise ApiError(400, "the messages have no content")
        req = await serve("chat", body, prompt, request)
        if isinstance(req, StreamingResponse):
            return req
        stops = body.stops()
        choices = []
        for c in req.completions():
            choice = {"index": c.sample_index, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                      "weight_version": c.weight_version, "logprobs": None,
                      "message": {"role": "assistant", "content": trim(text_of(c.token_ids), stops)}}
            if body.logprobs:
                choice["logprobs"] = {"content": [{"token": piece(t), "logprob": lp, "top_logprobs": []}
                                                  for t, lp in zip(c.token_ids, c.logprobs.tolist())]}
            choices.append(choice)
        return envelope("chat.completion", "chatcmpl", choices, req, prompt)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "minite",
                                            "max_model_len": rt.context}]}

    @app.get("/v1/weight_version")
    async def weight_version():
        return {"weight_version": rt.version}

    @app.get("/health", responses={503: {"description": "draining: the service is stopping"}})
    async def health():
        if not rt.accepting:
            return JSONResponse({"status": "draining", "weight_version": rt.version}, status_code=503)
        return {"status": "ok", "weight_version": rt.version}

    strip_422(app)
    return app


STREAM = {200: {"description": "the completion; with `stream: true`, server-sent events ending with `data: [DONE]`",
                "content": {"text/event-stream": {"schema": {  # one event (OpenAPI 3.1: the schema is per event)
                    "type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string", "description": "a JSON chunk; [DONE] at the end"}}}}}}}


def _chunk(rid, obj, created, model, kind, i, tok, lp, finish, req, text="", token="", body=None) -> str:
    """One server-sent event: `text` is the token's text (empty for special tokens), `token` its name."""
    if kind == "cmpl":
        choice = {"index": i, "text": text if tok is not None else "", "finish_reason": finish,
                  "token_ids": [tok] if tok is not None else [], "weight_version": req.version,
                  "logprobs": ({"tokens": [token], "token_logprobs": [lp], "top_logprobs": None, "text_offset": None}
                               if body is not None and body.logprobs is not None and tok is not None else None)}
    else:
        choice = {"index": i, "delta": {"role": "assistant", "content": text if tok is not None else ""},
                  "finish_reason": finish, "token_ids": [tok] if tok is not None else [], "weight_version": req.version,
                  "logprobs": ({"content": [{"token": token, "logprob": lp, "top_logprobs": []}]}
                               if body is not None and body.logprobs and tok is not None else None)}
    return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                                  "prompt_token_ids": req.prompt}) + "\n\n"
