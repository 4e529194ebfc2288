"""The rollout service's REST API (FastAPI): OpenAI-compatible completions and chat completions.

POST /v1/completions, POST /v1/chat/completions (logprobs with up to 20 alternatives per token, echo with the
prompt's logprobs, several prompts per completions call, text content parts, `stream: true` as server-sent
events (several prompts too) with `stream_options.include_usage`, seed, n, stop, plus vLLM's top_k and stop_token_ids; parameters
that would change the sampled distribution or ask for unserved output are a 400 naming them: UNSERVED and
docs/openai-api.md), GET /v1/models, GET /v1/weight_version, GET /health,
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

Streaming. Each chunk carries the text that can no longer change: a trailing piece of a multi-byte UTF-8
character (decoded as U+FFFD) and a trailing part that could still become a stop string are held back
(vLLM's incremental detokenization), so the streamed text is exactly the text of the same request served
whole.

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
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from minite_core.engine import SamplingParams
from minite_core.engine.rollout import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, MIN_TEMPERATURE
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


# OpenAI/vLLM parameters this service does not serve. Each is accepted at its neutral value and refused (400,
# naming it) otherwise, never ignored. The first four change the distribution tokens are drawn from, so the
# sampled tokens would no longer come from the policy whose logprobs the learner computes (the consistency
# promise: docs/consistency.md); the others ask for output this service does not produce.
UNSERVED = {
    "presence_penalty": ((None, 0, 0.0), "it would change the sampled distribution away from the policy's"),
    "frequency_penalty": ((None, 0, 0.0), "it would change the sampled distribution away from the policy's"),
    "repetition_penalty": ((None, 1, 1.0), "it would change the sampled distribution away from the policy's"),
    "logit_bias": ((None, {}), "it would change the sampled distribution away from the policy's"),
    "response_format": ((None, {"type": "text"}), "structured output is not served"),
    "tools": ((None, []), "tool calls are not served"),
    "tool_choice": ((None, "none"), "tool calls are not served"),
    "functions": ((None, []), "function calls are not served"),
    "function_call": ((None, "none"), "function calls are not served"),
    "suffix": ((None, ""), "insertion (suffix) is not served"),
    # vLLM's sampling extensions: each would change which tokens are drawn (or what a choice's text holds)
    "min_p": ((None, 0, 0.0), "it would change the sampled distribution away from the policy's"),
    "min_tokens": ((None, 0), "it would change the sampled distribution away from the policy's (eos masked)"),
    "bad_words": ((None, []), "it would change the sampled distribution away from the policy's"),
    "allowed_token_ids": ((None, []), "it would change the sampled distribution away from the policy's"),
    "use_beam_search": ((None, False), "beam search is not served"),
    "length_penalty": ((None, 1, 1.0), "beam search is not served"),
    "guided_json": ((None,), "structured output is not served"),
    "guided_regex": ((None,), "structured output is not served"),
    "guided_choice": ((None,), "structured output is not served"),
    "guided_grammar": ((None,), "structured output is not served"),
    "prompt_logprobs": ((None,), "use echo with logprobs (completions) for the prompt tokens' logprobs"),
    "include_stop_str_in_output": ((None, False), "the text ends before the stop string, as OpenAI's"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "truncate_prompt_tokens": ((None,), "a prompt is never truncated: one too long is a 400"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = Field(False, description="a last chunk with the request's usage and no choices")


def _nullable_in_schema(schema: dict, model) -> None:
    """OpenAPI: an optional field accepts null, read as its default (`_Sampling._null_is_the_default`)."""
    for name, prop in schema.get("properties", {}).items():
        f = model.model_fields.get(name)
        if f is None or f.is_required() or f.default is None:
            continue
        if "anyOf" in prop:
            if {"type": "null"} not in prop["anyOf"]:
                prop["anyOf"].append({"type": "null"})
            continue
        keep = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        schema["properties"][name] = {"anyOf": [dict(prop), {"type": "null"}], **keep}


class _Sampling(BaseModel):
    # (strict: no coercion, "3" is not an integer, 1 is not a boolean)
    model_config = ConfigDict(strict=True, json_schema_extra=_nullable_in_schema)

    model: str | None = None
    max_tokens: int = Field(16, ge=1, description="tokens to sample per choice; prompt + max_tokens must fit the "
                            "context (GET /v1/models: max_model_len)")
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="0: greedy (logprobs are then reported at "
                               f"temperature 1); else at least {MIN_TEMPERATURE:g}")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="vLLM extension: 0 (or -1) keeps the whole vocabulary")
    n: int = 1
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="a 64-bit signed integer")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: do not stop on the model's eos token ids")
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = Field(None, description="must equal n when given (no server-side ranking)")
    presence_penalty: Any = Field(None, description="not served: only 0")
    frequency_penalty: Any = Field(None, description="not served: only 0")
    repetition_penalty: Any = Field(None, description="not served: only 1")
    logit_bias: Any = Field(None, description="not served: only {}")
    response_format: Any = Field(None, description='not served: only {"type": "text"}')
    tools: Any = Field(None, description="not served: only []")
    tool_choice: Any = Field(None, description='not served: only "none"')
    functions: Any = Field(None, description="not served: only []")
    function_call: Any = Field(None, description='not served: only "none"')
    return_tokens_as_token_ids: bool = Field(False, description='vLLM extension: logprobs name tokens "token_id:N" '
                                             "instead of by their text")
    min_p: Any = Field(None, description="vLLM extension, not served: only 0")
    min_tokens: Any = Field(None, description="vLLM extension, not served: only 0")
    bad_words: Any = Field(None, description="vLLM extension, not served: only []")
    allowed_token_ids: Any = Field(None, description="vLLM extension, not served: only []")
    use_beam_search: Any = Field(None, description="vLLM extension, not served: only false")
    length_penalty: Any = Field(None, description="vLLM extension, not served: only 1")
    guided_json: Any = Field(None, description="vLLM extension, not served")
    guided_regex: Any = Field(None, description="vLLM extension, not served")
    guided_choice: Any = Field(None, description="vLLM extension, not served")
    guided_grammar: Any = Field(None, description="vLLM extension, not served")
    prompt_logprobs: Any = Field(None, description="vLLM extension, not served (completions: echo with logprobs)")
    include_stop_str_in_output: Any = Field(None, description="vLLM extension, not served: only false")
    skip_special_tokens: Any = Field(None, description="vLLM extension, not served: only true")
    spaces_between_special_tokens: Any = Field(None, description="vLLM extension, not served: only true")
    truncate_prompt_tokens: Any = Field(None, description="vLLM extension, not served")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's fields are nullable and clients send null for "not given": null means the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].default is None}
        return data

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v):
        return 0 if v == -1 and not isinstance(v, bool) else v  # vLLM's "-1: the whole vocabulary"

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

    def refuse_unserved(self) -> None:
        """400 naming the first parameter set to a value this service does not serve (UNSERVED)."""
        for name, (neutral, why) in UNSERVED.items():
            v = getattr(self, name, None)
            if not any(v is None if x is None else (v == x and isinstance(v, bool) == isinstance(x, bool))
                       for x in neutral):
                hint = f"send {json.dumps(neutral[1])} or leave it out" if len(neutral) > 1 else "leave it out"
                raise ApiError(400, f"{name}={json.dumps(v)[:80]} is not served: {why} ({hint})")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of={self.best_of} is not served: only best_of == n ({self.n}); the service "
                           "does not rank candidates")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true")

    def top(self) -> int:
        """How many alternatives to report per token (0: none)."""
        return 0

    def sampling(self, eos: tuple[int, ...] = ()) -> SamplingParams:
        """`eos`: the model's eos ids, added to stop_token_ids unless ignore_eos."""
        stop_ids = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else tuple(eos))
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, n=self.n, stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                              logprobs=self.top())

    def stops(self) -> tuple[str, ...]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not x for x in s):
            raise ApiError(400, "stop strings must be non-empty")
        return tuple(s)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, token ids, or a list of either (several prompts: choice index = prompt * n + sample)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="the sampled tokens' logprobs and the "
                                 f"`logprobs` most likely alternatives of each (0 .. {MAX_TOP_LOGPROBS})")
    echo: bool = Field(False, description="prepend the prompt to the text (and, with logprobs, its tokens' logprobs)")
    suffix: Any = Field(None, description='not served: only ""')

    def top(self) -> int:
        return self.logprobs or 0

    def prompts(self) -> list:
        """The prompts of the request: one text or id list, or several."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: str = Field(..., description='"text" (other part types are not served)')
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] = Field(..., description="a string, or a list of text parts (joined with newlines)")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        for i, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content part {i} has type {part.type!r}: only text parts are served")
        return "\n".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="tokens to sample per choice; default: the rest of the "
                                   "context (GET /v1/models: max_model_len), at most --max-tokens-limit")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens (wins if set)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: the most likely "
                                     f"alternatives of each token (0 .. {MAX_TOP_LOGPROBS})")
    add_generation_prompt: bool = Field(True, description="vLLM extension: end the prompt with the template's "
                                        "assistant header")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: extra variables for the "
                                                        "chat template, e.g. {\"enable_thinking\": false}")

    def top(self) -> int:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else 0


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

    def bounded(body: _Sampling, text_chars: int | None = None, n_ids: int | None = None,
                what: str = "the prompt text") -> None:
        """The request's sizes within InputBounds (400 otherwise), checked before any tokenizing."""
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        try:
            bounds.stops(len(body.stop_token_ids or ()), stops)
            if text_chars is not None:
                bounds.text(text_chars, what)
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
            return tokens_of("".join(m.text() for m in body.messages))
        messages = [dict(m.model_dump(), content=m.text()) for m in body.messages]
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

    pieces: dict[int, str] = {}

    def piece(tok: int, body: _Sampling) -> str:
        """A token's name in logprobs, as OpenAI and vLLM give it: its decoded text (" 338", not the BPE entry
        "Ġ338"; a special token by its name; part of a character as U+FFFD, its bytes in `bytes`), or with
        vLLM's return_tokens_as_token_ids "token_id:N"."""
        if body.return_tokens_as_token_ids:
            return f"token_id:{tok}"
        if rt.tokenizer is None:
            return ""
        if tok not in pieces:
            pieces[tok] = rt.tokenizer.decode([tok], skip_special_tokens=False)
        return pieces[tok]

    def token_bytes(tok: int) -> list[int]:
        return list(rt.tokenizer.token_bytes(tok)) if rt.tokenizer is not None else []

    def offsets(ids) -> list[int]:
        """text_offset: where each token's text begins in the decoded text (followed token by token, O(n));
        a token that ends inside a character begins where that character does."""
        if rt.tokenizer is None:
            return [0] * len(ids)
        out, text = [], rt.tokenizer.stream()
        for t in ids:
            out.append(len(text.text))
            text.push(t)
        return out

    def check(body: _Sampling) -> None:
        """Refusals that need no tokenizing: the model, unserved parameters, top-N bounds."""
        if body.model not in (None, "", name):
            raise ApiError(404, f"unknown model {body.model!r}; this service serves {name!r}", "model_not_found")
        body.refuse_unserved()
        body.top()

    async def start(body: _Sampling, prompt: list[int], events: asyncio.Queue | None, tag: int = 0):
        """Submit; returns (request, a future done when every choice finished). Streaming: the request's
        tokens go to `events` as (tag, choice, token, logprob, finish), then (tag, None) when it is done.
        The caller has run `check(body)`."""
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        on_token = (lambda *a: loop.call_soon_threadsafe(events.put_nowait, (tag, *a))) if events is not None else None

        def on_done(r):
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(r))
            if events is not None:  # after every token of this request: its end marker
                loop.call_soon_threadsafe(events.put_nowait, (tag, None))
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

    async def wait(reqs, finished, request: Request):
        while True:  # cancel the work if the client hangs up
            if await request.is_disconnected():
                for req in reqs:
                    await asyncio.to_thread(rt.cancel, req)
                raise ApiError(499, "client closed the request")
            pending = [f for f in finished if not f.done()]  # (after the await above: some may have finished)
            if not pending:
                break
            await asyncio.wait(pending, timeout=0.25)
        rt.metrics.requests.labels("rest", "ok").inc()

    def usage(reqs) -> dict:
        prompt = sum(len(r.prompt) for r in reqs)
        gen = sum(len(q.tokens) for r in reqs for q in r.seqs)
        return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}

    def trim(text: str, stops) -> str:
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        return text

    def held_back(text: str, stops) -> str:
        """What may be streamed of an unfinished choice's text: not a trailing incomplete UTF-8 character
        (decoded as U+FFFD until its last byte arrives, as vLLM's incremental detokenizer holds it), and not
        a trailing part of the text that could still grow into a stop string."""
        text = text.rstrip("\ufffd")
        hold = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]

    def unsent(text: str, sent: str) -> str:
        """What of a choice's text is not streamed yet (nothing when the text no longer begins with what was)."""
        return text[len(sent):] if text.startswith(sent) else ""

    def chat_logprob(tok: int, lp: float, alts, body) -> dict:
        return {"token": piece(tok, body), "logprob": lp, "bytes": token_bytes(tok),
                "top_logprobs": [{"token": piece(t, body), "logprob": a, "bytes": token_bytes(t)} for t, a in (alts or [])]}

    def top_dict(tok: int, lp: float, alts, body) -> dict:
        """Completions' top_logprobs entry: the alternatives and the sampled token (as vLLM), by token name."""
        d = {piece(t, body): a for t, a in (alts or [])}
        d.setdefault(piece(tok, body), lp)
        return d

    async def sse(kind: str, body, reqs: list, events: asyncio.Queue, request: Request):
        """The server-sent events of one or several requests (several prompts: choice index = prompt x n +
        sample), in the order their tokens come."""
        rid, created = f"{'cmpl' if kind == 'cmpl' else 'chatcmpl'}-{uuid.uuid4().hex[:16]}", int(time.time())
        obj = "text_completion" if kind == "cmpl" else "chat.completion.chunk"
        stops = body.stops()
        n = body.n
        seqs = {k * n + q.sample_index: (req, q) for k, req in enumerate(reqs) for q in req.seqs}
        sent = {c: "" for c in seqs}  # text streamed so far per choice
        toks: dict[int, list[int]] = {c: [] for c in seqs}
        streams = {c: rt.tokenizer.stream() for c in seqs} if rt.tokenizer is not None else None  # text per choice
        ended: set[int] = set()
        open_reqs = set(range(len(reqs)))
        want_lp = (body.logprobs is not None) if kind == "cmpl" else bool(body.logprobs)
        top = body.top()
        base = {c: 0 for c in seqs}  # where a choice's completion begins in its text (after an echoed prompt)
        try:
            if kind == "cmpl" and body.echo:  # each choice begins with the prompt, as the unary answer's text does
                for k, req in enumerate(reqs):
                    head, lp_part = text_of(req.prompt), None
                    if want_lp:
                        lps, alts = await asyncio.to_thread(rt.prompt_logprobs, req)
                        lp_part = {"tokens": [piece(t, body) for t in req.prompt], "token_logprobs": [None] + lps,
                                   "top_logprobs": [None] + [top_dict(t, lp, a, body)
                                                             for t, lp, a in zip(req.prompt[1:], lps, alts)],
                                   "text_offset": offsets(req.prompt)}
                    for q in req.seqs:
                        base[k * n + q.sample_index] = len(head)
                        yield _chunk(rid, obj, created, name, kind, k * n + q.sample_index, None, None, req, head,
                                     lp_part)
            while open_reqs:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if ev[1] is None:  # a request's on_done: every token of it is already in the queue
                    open_reqs.discard(ev[0])
                    continue
                k, i, tok, lp, finish = ev
                c = k * n + i
                req, q = seqs[c]
                toks[c].append(tok)
                # the text so far, cut at a stop string; unfinished, less what may still change (held_back):
                # the delta is what was not streamed yet, so the streamed text is the non-streamed text
                # (followed token by token; the last token's text is the whole decode, as the unary answer's)
                if streams is not None:
                    streams[c].push(tok)
                text = trim(text_of(toks[c]) if finish else (streams[c].text if streams else ""), stops)
                if not finish:
                    text = held_back(text, stops)
                delta = unsent(text, sent[c])
                sent[c] = sent[c] + delta
                if finish:
                    ended.add(c)
                lp_part = None
                if want_lp:
                    alts = q.top[len(toks[c]) - 1] if top else None
                    if kind == "cmpl":
                        lp_part = {"tokens": [piece(tok, body)], "token_logprobs": [lp],
                                   "top_logprobs": [top_dict(tok, lp, alts, body)],
                                   "text_offset": [base[c] + len(sent[c]) - len(delta)]}
                    else:
                        lp_part = {"content": [chat_logprob(tok, lp, alts, body)]}
                yield _chunk(rid, obj, created, name, kind, c, tok, finish, req, delta, lp_part)
            for c, (req, q) in seqs.items():  # samples that ended without a token of their own (aborted):
                if c not in ended:  # the end, with the text held back so far (the whole decode, as unary)
                    yield _chunk(rid, obj, created, name, kind, c, None, q.finish, req,
                                 unsent(trim(text_of(toks[c]), stops), sent[c]))
            if body.stream_options is not None and body.stream_options.include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": name,
                                             "choices": [], "usage": usage(reqs)}) + "\n\n"
            rt.metrics.requests.labels("rest", "ok").inc()
            yield "data: [DONE]\n\n"
        finally:
            for req in reqs:
                if not all(q.finish for q in req.seqs):
                    await asyncio.to_thread(rt.cancel, req)

    def envelope(obj: str, prefix: str, choices: list, reqs, prompts: list) -> dict:
        one = len(reqs) == 1
        return {"id": f"{prefix}-{uuid.uuid4().hex[:16]}", "object": obj, "created": int(time.time()), "model": name,
                "choices": choices, "usage": usage(reqs), "prompt_token_ids": prompts[0] if one else prompts,
                "weight_version": reqs[0].version if one else [r.version for r in reqs]}

    async def tokenized(body: CompletionRequest, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt is empty")
            bounded(body, text_chars=len(prompt))
            return await asyncio.to_thread(tokens_of, prompt)  # off the event loop: /health keeps answering
        if not prompt:
            raise ApiError(400, "prompt is empty")
        bounded(body, n_ids=len(prompt))
        return prompt

    @app.post("/v1/completions", responses={**STREAM, **_errors(400, 404, 413, 415, 429, 503)})
    async def completions(body: CompletionRequest, request: Request):
        texts = body.prompts()
        if not texts:
            raise ApiError(400, "prompt is empty")
        check(body)
        if len(texts) > 1 and len(texts) * body.n > rt.settings.max_waiting:
            raise ApiError(400, f"{len(texts)} prompts x n={body.n} sequences: more than the queue holds "
                           f"({rt.settings.max_waiting}, --max-waiting)")
        prompts = [await tokenized(body, t) for t in texts]
        events = asyncio.Queue() if body.stream else None
        started = []
        try:
            for k, prompt in enumerate(prompts):
                started.append(await start(body, prompt, events, tag=k))
        except ApiError:
            for req, _ in started:
                await asyncio.to_thread(rt.cancel, req)
            raise
        reqs = [r for r, _ in started]
        if body.stream:
            return StreamingResponse(sse("cmpl", body, reqs, events, request), media_type="text/event-stream")
        await wait(reqs, [f for _, f in started], request)
        stops = body.stops()
        choices = []
        for k, (req, prompt) in enumerate(zip(reqs, prompts)):
            prompt_lps, prompt_alts = await asyncio.to_thread(rt.prompt_logprobs, req) \
                if body.echo and body.logprobs is not None else (None, None)
            head = text_of(prompt) if body.echo else ""
            for c in req.completions():
                text = trim(text_of(c.token_ids), stops)
                choice = {"index": k * body.n + c.sample_index, "text": head + text, "finish_reason": c.finish_reason,
                          "token_ids": c.token_ids, "weight_version": c.weight_version, "logprobs": None}
                if body.logprobs is not None:
                    ids, lps = list(c.token_ids), c.logprobs.tolist()
                    tops = [top_dict(t, lp, a, body) for t, lp, a in zip(ids, lps, c.top_logprobs or [None] * len(ids))]
                    if body.echo:
                        tops = [None] + [top_dict(t, lp, a, body)
                                         for t, lp, a in zip(prompt[1:], prompt_lps, prompt_alts)] + tops
                        ids, lps = list(prompt) + ids, [None] + prompt_lps + lps
                    choice["logprobs"] = {"tokens": [piece(t, body) for t in ids], "token_logprobs": lps, "top_logprobs": tops,
                                          "text_offset": offsets(ids)}
                choices.append(choice)
        return envelope("text_completion", "cmpl", choices, reqs, prompts)

    @app.post("/v1/chat/completions", responses={**STREAM, **_errors(400, 404, 413, 415, 429, 503)})
    async def chat(body: ChatRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        check(body)
        kwargs = json.dumps(body.chat_template_kwargs) if body.chat_template_kwargs else ""  # (rendered too)
        bounded(body, text_chars=sum(len(m.text()) for m in body.messages) + len(kwargs),
                what="the messages' contents" + (" and chat_template_kwargs" if kwargs else ""))
        prompt = await asyncio.to_thread(chat_prompt, body)  # off the event loop: /health keeps answering
        if not prompt:
            raise ApiError(400, "the messages have no content")
        if body.max_tokens is None:  # (OpenAI: as many as fit; a full context stays a 400 naming the sizes)
            body.max_tokens = max(1, min(rt.context - len(prompt), rt.settings.max_tokens_limit))
        events = asyncio.Queue() if body.stream else None
        req, finished = await start(body, prompt, events)
        if body.stream:
            return StreamingResponse(sse("chat", body, [req], events, request), media_type="text/event-stream")
        await wait([req], [finished], request)
        stops = body.stops()
        choices = []
        for c in req.completions():
            choice = {"index": c.sample_index, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                      "weight_version": c.weight_version, "logprobs": None,
                      "message": {"role": "assistant", "content": trim(text_of(c.token_ids), stops)}}
            if body.logprobs:
                choice["logprobs"] = {"content": [chat_logprob(t, lp, a, body) for t, lp, a in zip(
                    c.token_ids, c.logprobs.tolist(), c.top_logprobs or [None] * len(c.token_ids))]}
            choices.append(choice)
        return envelope("chat.completion", "chatcmpl", choices, [req], [prompt])

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


def _chunk(rid, obj, created, model, kind, i, tok, finish, req, text="", logprobs=None) -> str:
    """One server-sent event: `text` is the choice's new text (held back while it may still change),
    `logprobs` the token's logprobs entry (or None)."""
    if kind == "cmpl":
        choice = {"index": i, "text": text, "finish_reason": finish,
                  "token_ids": [tok] if tok is not None else [], "weight_version": req.version, "logprobs": logprobs}
    else:
        choice = {"index": i, "delta": {"role": "assistant", "content": text},
                  "finish_reason": finish, "token_ids": [tok] if tok is not None else [], "weight_version": req.version,
                  "logprobs": logprobs}
    return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                                  "prompt_token_ids": req.prompt}) + "\n\n"
