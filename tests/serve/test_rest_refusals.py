"""Malformed REST requests to both services, served for real on loopback (uvicorn): each refused with the
deliberate status (400, 401, 404, 405, 413, 415, 429) and a JSON error naming the problem; wrong methods and
paths; and the boundaries from both sides (a prompt that fits exactly is served)."""
import httpx
import pytest

from tests.service_helpers import MAX_WAITING, TOKEN, error_message


def _rest_refused(r, status, words):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    message = error_message(r)
    assert message and words in message, r.text


P = "<bos>1+2="
REST_COMPLETIONS = [
    # (id, body, status, words); a body given as bytes/str is sent as it is
    ("prompt-context", lambda lim: {"prompt": [4] * lim["context"], "max_tokens": 1}, 400, "context"),
    ("prompt-context+1", lambda lim: {"prompt": [4] * (lim["context"] + 1), "max_tokens": 1}, 400, "context"),
    ("text-over-context", lambda lim: {"prompt": "<bos>" + "1" * lim["context"], "max_tokens": 1}, 400, "context"),
    ("token-id=vocab", lambda lim: {"prompt": [1, lim["vocab"]]}, 400, "vocabulary"),
    ("token-id-negative", {"prompt": [1, -1]}, 400, "vocabulary"),
    ("token-id-2^70", {"prompt": [1, 2**70]}, 400, "vocabulary"),
    ("n-2^64", {"prompt": P, "n": 2**64}, 400, "n must"),
    ("n-negative", {"prompt": P, "n": -3}, 400, "n must"),
    ("n-over-queue", {"prompt": P, "n": MAX_WAITING + 1}, 400, "n must"),
    ("max_tokens-2^70", {"prompt": P, "max_tokens": 2**70}, 400, "max_tokens"),
    ("temperature-inf", '{"prompt": "<bos>1+2=", "temperature": Infinity}', 400, "temperature"),
    ("temperature--inf", '{"prompt": "<bos>1+2=", "temperature": -Infinity}', 400, "temperature"),
    ("temperature-1e400", '{"prompt": "<bos>1+2=", "temperature": 1e400}', 400, "temperature"),
    ("top_p-nan", '{"prompt": "<bos>1+2=", "top_p": NaN}', 400, "top_p"),
    ("top_p-over-1", {"prompt": P, "top_p": 1.5}, 400, "top_p"),
    ("top_k-negative", {"prompt": P, "top_k": -2}, 400, "top_k"),  # (-1: vLLM's "off", served)
    ("stop-token-id-out-of-vocab", lambda lim: {"prompt": P, "stop_token_ids": [lim["vocab"]]}, 400, "stop"),
    ("seed-2^63", {"prompt": P, "seed": 2**63}, 400, "seed"),
    ("max_tokens-string", {"prompt": P, "max_tokens": "3"}, 400, "max_tokens"),
    ("max_tokens-float", {"prompt": P, "max_tokens": 3.5}, 400, "max_tokens"),
    ("max_tokens-bool", {"prompt": P, "max_tokens": True}, 400, "max_tokens"),
    ("n-string", {"prompt": P, "n": "2"}, 400, "n"),
    ("temperature-string", {"prompt": P, "temperature": "0.5"}, 400, "temperature"),
    ("stream-string", {"prompt": P, "stream": "true"}, 400, "stream"),
    ("prompt-mixed-list", {"prompt": [1, "2"]}, 400, "prompt"),
    ("prompt-empty-in-list", {"prompt": ["1+2=", ""]}, 400, "prompt is empty"),
    ("prompt-null", {"prompt": None}, 400, "prompt"),
    ("prompt-object", {"prompt": {"text": P}}, 400, "prompt"),
    ("model-number", {"prompt": P, "model": 3}, 400, "model"),
    ("stop-number", {"prompt": P, "stop": 5}, 400, "stop"),
    ("stream-bad-input", {"prompt": P, "stream": True, "max_tokens": -1}, 400, "max_tokens"),
    ("body-array", b"[]", 400, "body"),
    ("body-null", b"null", 400, "body"),
    ("body-truncated", b'{"prompt": "<bos>1', 400, "JSON"),
    ("body-not-utf8", b'{"prompt": "\xff\xfe"}', 400, ""),
    ("content-type-text", (b'{"prompt": "<bos>1+2="}', {"content-type": "text/plain"}), 415, "JSON"),
    ("content-type-form", (b'prompt=1', {"content-type": "application/x-www-form-urlencoded"}), 415, "JSON"),
    ("content-type-none", (b'{"prompt": "<bos>1+2="}', {}), 415, "JSON"),
]
REST_CHAT = [
    ("messages-0", {"messages": []}, 400, "messages"),
    ("messages-missing", {"prompt": P}, 400, "messages"),
    ("content-empty", {"messages": [{"role": "user", "content": ""}]}, 400, "no content"),
    ("content-missing", {"messages": [{"role": "user"}]}, 400, "content"),
    ("content-number", {"messages": [{"role": "user", "content": 12}]}, 400, "content"),
    ("role-unknown", {"messages": [{"role": "robot", "content": P}]}, 400, "role"),
    ("context+1", lambda lim: {"messages": [{"role": "user", "content": "1" * (lim["context"] + 1)}],
                               "max_tokens": 1}, 400, "context"),
    ("max_completion_tokens-negative", {"messages": [{"role": "user", "content": P}], "max_completion_tokens": -1},
     400, "max_tokens"),
    ("max_tokens-negative", {"messages": [{"role": "user", "content": P}], "max_tokens": -5}, 400, "max_tokens"),
    ("top_logprobs-1", {"messages": [{"role": "user", "content": P}], "top_logprobs": 1}, 400, "top_logprobs"),
    ("logprobs-int", {"messages": [{"role": "user", "content": P}], "logprobs": 1}, 400, "logprobs"),
    ("n-2^64", {"messages": [{"role": "user", "content": P}], "n": 2**64}, 400, "n must"),
    ("temperature-nan", '{"messages": [{"role": "user", "content": "<bos>1+2="}], "temperature": NaN}', 400,
     "temperature"),
    ("unknown-model", {"messages": [{"role": "user", "content": P}], "model": "gpt-4"}, 404, "unknown model"),
    ("content-type-text", (b'{"messages": []}', {"content-type": "text/plain"}), 415, "JSON"),
]
REST_SCORE = [
    ("temperature-nan", '{"prompt_ids": [1, 4], "completion_ids": [5], "temperature": NaN}', 400, "temperature"),
    ("temperature-inf", '{"prompt_ids": [1, 4], "completion_ids": [5], "temperature": Infinity}', 400, "temperature"),
    ("temperature-negative", {"prompt_ids": [1, 4], "completion_ids": [5], "temperature": -1}, 400, "temperature"),
    ("context+1", lambda lim: {"prompt_ids": [1] * lim["context"], "completion_ids": [4]}, 400, "context"),
    ("token-id=vocab", lambda lim: {"prompt_ids": [1], "completion_ids": [lim["vocab"]]}, 400, "vocabulary"),
    ("token-id-negative", {"prompt_ids": [-1], "completion_ids": [4]}, 400, "vocabulary"),
    ("token-id-2^70", {"prompt_ids": [2**70], "completion_ids": [4]}, 400, "vocabulary"),
    ("prompt-0", {"prompt_ids": [], "completion_ids": [4]}, 400, "prompt_ids"),
    ("ids-strings", {"prompt_ids": ["1"], "completion_ids": [4]}, 400, "prompt_ids"),
    ("ids-bools", {"prompt_ids": [True], "completion_ids": [4]}, 400, "prompt_ids"),
    ("ids-floats", {"prompt_ids": [1.0], "completion_ids": [4]}, 400, "prompt_ids"),
    ("completion-missing", {"prompt_ids": [1]}, 400, "completion_ids"),
    ("body-array", b"[]", 400, "body"),
    ("content-type-text", (b'{"prompt_ids": [1], "completion_ids": [4]}', {"content-type": "text/plain"}), 415, "JSON"),
]
REST_CONTROL = [
    ("action-unknown", {"action": "stop"}, 400, "action"),
    ("action-missing", {}, 400, "action"),
    ("action-number", {"action": 1}, 400, "action"),
    ("content-type-none", (b'{"action": "pause"}', {"authorization": f"Bearer {TOKEN}"}), 415, "JSON"),
]


def _rest_cases():
    for path, table in [("/v1/completions", REST_COMPLETIONS), ("/v1/chat/completions", REST_CHAT)]:
        for case in table:
            yield pytest.param("rollout", path, *case[1:], id=f"rollout{path}:{case[0]}")
    for path, table in [("/v1/score", REST_SCORE), ("/v1/control", REST_CONTROL)]:
        for case in table:
            yield pytest.param("learner", path, *case[1:], id=f"learner{path}:{case[0]}")


@pytest.mark.parametrize("service, path, body, status, words", list(_rest_cases()))
def test_rest_refuses(request, limits, service, path, body, status, words):
    url = request.getfixturevalue(service)[2] + path
    body = body(limits) if callable(body) else body
    auth = {"authorization": f"Bearer {TOKEN}"} if service == "learner" else {}
    if isinstance(body, tuple):
        r = httpx.post(url, content=body[0], headers={**auth, **body[1]}, timeout=60)
    elif isinstance(body, (bytes, str)):
        r = httpx.post(url, content=body, headers={"content-type": "application/json", **auth}, timeout=60)
    else:
        r = httpx.post(url, json=body, headers=auth, timeout=60)
    _rest_refused(r, status, words)


@pytest.mark.parametrize("service, method, path, status", [
    ("rollout", "GET", "/v1/completions", 405), ("rollout", "DELETE", "/v1/chat/completions", 405),
    ("rollout", "POST", "/health", 405), ("rollout", "GET", "/v2/completions", 404),
    ("learner", "GET", "/v1/score", 405), ("learner", "PUT", "/v1/control", 405),
    ("learner", "POST", "/v1/status", 405), ("learner", "GET", "/nope", 404),
])
def test_rest_wrong_method_or_path(request, service, method, path, status):
    r = httpx.request(method, request.getfixturevalue(service)[2] + path, timeout=30)
    _rest_refused(r, status, "")


def test_rest_boundaries_are_served(rollout, learner, limits):
    """A prompt + max_tokens filling the context exactly is served (REST, both endpoints), and scored."""
    ctx = limits["context"]
    r = httpx.post(f"{rollout[2]}/v1/completions", json={"prompt": [1] * (ctx - 2), "max_tokens": 2, "n": MAX_WAITING,
                                                         "seed": 2**63 - 1, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert [len(c["token_ids"]) for c in r.json()["choices"]] == [2] * MAX_WAITING
    r = httpx.post(f"{rollout[2]}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "<bos>" + "1" * (ctx - 2)}], "max_completion_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 1, r.text
    r = httpx.post(f"{learner[2]}/v1/score", json={"prompt_ids": [1] * (ctx - 1), "completion_ids": [4]}, timeout=60,
                   headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and len(r.json()["logprobs"]) == 1, r.text
