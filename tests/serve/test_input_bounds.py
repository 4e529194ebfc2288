"""Input bounds of a real rollout process (`minite rollout` as a subprocess on loopback): one request, however
large, costs a bounded amount before it is refused (issue 17, defect 1: a 10 MB REST prompt or a 7 MB gRPC
`text` was tokenized first, at ~400 bytes of memory per character, and took the replica to 4 GB).

- the REST body is limited (--max-body-mb, 8 MiB): 413 from a Content-Length over it before any of the body
  is read, and from a chunked body (no Content-Length) once it passes the limit;
- a text prompt longer (in characters) than could fit the context is refused before it is tokenized:
  REST 400, gRPC INVALID_ARGUMENT, naming the limit and the size;
- tokenizing (and rendering the chat template) runs off the event loop: /health answers meanwhile;
- `stop` and `stop_token_ids` are bounded (--max-stop, --max-stop-chars, --max-stop-token-ids).

Each scenario checks the rollout's RSS growth and that /health kept answering, and prints one line
"RELIABILITY: <scenario> key=value ..." (`pytest -s` shows them)."""
from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time

import grpc
import httpx
import pytest

from minite.v1 import rollout_pb2 as pb
from minite.v1 import rollout_pb2_grpc as pb_grpc
from tests.service_helpers import Proc, free_port, report

MB = 1 << 20
PROMPT = "<bos>12+34="


def _start(model_dir, log, *flags):
    g, h = free_port(), free_port()
    proc = Proc(["rollout", "--model-dir", str(model_dir), "--grpc-port", str(g), "--http-port", str(h), *flags], log)
    try:
        proc.wait_http(f"http://127.0.0.1:{h}/health")
    except BaseException:
        proc.kill()
        raise
    return proc, f"http://127.0.0.1:{h}", f"127.0.0.1:{g}"


@pytest.fixture(scope="module")
def svc(service_model, tmp_path_factory):
    """The tiny model's rollout with the default bounds (its context: 32 tokens)."""
    proc, url, address = _start(service_model, tmp_path_factory.mktemp("input-bounds") / "rollout.log")
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 * MB)])
    try:
        yield {"proc": proc, "url": url, "stub": pb_grpc.RolloutServiceStub(channel)}
    finally:
        channel.close()
        proc.kill()


@contextlib.contextmanager
def health_probe(url: str):
    """Poll /health every 50 ms on a thread -> {"worst_s", "count", "failed"} once the block ends."""
    out = {"worst_s": 0.0, "count": 0, "failed": 0}
    stop = threading.Event()

    def run():
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = c.get(f"{url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                out["worst_s"] = max(out["worst_s"], time.perf_counter() - t0)
                out["count"] += 1
                out["failed"] += not ok
                stop.wait(0.05)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join(60)


def _timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


def _message(r: httpx.Response) -> str:
    body = r.json()  # (a JSON error, never a traceback)
    return body["error"]["message"]


def _raw_post(url: str, headers: str, timeout: float = 5.0) -> str:
    """A POST of headers only (no body): the server's answer, read as soon as it comes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{headers}"
                  "\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace")


def test_rest_body_over_the_limit_is_413_before_it_is_read(svc):
    url, proc = svc["url"], svc["proc"]
    rss0 = proc.rss_mb()
    big = b'{"prompt": "' + b"1" * (20 * MB) + b'", "max_tokens": 1}'
    with health_probe(url) as health:
        with httpx.Client(timeout=60) as c:
            # a Content-Length over the limit: answered before the body is read
            r1, s1 = _timed(lambda: c.post(f"{url}/v1/completions", content=big,
                                           headers={"content-type": "application/json"}))
            # the same without a Content-Length (chunked): refused once 8 MiB have been read
            r2, s2 = _timed(lambda: c.post(f"{url}/v1/completions", headers={"content-type": "application/json"},
                                           content=(big[i:i + MB] for i in range(0, len(big), MB))))
            r3, s3 = _timed(lambda: c.post(f"{url}/v1/chat/completions", headers={"content-type": "application/json"},
                                           content=(b"x" * MB for _ in range(20))))  # not even JSON
        # a client that announces 10 GB and sends nothing: the 413 comes without waiting for the body
        raw, s4 = _timed(lambda: _raw_post(url, f"Content-Length: {10 << 30}\r\n"))
        ok, s5 = _timed(lambda: httpx.post(f"{url}/v1/completions", timeout=30,
                                           json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}))
    rss1 = proc.rss_mb()
    report("rest-body-limit", body_mb=20, limit_mib=8, content_length_413_s=f"{s1:.2f}", chunked_413_s=f"{s2:.2f}",
           chunked_not_json_413_s=f"{s3:.2f}", announced_10gb_413_ms=f"{s4 * 1e3:.0f}",
           health_worst_ms=f"{health['worst_s'] * 1e3:.0f}", health_checks=health["count"],
           rss_before_mb=f"{rss0:.0f}", rss_growth_mb=f"{rss1 - rss0:.0f}", next_request_ok=ok.status_code == 200)
    for r in (r1, r2, r3):
        assert r.status_code == 413, r.text[:500]
        assert "larger than the limit of 8388608 bytes" in _message(r) and "--max-body-mb" in _message(r)
    assert raw.startswith("HTTP/1.1 413"), raw[:500]
    assert "--max-body-mb" in raw and s4 < 1.0
    assert max(s1, s2, s3) < 10, (s1, s2, s3)
    assert ok.status_code == 200, ok.text
    assert health["failed"] == 0 and health["worst_s"] < 1.0, health
    assert rss1 - rss0 < 100, (rss0, rss1)


def test_text_over_the_context_is_refused_before_tokenizing(svc):
    url, proc, stub = svc["url"], svc["proc"], svc["stub"]
    ctx = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    rss0 = proc.rss_mb()
    with health_probe(url) as health:
        with httpx.Client(timeout=60) as c:
            text = "1" * (7 * MB)  # under the body limit: the character bound refuses it
            r1, s1 = _timed(lambda: c.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1}))
            r2, s2 = _timed(lambda: c.post(f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": text[: 3 * MB]}] * 2, "max_tokens": 1}))
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as g:
            stub.Generate(pb.GenerateRequest(text=text, params=pb.SamplingParams(max_tokens=1)), timeout=60)
        s3 = time.perf_counter() - t0
    rss1 = proc.rss_mb()
    report("text-prompt-bound", context_tokens=ctx, rest_text_mb=7, rest_400_s=f"{s1:.2f}", chat_400_s=f"{s2:.2f}",
           grpc_text_mb=7, grpc_invalid_argument_s=f"{s3:.2f}", health_worst_ms=f"{health['worst_s'] * 1e3:.0f}",
           rss_before_mb=f"{rss0:.0f}", rss_growth_mb=f"{rss1 - rss0:.0f}")
    assert r1.status_code == 400 and f"the prompt text: {7 * MB} characters, more than" in _message(r1), r1.text[:500]
    assert f"context of {ctx} tokens" in _message(r1), _message(r1)
    assert r2.status_code == 400 and f"the messages' contents: {6 * MB} characters" in _message(r2), r2.text[:500]
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT, g.value
    assert f"the prompt text: {7 * MB} characters, more than" in g.value.details(), g.value.details()
    assert max(s1, s2, s3) < 5, (s1, s2, s3)
    assert health["failed"] == 0 and health["worst_s"] < 1.0, health
    assert rss1 - rss0 < 100, (rss0, rss1)


def test_text_bound_is_above_what_fits(svc):
    """The character bound only refuses what could never fit: a text at the bound still reaches the
    tokenizer (whose token count then decides), one character more does not; a normal text is served."""
    url, stub = svc["url"], svc["stub"]
    first = httpx.post(f"{url}/v1/completions", json={"prompt": "1" * (1 << 16), "max_tokens": 1}, timeout=30)
    limit = int(_message(first).split("more than the ")[1].split()[0])
    at = httpx.post(f"{url}/v1/completions", json={"prompt": "1" * limit, "max_tokens": 1}, timeout=30)
    over = httpx.post(f"{url}/v1/completions", json={"prompt": "1" * (limit + 1), "max_tokens": 1}, timeout=30)
    chat_over = httpx.post(f"{url}/v1/chat/completions", json={"max_tokens": 1, "messages": [
        {"role": "system", "content": "1" * (limit // 2)}, {"role": "user", "content": "1" * (limit // 2 + 1)}]},
        timeout=30)
    with pytest.raises(grpc.RpcError) as g_at:
        stub.Generate(pb.GenerateRequest(text="1" * limit, params=pb.SamplingParams(max_tokens=1)), timeout=30)
    fine = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}, timeout=30)
    g_fine = stub.Generate(pb.GenerateRequest(text=PROMPT, params=pb.SamplingParams(max_tokens=2)), timeout=30)
    report("text-prompt-bound-edge", limit_chars=limit, at_limit=at.status_code, over_limit=over.status_code)
    assert at.status_code == 400 and f"prompt ({limit} tokens)" in _message(at), at.text
    assert over.status_code == 400 and "characters" in _message(over), over.text
    assert chat_over.status_code == 400 and "the messages' contents" in _message(chat_over), chat_over.text
    assert "characters" not in g_at.value.details() and "context" in g_at.value.details(), g_at.value.details()
    assert fine.status_code == 200 and len(fine.json()["choices"][0]["token_ids"]) == 2, fine.text
    assert len(g_fine.choices[0].token_ids) == 2


def test_stop_lists_are_bounded(svc):
    url, stub, proc = svc["url"], svc["stub"], svc["proc"]
    base = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    rss0 = proc.rss_mb()
    with health_probe(url) as health, httpx.Client(timeout=60) as c:
        ids, s1 = _timed(lambda: c.post(f"{url}/v1/completions", json={**base, "stop_token_ids": [3] * 1_000_000}))
        many = c.post(f"{url}/v1/completions", json={**base, "stop": ["7"] * 65})
        long = c.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                         "max_tokens": 2, "stop": "9" * 1025})
        at_ids = c.post(f"{url}/v1/completions", json={**base, "stop_token_ids": [3] * 1024})
        at_stop = c.post(f"{url}/v1/completions", json={**base, "stop": [str(i % 10) * 1024 for i in range(64)]})
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as g:
            stub.Generate(pb.GenerateRequest(text=PROMPT, params=pb.SamplingParams(
                max_tokens=2, stop_token_ids=[3] * 1_000_000)), timeout=60)
        s2 = time.perf_counter() - t0
        g_at = stub.Generate(pb.GenerateRequest(text=PROMPT, params=pb.SamplingParams(
            max_tokens=2, stop_token_ids=[3] * 1024)), timeout=60)
    rss1 = proc.rss_mb()
    report("stop-list-bounds", stop_token_ids=1_000_000, rest_400_s=f"{s1:.2f}", grpc_invalid_argument_s=f"{s2:.2f}",
           health_worst_ms=f"{health['worst_s'] * 1e3:.0f}", rss_growth_mb=f"{rss1 - rss0:.0f}")
    assert ids.status_code == 400 and "stop_token_ids has 1000000 ids: at most 1024" in _message(ids), ids.text[:300]
    assert many.status_code == 400 and "stop has 65 strings: at most 64" in _message(many), many.text
    assert long.status_code == 400 and "stop string 0 has 1025 characters" in _message(long), long.text
    assert at_ids.status_code == 200 and at_stop.status_code == 200, (at_ids.text, at_stop.text)
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids has 1000000" in g.value.details()
    assert len(g_at.choices) == 1
    assert max(s1, s2) < 5 and health["worst_s"] < 1.0, (s1, s2, health)


# -- tokenizing off the event loop ------------------------------------------------------------------------------
SLOW_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                 "{% for i in range(spin | default(0)) %}{% for j in range(1000) %}{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def slow_chat(service_model, tmp_path_factory):
    """The tiny model with a chat template whose rendering takes as long as the request asks (its `spin`
    variable, through chat_template_kwargs): a stand-in for a long prompt in a slow tokenizer."""
    tmp = tmp_path_factory.mktemp("slow-chat")
    model = tmp / "model"
    shutil.copytree(service_model, model)
    (model / "chat_template.jinja").write_text(SLOW_TEMPLATE)
    proc, url, _ = _start(model, tmp / "rollout.log")
    try:
        yield {"proc": proc, "url": url}
    finally:
        proc.kill()


def test_health_answers_while_a_prompt_is_rendered_and_tokenized(slow_chat):
    url = slow_chat["url"]
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "ignore_eos": True}
    quick, s0 = _timed(lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60))
    with health_probe(url) as health:
        time.sleep(0.2)
        slow, s1 = _timed(lambda: httpx.post(f"{url}/v1/chat/completions", timeout=120,
                                             json={**body, "chat_template_kwargs": {"spin": 40000}}))
        time.sleep(0.2)
    report("tokenize-off-event-loop", render_s=f"{s1 - s0:.2f}", request_s=f"{s1:.2f}",
           health_checks_during=health["count"], health_worst_ms=f"{health['worst_s'] * 1e3:.0f}")
    assert quick.status_code == 200 and slow.status_code == 200, (quick.text, slow.text)
    assert slow.json()["prompt_token_ids"] == quick.json()["prompt_token_ids"]
    assert s1 > 0.5, s1  # the rendering took long enough for /health to have been blocked behind it
    assert health["failed"] == 0 and health["worst_s"] < 0.5 and health["count"] >= 5, health


# -- metrics ----------------------------------------------------------------------------------------------------
def test_kv_cache_usage_is_zero_when_idle(svc):
    url = svc["url"]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30).status_code == 200
    time.sleep(0.3)
    line = next(x for x in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                if x.startswith("minite_kv_cache_usage_perc{"))  # (labelled with model_name, as vLLM's)
    assert float(line.rsplit(None, 1)[1]) == 0.0, line
