"""The rollout service over real gRPC and HTTP on loopback: logprobs equal to the learner's, bit for bit,
through both protocols; OpenAI-shaped REST; versioned atomic weight pushes (finish or abort in-flight
sequences); auth, deadlines, bounded queues, and clear errors for bad input."""
import copy
import json
import threading
import time

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from minite.v1 import rollout_pb2 as pb
from minite.v1 import rollout_pb2_grpc as pb_grpc
from services.common.weights import encode_update
from tests.service_helpers import learner_on, new_weights, rollout_service

TOKEN = "test-token-9f2c"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = [1, 4, 5, 13, 6, 7, 14]  # <bos>12+34=


@pytest.fixture(scope="module")
def svc(service_model):
    with rollout_service(service_model, auth_token=TOKEN, max_waiting=8, max_slots=4) as s:
        yield s


@pytest.fixture(scope="module")
def stub(svc):
    ch = grpc.insecure_channel(svc[1])
    yield pb_grpc.RolloutServiceStub(ch)
    ch.close()


def gen_request(prompt=PROMPT, **params):
    params.setdefault("max_tokens", 6)
    return pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompt), params=pb.SamplingParams(**params))


def push(stub, weights, version, **kw):
    return stub.UpdateWeights(encode_update(weights, version, **kw), metadata=AUTH, timeout=60)


def test_generate_logprobs_equal_learner_bitwise(svc, service_model, stub):
    resp = stub.Generate(gen_request(n=3, seed=7, temperature=1.0), timeout=60)
    assert len(resp.choices) == 3 and list(resp.prompt_ids) == PROMPT
    learner = learner_on(service_model)
    for c in resp.choices:
        assert c.weight_version == resp.weight_version == svc[0].version
        assert len(c.logprobs) == len(c.token_ids) > 0
        mine = learner.logprobs(PROMPT, list(c.token_ids))
        assert torch.equal(torch.tensor(list(c.logprobs), dtype=torch.float32), mine)
    again = stub.Generate(gen_request(n=3, seed=7), timeout=60)  # seeded: the same tokens again
    assert [list(c.token_ids) for c in again.choices] == [list(c.token_ids) for c in resp.choices]


def test_stream_matches_unary(stub):
    unary = stub.Generate(gen_request(n=2, seed=11), timeout=60)
    got = {0: ([], []), 1: ([], [])}
    finish = {}
    for ev in stub.GenerateStream(gen_request(n=2, seed=11), timeout=60):
        got[ev.index][0].append(ev.token_id)
        got[ev.index][1].append(ev.logprob)
        if ev.finish_reason:
            finish[ev.index] = ev.finish_reason
    for c in unary.choices:
        assert got[c.index][0] == list(c.token_ids)
        assert got[c.index][1] == list(c.logprobs)
        assert finish[c.index] == c.finish_reason


def test_top_logprobs_are_the_learners_and_streamed_alike(service_model, stub):
    req = gen_request(n=2, seed=5, temperature=0.7, top_logprobs=4)
    unary = stub.Generate(req, timeout=60)
    learner = learner_on(service_model)
    for c in unary.choices:
        toks = list(c.token_ids)
        assert len(c.top_logprobs) == len(toks) > 0
        for k, top in enumerate(c.top_logprobs):
            alts, lps = list(top.token_ids), list(top.logprobs)
            assert len(alts) == len(set(alts)) == 4 and lps == sorted(lps, reverse=True)
            assert lps[0] >= c.logprobs[k]  # nothing is likelier than the most likely
            if toks[k] in alts:
                assert lps[alts.index(toks[k])] == c.logprobs[k]
            for alt, lp in zip(alts, lps):  # each one is the learner's logprob of that token, bit for bit
                mine = learner.logprobs(PROMPT + toks[:k], [alt], 0.7)
                assert torch.equal(torch.tensor([lp], dtype=torch.float32), mine)
    streamed = {c.index: [] for c in unary.choices}
    for ev in stub.GenerateStream(req, timeout=60):
        if ev.HasField("token_id"):
            assert ev.HasField("top_logprobs")
            streamed[ev.index].append(ev.top_logprobs)
    for c in unary.choices:
        assert streamed[c.index] == list(c.top_logprobs)
    plain = stub.Generate(gen_request(n=1, seed=5), timeout=60)  # not asked for: none sent
    assert all(len(c.top_logprobs) == 0 for c in plain.choices)


def test_text_prompt_and_rest_equal_grpc(svc, stub):
    url = svc[2]
    g = stub.Generate(pb.GenerateRequest(text="<bos>12+34=", params=pb.SamplingParams(max_tokens=5, seed=3, n=2)), timeout=60)
    assert list(g.prompt_ids) == PROMPT
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "<bos>12+34=", "max_tokens": 5, "seed": 3, "n": 2,
                                                  "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] == PROMPT and body["object"] == "text_completion"
    for rc, gc in zip(body["choices"], g.choices):
        assert rc["token_ids"] == list(gc.token_ids)
        # JSON carries the fp32 logprob as a double: the same value
        assert [float(torch.tensor(x, dtype=torch.float32)) for x in rc["logprobs"]["token_logprobs"]] == list(gc.logprobs)
        assert rc["weight_version"] == gc.weight_version
    ids = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "seed": 3, "n": 2}, timeout=60)
    assert [c["token_ids"] for c in ids.json()["choices"]] == [c["token_ids"] for c in body["choices"]]


def test_rest_chat_stream_and_models(svc):
    url = svc[2]
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "minite-tiny"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert "/v1/chat/completions" in httpx.get(f"{url}/openapi.json").json()["paths"]
    req = {"model": "minite-tiny", "messages": [{"role": "user", "content": "<bos>1+2="}], "max_tokens": 4,
           "seed": 5, "logprobs": True}
    full = httpx.post(f"{url}/v1/chat/completions", json=req, timeout=60).json()
    choice = full["choices"][0]
    assert full["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=dict(req, stream=True), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["token_ids"][0] for c in chunks] == choice["token_ids"]
    assert [c["choices"][0]["logprobs"]["content"][0]["logprob"] for c in chunks] == \
        [x["logprob"] for x in choice["logprobs"]["content"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_stop_string_ends_the_text(svc):
    r = httpx.post(f"{svc[2]}/v1/completions", json={"prompt": "<bos>1+1=", "max_tokens": 12, "seed": 1,
                                                     "temperature": 1.5}, timeout=60).json()
    text = r["choices"][0]["text"]
    assert len(text) >= 2  # (seed 1 samples a long text: the premise of the test)
    stop = text[1]
    r2 = httpx.post(f"{svc[2]}/v1/completions", json={"prompt": "<bos>1+1=", "max_tokens": 12, "seed": 1,
                                                      "temperature": 1.5, "stop": [stop]}, timeout=60).json()
    c = r2["choices"][0]
    assert c["finish_reason"] == "stop" and stop not in c["text"] and c["text"] == text[: text.index(stop)]


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "<bos>1+2=", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "<bos>1+2=", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "<bos>1+2=", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "<bos>1+2=", "max_tokens": 30}, 400, "context"),
    ({"prompt": list(range(1, 15)) * 3, "max_tokens": 1}, 400, "context"),
    ({"prompt": [], "max_tokens": 1}, 400, "empty"),
    ({"prompt": "", "max_tokens": 1}, 400, "empty"),
    ({"prompt": [99], "max_tokens": 1}, 400, "vocabulary"),
    ({"prompt": "<bos>1+2=", "n": 0}, 400, "n must"),
    ({"prompt": "<bos>1+2=", "n": 10**6}, 400, "n must"),
    ({"prompt": "<bos>1+2=", "top_p": 0}, 400, "top_p"),
    ({"prompt": "<bos>1+2=", "model": "gpt-4"}, 404, "unknown model"),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_rest_bad_input(svc, body, status, words):
    r = httpx.post(f"{svc[2]}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.parametrize("body, words", [
    ({"prompt": "<bos>1+2=", "temperature": 1e-45}, "temperature"),
    ({"prompt": "<bos>1+2=", "temperature": 1e308}, "temperature"),
    ({"prompt": "<bos>1+2=", "temperature": -1}, "temperature"),
    ('{"prompt": "\\ud800"}', "tokenize"),  # a lone surrogate, escaped in valid JSON
    ({"prompt": "<bos>1+2=", "stop": [""]}, "stop"),
    ({"prompt": "<bos>1+2=", "stop_token_ids": [-1]}, "token ids"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": "<bos>1+2=", "logprobs": -1}, "logprobs"),
])
def test_rest_more_bad_input(svc, body, words):
    if isinstance(body, str):
        r = httpx.post(f"{svc[2]}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(f"{svc[2]}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_rest_bad_json(svc):
    r = httpx.post(f"{svc[2]}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def _streamed(url: str, req: dict) -> dict:
    """A streamed completion's one choice, gathered: text, token ids, token logprobs, finish_reason."""
    out = {"text": "", "token_ids": [], "token_logprobs": [], "finish_reason": None}
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(req, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                out["text"] += c["text"]
                out["token_ids"] += c["token_ids"]
                out["token_logprobs"] += (c["logprobs"] or {}).get("token_logprobs", [])
                out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
    return out


def _unary(url: str, req: dict) -> dict:
    c = httpx.post(f"{url}/v1/completions", json=req, timeout=60).json()["choices"][0]
    return {"text": c["text"], "token_ids": c["token_ids"], "token_logprobs": c["logprobs"]["token_logprobs"],
            "finish_reason": c["finish_reason"]}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stream_stop_string_gives_the_unary_answer(svc, seed):
    """The token that completes a stop string is streamed too (its id, its logprob), the text trimmed as unary."""
    from minite_core.rl.tiny import build_tokenizer

    decode = build_tokenizer().decode
    req = {"prompt": "<bos>1+1=", "max_tokens": 12, "seed": seed, "temperature": 1.5, "logprobs": 0, "ignore_eos": True}
    full = _unary(svc[2], req)
    assert len(full["text"]) >= 2
    req["stop"] = [full["text"][1]]
    unary, streamed = _unary(svc[2], req), _streamed(svc[2], req)
    assert streamed == unary
    n = len(unary["token_ids"])
    assert unary["token_ids"] == full["token_ids"][:n] and unary["finish_reason"] == "stop"
    assert req["stop"][0] in decode(full["token_ids"][:n]) and req["stop"][0] not in decode(full["token_ids"][:n - 1])
    assert unary["text"] == full["text"][: full["text"].index(req["stop"][0])]


def test_a_stop_string_on_the_last_allowed_token_finishes_with_stop(svc):
    """A stop string completed by the max_tokens-th token: finish_reason "stop" (as vLLM), not "length"."""
    from minite_core.rl.tiny import build_tokenizer

    decode = build_tokenizer().decode
    for seed in range(1, 40):  # a sample whose 4th token's text is new in it
        req = {"prompt": "<bos>1+1=", "max_tokens": 4, "seed": seed, "temperature": 1.5, "logprobs": 0,
               "ignore_eos": True}
        full = _unary(svc[2], req)
        last, head = decode(full["token_ids"][3:]), decode(full["token_ids"][:3])
        if last and last not in head:
            break
    assert full["finish_reason"] == "length" and last and last not in head
    unary, streamed = _unary(svc[2], dict(req, stop=[last])), _streamed(svc[2], dict(req, stop=[last]))
    assert unary["finish_reason"] == "stop" and unary["token_ids"] == full["token_ids"] and unary["text"] == head
    assert streamed == unary


def test_chat_max_completion_tokens(svc):
    r = httpx.post(f"{svc[2]}/v1/chat/completions", json={"messages": [{"role": "user", "content": "<bos>1+2="}],
                                                          "max_completion_tokens": 2, "seed": 1}, timeout=60).json()
    assert len(r["choices"][0]["token_ids"]) <= 2 and r["usage"]["completion_tokens"] <= 2


def test_rest_nan_temperature(svc):
    r = httpx.post(f"{svc[2]}/v1/completions", content='{"prompt": "<bos>1+2=", "temperature": NaN}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


@pytest.mark.parametrize("req, code, words", [
    (pb.GenerateRequest(params=pb.SamplingParams(max_tokens=2)), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    (gen_request(max_tokens=100000), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (gen_request(prompt=[200]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (gen_request(temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (gen_request(n=10**6), grpc.StatusCode.INVALID_ARGUMENT, "n must"),
    (gen_request(top_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=PROMPT), model="other"), grpc.StatusCode.NOT_FOUND, "unknown model"),
])
def test_grpc_bad_input(stub, req, code, words):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req, timeout=30)
    assert e.value.code() == code and words in e.value.details()


@pytest.fixture(scope="module")
def narrow(service_model):
    """One KV-cache slot and a queue of 8: easy to fill, and a long request takes a while."""
    with rollout_service(service_model, max_slots=1, max_waiting=8) as s:
        ch = grpc.insecure_channel(s[1])
        yield s, pb_grpc.RolloutServiceStub(ch)
        ch.close()


def _idle(rt, timeout=30.0):
    deadline = time.monotonic() + timeout
    while rt.engine.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    return not rt.engine.busy


def test_overload_is_refused_not_queued(narrow):
    (rt, addr, url), stub = narrow
    assert _idle(rt)
    # n beyond the queue bound can never be served: a client error, not "retry later"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 9}, timeout=30)
    assert r.status_code == 400 and "n must be <= 8" in r.json()["error"]["message"]
    # fill the queue for real: 1 sequence running, 7 waiting
    events, done = _stream_in_background(stub, gen_request(prompt=[1, 4], max_tokens=28, n=8, seed=1))
    while not events:
        time.sleep(0.002)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 4}, timeout=30)
    assert r.status_code == 429 and "retry" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(gen_request(n=4), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert done.wait(120)  # the burst ends: served again
    assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 4}, timeout=60).status_code == 200


def test_deadline_cancels_the_work(narrow):
    (rt, addr, url), stub = narrow
    assert _idle(rt)
    before = rt.metrics.generated_tokens._value.get()
    with pytest.raises(grpc.RpcError) as e:  # 8 samples x 28 tokens, one slot: far longer than 50 ms
        stub.Generate(gen_request(prompt=[1, 4], n=8, max_tokens=28, seed=2), timeout=0.05)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _idle(rt)
    # cancelled: most of the 224 tokens were never computed for nobody
    assert rt.metrics.generated_tokens._value.get() - before < 8 * 28 / 2


def test_no_deadline_is_fine(narrow):
    _, stub = narrow
    assert len(stub.Generate(gen_request(max_tokens=2)).choices) == 1  # a client that sets no deadline
    assert sum(1 for _ in stub.GenerateStream(gen_request(max_tokens=2))) == 2


def test_health_and_reflection(svc):
    ch = grpc.insecure_channel(svc[1])
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="minite.v1.RolloutService"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"minite.v1.RolloutService", "grpc.health.v1.Health"} <= names
    # v1 (what grpcurl asks for first): the same messages on the wire under grpc.reflection.v1
    v1 = ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                          request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                          response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="minite.v1.RolloutService")]
    listed, symbol = list(v1(iter(reqs), timeout=30))
    v1_names = {s.name for s in listed.list_services_response.service}
    assert {"minite.v1.RolloutService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= v1_names
    from google.protobuf import descriptor_pb2
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in symbol.file_descriptor_response.file_descriptor_proto]
    assert any(svc.name == "RolloutService" for f in files for svc in f.service)
    ch.close()


# -- weight pushes: the tests below change the served weights, in version order ------------------


def test_push_needs_the_token(service_model, stub):
    w = new_weights(service_model, seed=1)
    for md in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(encode_update(w, 1), metadata=md, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and TOKEN not in e.value.details()


def _corrupt(msgs):
    for m in msgs:
        if m.WhichOneof("kind") == "chunk" and m.chunk.part == "data" and m.chunk.payload:
            p = bytearray(m.chunk.payload)
            p[0] ^= 0xFF
            m.chunk.payload = bytes(p)
            m = type(m)(chunk=m.chunk)
        yield m


def _drop_end(msgs):
    for m in msgs:
        if m.WhichOneof("kind") != "end":
            yield m


def _rename(msgs):
    for m in msgs:
        if m.WhichOneof("kind") == "chunk" and m.chunk.name.endswith("q_proj.weight"):
            m.chunk.name = m.chunk.name.replace("q_proj", "qq_proj")
        yield m


def _reshape(msgs):
    for m in msgs:
        if m.WhichOneof("kind") == "chunk" and m.chunk.name.endswith("up_proj.weight"):
            del m.chunk.shape[:]
            m.chunk.shape.extend([8, 8])
        yield m


@pytest.mark.parametrize("mangle, code, words", [
    (_corrupt, grpc.StatusCode.INVALID_ARGUMENT, "checksum"),
    (_drop_end, grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
    (_rename, grpc.StatusCode.INVALID_ARGUMENT, "unknown tensor"),
    (_reshape, grpc.StatusCode.INVALID_ARGUMENT, "shape"),
])
def test_bad_push_keeps_serving_old_weights(svc, service_model, stub, mangle, code, words):
    before = stub.GetWeightVersion(pb.GetWeightVersionRequest()).version
    served = svc[0].engine.model.w
    with pytest.raises(grpc.RpcError) as e:
        stub.UpdateWeights(mangle(encode_update(new_weights(service_model, seed=2), before + 1)), metadata=AUTH, timeout=60)
    assert e.value.code() == code and words in e.value.details(), e.value.details()
    assert stub.GetWeightVersion(pb.GetWeightVersionRequest()).version == before
    assert svc[0].engine.model.w is served


def test_push_applies_and_new_logprobs_match(svc, service_model, stub):
    v = stub.GetWeightVersion(pb.GetWeightVersionRequest()).version + 1
    w = new_weights(service_model, seed=3)
    resp = push(stub, w, v, chunk_bytes=1 << 20)
    assert resp.version == v and resp.tensors == len(w) and resp.bytes > 0
    assert stub.GetWeightVersion(pb.GetWeightVersionRequest()).version == v
    out = stub.Generate(gen_request(seed=4, n=2), timeout=60)
    learner = learner_on(service_model, w)
    for c in out.choices:
        assert c.weight_version == v
        assert torch.equal(torch.tensor(list(c.logprobs), dtype=torch.float32), learner.logprobs(PROMPT, list(c.token_ids)))
    with pytest.raises(grpc.RpcError) as e:  # the same version again is stale
        push(stub, w, v)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in e.value.details()


def _stream_in_background(stub, req):
    events, done = [], threading.Event()

    def go():
        try:
            for ev in stub.GenerateStream(req, timeout=120):
                events.append(ev)
        finally:
            done.set()
    threading.Thread(target=go, daemon=True).start()
    return events, done


def test_in_flight_sequences_finish_on_their_version(svc, service_model, stub):
    old_v = stub.GetWeightVersion(pb.GetWeightVersionRequest()).version
    old_w = svc[0].engine.model.w
    prompt = [1, 4]
    new_w = new_weights(service_model, seed=5)
    events, done = _stream_in_background(stub, gen_request(prompt=prompt, max_tokens=28, n=4, seed=9))
    while not events:
        time.sleep(0.002)
    push(stub, new_w, old_v + 1)  # default mode: finish in flight
    assert not done.is_set() or len(events) < 4 * 28  # the push landed while the stream ran
    assert done.wait(120)
    assert {e.weight_version for e in events} == {old_v}
    learner = learner_on(service_model, old_w)
    for i in range(4):
        toks = [e.token_id for e in events if e.index == i]
        lps = [e.logprob for e in events if e.index == i]
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), learner.logprobs(prompt, toks))
    after = stub.Generate(gen_request(seed=1), timeout=60)
    assert after.weight_version == old_v + 1


def test_memory_of_a_version_in_use_is_not_reused(svc, service_model, stub):
    """Two pushes while one stream still runs on the version before them: the receiver recycles retired
    weight memory, but never the memory of a version a request still uses."""
    v = stub.GetWeightVersion(pb.GetWeightVersionRequest()).version
    old_w = svc[0].engine.model.w
    push(stub, new_weights(service_model, seed=20), v + 1)  # so that retired arenas exist
    push(stub, new_weights(service_model, seed=21), v + 2)
    old_w = copy.deepcopy(svc[0].engine.model.w)  # a copy: the served tensors' memory is what is at stake
    events, done = _stream_in_background(stub, gen_request(prompt=[1, 4], max_tokens=28, n=4, seed=12))
    while not events:
        time.sleep(0.005)
    push(stub, new_weights(service_model, seed=22), v + 3)
    push(stub, new_weights(service_model, seed=23), v + 4)
    push(stub, new_weights(service_model, seed=24), v + 5)
    assert done.wait(120)
    assert {e.weight_version for e in events} == {v + 2}
    learner = learner_on(service_model, old_w)
    for i in range(4):
        toks = [e.token_id for e in events if e.index == i]
        lps = [e.logprob for e in events if e.index == i]
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), learner.logprobs([1, 4], toks))


def test_abort_mode_aborts_in_flight(svc, service_model, stub):
    v = stub.GetWeightVersion(pb.GetWeightVersionRequest()).version
    w = new_weights(service_model, seed=6)
    events, done = _stream_in_background(stub, gen_request(prompt=[1, 4], max_tokens=28, n=4, seed=10))
    while not events:
        time.sleep(0.002)
    resp = push(stub, w, v + 1, abort_in_flight=True)
    assert done.wait(60)
    reasons = {e.index: e.finish_reason for e in events if e.finish_reason}
    assert resp.aborted_sequences >= 1 and "abort" in reasons.values()
    assert {e.weight_version for e in events} == {v}
    # a sample that ended by the abort, without a token of its own, says so with the token unset
    for e in events:
        if e.finish_reason == "abort" and not e.HasField("token_id"):
            assert not e.HasField("logprob")


def test_an_aborted_stream_sends_the_text_it_held_back(svc, service_model, stub):
    """A streamed choice holds back text that could still grow into a stop string; when a weight push with
    abort cuts it, the last event sends that text: the streamed text is the decode of its tokens, as the
    unary answer's would be."""
    from minite_core.rl.addition import CHARS, build_tokenizer

    decode = build_tokenizer().decode
    v = stub.GetWeightVersion(pb.GetWeightVersionRequest()).version
    # every character starts a stop string that never completes: each unfinished text's last character is held
    req = {"prompt": "<bos>1+4=", "max_tokens": 27, "n": 4, "seed": 11, "temperature": 1.5, "ignore_eos": True,
           "stream": True, "stop": [c + "<" for c in CHARS]}
    choices, refused, started, done = {}, [], threading.Event(), threading.Event()

    def go():
        try:
            with httpx.stream("POST", f"{svc[2]}/v1/completions", json=req, timeout=120) as r:
                if r.status_code != 200:
                    refused.append(r.read().decode())
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        c = json.loads(line[6:])["choices"][0]
                        mine = choices.setdefault(c["index"], {"text": "", "ids": [], "finish": None})
                        mine["text"] += c["text"]
                        mine["ids"] += c["token_ids"]
                        mine["finish"] = c["finish_reason"] or mine["finish"]
                        started.set()
        finally:
            done.set()
    threading.Thread(target=go, daemon=True).start()
    assert started.wait(60), refused
    push(stub, new_weights(service_model, seed=7), v + 1, abort_in_flight=True)
    assert done.wait(60)
    cut = [c for c in choices.values() if c["finish"] == "abort" and c["ids"]]
    assert cut, "the push landed after every sample had finished"
    for c in cut:
        assert c["text"] == decode(c["ids"]) != ""


def test_tls(service_model, tmp_path):
    """gRPC over TLS when configured: a client that trusts the (self-signed) cert works, plaintext does not."""
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    with rollout_service(service_model, tls_cert=cert, tls_key=key) as (rt, addr, _):
        secure = grpc.secure_channel(addr, grpc.ssl_channel_credentials(cert.read_bytes()))
        assert pb_grpc.RolloutServiceStub(secure).GetWeightVersion(pb.GetWeightVersionRequest(), timeout=30).version == 0
        plain = grpc.insecure_channel(addr)
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.RolloutServiceStub(plain).GetWeightVersion(pb.GetWeightVersionRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        secure.close()
        plain.close()
