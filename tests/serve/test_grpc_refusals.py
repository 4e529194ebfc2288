"""Malformed gRPC requests to every method of both services, served for real on loopback.

Raw bytes go through `request_serializer=None`, so that anything can be sent, including bytes that are no
message at all. Each request must end with the deliberate status (INVALID_ARGUMENT for bad input;
NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED where that is what the API documents) and a message
naming the problem. Boundaries are checked from both sides: a prompt that fits exactly is served, one
token more is refused. Then hypothesis sends valid messages with any field values: each is served or
refused deliberately, never an internal error. The model's limits come from its config.json.
"""
import math
import zlib

import grpc
import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minite.v1 import learner_pb2 as lpb
from minite.v1 import rollout_pb2 as rpb
from tests.service_helpers import AUTH, MAX_WAITING

EXAMPLES = 100  # per fuzzed method
INT = grpc.StatusCode.INVALID_ARGUMENT
# deterministic, no example database written to the working tree, no deadline (CPU model: slow calls), no shrinking
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=False,
                phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate], suppress_health_check=list(HealthCheck),
                verbosity=hypothesis.Verbosity.quiet)


GENERATE = "/minite.v1.RolloutService/Generate"
GENERATE_STREAM = "/minite.v1.RolloutService/GenerateStream"
UPDATE = "/minite.v1.RolloutService/UpdateWeights"
VERSION = "/minite.v1.RolloutService/GetWeightVersion"
SCORE = "/minite.v1.LearnerService/Score"
SUBMIT = "/minite.v1.LearnerService/SubmitTrajectories"
STATUS = "/minite.v1.LearnerService/Status"
U32 = 2**32 - 1
NOT_A_MESSAGE = b"\xff\xff\xff\xff"  # a field number 0 / corrupt varint: no message parses from it
BAD_UTF8_TEXT = b"\x12\x02\xff\xfe"  # GenerateRequest.text (field 2) holding bytes that are not UTF-8


def _varint(n: int) -> bytes:
    """A protobuf varint written here, not taken from services/common/weights.py: these tests craft wire
    bytes (negative numbers included) independently of the code under test."""
    n &= 2**64 - 1  # negative numbers as protobuf writes them (ten bytes, two's complement)
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _gen(prompt=(1, 4, 5, 13, 6, 14), *, model="", raw_params=b"", text=None, **params) -> bytes:
    params.setdefault("max_tokens", 2)
    req = rpb.GenerateRequest(model=model, params=rpb.SamplingParams(**params))
    if text is not None:
        req.text = text
    else:
        req.prompt_ids.ids.extend(prompt)
    # raw_params: fields appended to SamplingParams as raw wire bytes (the last occurrence of a field wins)
    p = req.params.SerializeToString() + raw_params
    req.ClearField("params")
    return req.SerializeToString() + b"\x1a" + _varint(len(p)) + p


def _unary(channel, method, payload: bytes, **kw):
    kw.setdefault("metadata", AUTH)  # (both services here have the token; Score needs it)
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=60, **kw)


def _server_stream(channel, method, payload: bytes):
    return list(channel.unary_stream(method, request_serializer=None, response_deserializer=None)(payload, timeout=60))


def _client_stream(channel, method, payloads, **kw):
    return channel.stream_unary(method, request_serializer=None, response_deserializer=None)(
        iter(payloads), timeout=60, **kw)


def _refused(call, code, words):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert e.value.details() and words in e.value.details(), e.value.details()


GENERATE_CASES = [
    # request bytes (or a function of the model's limits that makes them), expected code, words in the message
    pytest.param(NOT_A_MESSAGE, INT, "GenerateRequest", id="not-a-message"),
    pytest.param(_gen()[:-1], INT, "GenerateRequest", id="truncated"),
    pytest.param(BAD_UTF8_TEXT, INT, "GenerateRequest", id="text-not-utf8"),
    pytest.param(b"", INT, "no prompt", id="empty-message"),
    pytest.param(b"\x08\x01", INT, "no prompt", id="wrong-wire-type-only"),
    pytest.param(_gen(prompt=()), INT, "empty", id="prompt-0-ids"),
    pytest.param(_gen(text=""), INT, "empty", id="prompt-0-text"),
    pytest.param(lambda lim: _gen(prompt=[4] * lim["context"], max_tokens=1), INT, "context", id="prompt-context"),
    pytest.param(lambda lim: _gen(prompt=[4] * (lim["context"] + 1), max_tokens=1), INT, "context",
                 id="prompt-context+1"),
    pytest.param(lambda lim: _gen(text="<bos>" + "1" * lim["context"], max_tokens=1), INT, "context",
                 id="text-over-context"),
    pytest.param(lambda lim: _gen(prompt=[1] * (lim["context"] - 4), max_tokens=5), INT, "context",
                 id="prompt+max_tokens-over-context"),
    pytest.param(lambda lim: _gen(prompt=[1, lim["vocab"]]), INT, "vocabulary", id="token-id=vocab"),
    pytest.param(_gen(prompt=[1, U32]), INT, "vocabulary", id="token-id-u32-max"),
    pytest.param(_gen(raw_params=b"\x08" + _varint(-1)), INT, "max_tokens", id="max_tokens-negative"),
    pytest.param(_gen(max_tokens=U32), INT, "max_tokens", id="max_tokens-huge"),
    pytest.param(_gen(n=U32), INT, "n must", id="n-huge"),
    pytest.param(_gen(n=MAX_WAITING + 1), INT, "n must", id="n-over-queue"),
    pytest.param(_gen(raw_params=b"\x38" + _varint(-5)), INT, "n must", id="n-negative"),
    pytest.param(_gen(temperature=math.nan), INT, "temperature", id="temperature-nan"),
    pytest.param(_gen(temperature=math.inf), INT, "temperature", id="temperature-inf"),
    pytest.param(_gen(temperature=-math.inf), INT, "temperature", id="temperature--inf"),
    pytest.param(_gen(temperature=-0.5), INT, "temperature", id="temperature-negative"),
    pytest.param(_gen(temperature=5e-324), INT, "temperature", id="temperature-denormal"),
    pytest.param(_gen(temperature=1e308), INT, "temperature", id="temperature-huge"),
    pytest.param(_gen(top_p=math.nan), INT, "top_p", id="top_p-nan"),
    pytest.param(_gen(top_p=-0.5), INT, "top_p", id="top_p-negative"),
    pytest.param(_gen(top_p=1.5), INT, "top_p", id="top_p-over-1"),
    pytest.param(_gen(top_p=math.inf), INT, "top_p", id="top_p-inf"),
    pytest.param(lambda lim: _gen(stop_token_ids=[lim["vocab"]]), INT, "stop", id="stop-token-id-out-of-vocab"),
    pytest.param(_gen(model="gpt-4"), grpc.StatusCode.NOT_FOUND, "unknown model", id="unknown-model"),
    pytest.param(lambda lim: _gen(prompt=[1] * (3 << 20)), INT, "context", id="prompt-3M-tokens"),
    pytest.param(lambda lim: _gen(text="1" * (9 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than",
                 id="message-over-8MiB"),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["Generate", "GenerateStream"])
@pytest.mark.parametrize("payload, code, words", GENERATE_CASES)
def test_generate_refuses(channels, limits, streaming, payload, code, words):
    payload = payload(limits) if callable(payload) else payload
    if streaming:
        _refused(lambda: _server_stream(channels[0], GENERATE_STREAM, payload), code, words)
    else:
        _refused(lambda: _unary(channels[0], GENERATE, payload), code, words)


@pytest.mark.parametrize("streaming", [False, True], ids=["Generate", "GenerateStream"])
def test_generate_boundary_is_served(channels, limits, streaming):
    """The other side of the boundaries above: a prompt + max_tokens filling the context exactly,
    the largest n the queue holds, the extreme temperatures and top_p that are allowed."""
    ctx = limits["context"]
    for payload, tokens in [(_gen(prompt=[1] * (ctx - 1), max_tokens=1, temperature=0), 1),
                            (_gen(prompt=[1] * (ctx - 3), max_tokens=3, n=MAX_WAITING, seed=-1, top_p=1e-9), 3),
                            (_gen(max_tokens=1, temperature=100.0, top_k=U32, seed=-(2**63)), 1)]:
        if streaming:
            msgs = [rpb.GenerateStreamResponse.FromString(m)
                    for m in _server_stream(channels[0], GENERATE_STREAM, payload)]
            assert len(msgs) == tokens * max(1, rpb.GenerateRequest.FromString(payload).params.n)
            assert all(m.HasField("token_id") and math.isfinite(m.logprob) and m.logprob <= 0 for m in msgs)
        else:
            resp = rpb.GenerateResponse.FromString(_unary(channels[0], GENERATE, payload))
            assert resp.choices
            assert all(len(c.token_ids) == tokens and c.finish_reason == "length" for c in resp.choices)
            assert all(math.isfinite(x) and x <= 0 for c in resp.choices for x in c.logprobs)


def _begin(version, num_tensors, mode=0) -> bytes:
    return rpb.UpdateWeightsRequest(begin=rpb.UpdateBegin(version=version, num_tensors=num_tensors,
                                                           mode=mode)).SerializeToString()


def _chunk(**fields) -> bytes:
    return rpb.UpdateWeightsRequest(chunk=rpb.TensorChunk(**fields)).SerializeToString()


END = rpb.UpdateWeightsRequest(end=rpb.UpdateEnd()).SerializeToString()


def _update_cases(rt):
    """(id, messages, code, words) against the serving model (a real tensor name, format and shape)."""
    v, n = rt.version, len(rt.expected)
    name, (fmt, shape) = sorted(rt.expected.items())[0]
    part_shape = tuple(shape[:-1]) + (shape[-1] // 2,) if fmt == "nvfp4" else tuple(shape)  # packed: 2 codes a byte
    size = math.prod(part_shape) * {"nvfp4": 1, "bfloat16": 2, "float32": 4}[fmt]
    good = dict(name=name, format=fmt, shape=shape, part="data", part_shape=part_shape, offset=0, part_bytes=size,
                payload=bytes(4), crc32=zlib.crc32(bytes(4)))
    stale = grpc.StatusCode.FAILED_PRECONDITION
    return [
        ("empty-stream", [], INT, "empty stream"),
        ("empty-message", [b""], INT, "empty UpdateWeightsRequest"),
        ("chunk-before-begin", [_chunk(**good)], INT, "must start with UpdateBegin"),
        ("end-only", [END], INT, "must start with UpdateBegin"),
        ("stale-version", [_begin(v, n)], stale, "stale"),
        ("version-0", [_begin(0, n), END], stale, "stale"),
        ("wrong-tensor-count", [_begin(v + 1, n + 1)], INT, "tensors"),
        ("huge-tensor-count", [_begin(v + 1, U32)], INT, "tensors"),
        ("unknown-mode", [_begin(v + 1, n, mode=7), END], INT, "mode"),
        ("two-begins", [_begin(v + 1, n), _begin(v + 2, n)], INT, "second UpdateBegin"),
        ("begin-end", [_begin(v + 1, n), END], INT, "missing"),
        ("after-end", [_begin(v + 1, n), END, END], INT, "after UpdateEnd"),
        ("unknown-tensor", [_begin(v + 1, n), _chunk(**dict(good, name="model.nope"))], INT, "unknown tensor"),
        ("wrong-format", [_begin(v + 1, n), _chunk(**dict(good, format="int8"))], INT, "format"),
        ("wrong-shape", [_begin(v + 1, n), _chunk(**dict(good, shape=[1, -1]))], INT, "shape"),
        ("unknown-part", [_begin(v + 1, n), _chunk(**dict(good, part="bias"))], INT, "part"),
        ("huge-part-bytes", [_begin(v + 1, n), _chunk(**dict(good, part_bytes=2**63))], INT, "bytes announced"),
        ("wrong-part-shape", [_begin(v + 1, n), _chunk(**dict(good, part_shape=[2**40, 2**40]))], INT, "shape"),
        ("offset-past-part", [_begin(v + 1, n), _chunk(**dict(good, offset=2**63))], INT, "offset"),
        ("bad-checksum", [_begin(v + 1, n), _chunk(**dict(good, crc32=1))], INT, "checksum"),
        ("payload-past-part", [_begin(v + 1, n), _chunk(**dict(good, payload=bytes(size + 1),
                                                                crc32=zlib.crc32(bytes(size + 1))))], INT, "runs past"),
        ("truncated", [_begin(v + 1, n)], INT, "truncated"),
    ]


def _stream_refusals(channel, method, cases) -> list[str]:
    """Send each (name, messages, code, words) client stream; list those not refused with `code` and `words`."""
    failures = []
    for name, msgs, code, words in cases:
        try:
            _client_stream(channel, method, msgs, metadata=AUTH)
            failures.append(f"{name}: accepted")
        except grpc.RpcError as e:
            if e.code() != code or not e.details() or words not in e.details():
                failures.append(f"{name}: {e.code()} {e.details()!r}")
    return failures


def test_update_weights_refuses(rollout, channels):
    rt = rollout[0]
    before = rt.version
    cases = _update_cases(rt)
    assert len({c[0] for c in cases}) == len(cases)
    failures = _stream_refusals(channels[0], UPDATE, cases)
    assert not failures, failures
    assert rt.version == before  # nothing was applied


def test_update_weights_not_a_message(rollout, channels):
    _refused(lambda: _client_stream(channels[0], UPDATE, [NOT_A_MESSAGE], metadata=AUTH), INT, "UpdateWeightsRequest")


@pytest.mark.parametrize("method", [VERSION, STATUS])
def test_no_input_methods_refuse_garbage(channels, method):
    ch = channels[0] if method == VERSION else channels[1]
    _refused(lambda: _unary(ch, method, NOT_A_MESSAGE), INT, "Request")


@pytest.mark.parametrize("method", [VERSION, STATUS])
def test_no_input_methods_ignore_unknown_fields(channels, method):
    """Unknown fields are how protobuf evolves: a request with one is answered, not refused."""
    ch = channels[0] if method == VERSION else channels[1]
    assert _unary(ch, method, b"\x08\x01") is not None


def _score(prompt=(1, 4, 5, 13, 6, 14), completion=(6,), temperature=0.0) -> bytes:
    return lpb.ScoreRequest(prompt_ids=prompt, completion_ids=completion, temperature=temperature).SerializeToString()


SCORE_CASES = [
    pytest.param(NOT_A_MESSAGE, "ScoreRequest", id="not-a-message"),
    pytest.param(b"", "non-empty", id="empty-message"),
    pytest.param(_score(prompt=()), "non-empty", id="prompt-0"),
    pytest.param(_score(completion=()), "non-empty", id="completion-0"),
    pytest.param(lambda lim: _score(prompt=[1] * (lim["context"] - 1), completion=[4, 4]), "context",
                 id="context+1"),
    pytest.param(lambda lim: _score(completion=[lim["vocab"]]), "vocabulary", id="token-id=vocab"),
    pytest.param(_score(prompt=[U32]), "vocabulary", id="token-id-u32-max"),
    pytest.param(_score(temperature=math.nan), "temperature", id="temperature-nan"),
    pytest.param(_score(temperature=math.inf), "temperature", id="temperature-inf"),
    pytest.param(_score(temperature=-1.0), "temperature", id="temperature-negative"),
    pytest.param(_score(temperature=5e-324), "temperature", id="temperature-denormal"),
]


@pytest.mark.parametrize("payload, words", SCORE_CASES)
def test_score_refuses(channels, limits, payload, words):
    payload = payload(limits) if callable(payload) else payload
    _refused(lambda: _unary(channels[1], SCORE, payload), INT, words)


def test_score_boundary_is_served(channels, limits):
    ctx = limits["context"]
    resp = lpb.ScoreResponse.FromString(_unary(channels[1], SCORE, _score(prompt=[1] * (ctx - 2), completion=[4, 4])))
    assert len(resp.logprobs) == 2 and all(math.isfinite(x) and x <= 0 for x in resp.logprobs)


def _traj(**kw) -> bytes:
    t = dict(prompt_ids=[1, 4, 5, 13, 6, 14], completion_ids=[6], rollout_logprobs=[-1.0], weight_version=1,
             temperature=1.0)
    t.update(kw)
    return lpb.Trajectory(**t).SerializeToString()


def _submit_cases(lim, version):
    return [
        ("empty-stream", [], INT, "no trajectories"),
        ("empty-message", [b""], INT, "non-empty"),
        ("logprob-inf", [_traj(weight_version=version, rollout_logprobs=[-math.inf])], INT, "finite"),
        ("logprob-+inf", [_traj(weight_version=version, rollout_logprobs=[math.inf])], INT, "finite"),
        ("logprobs-missing", [_traj(weight_version=version, rollout_logprobs=[])], INT, "logprobs for"),
        ("completion-0", [_traj(weight_version=version, completion_ids=[], rollout_logprobs=[])], INT, "non-empty"),
        ("token-id=vocab", [_traj(weight_version=version, completion_ids=[lim["vocab"]])], INT, "vocabulary"),
        ("token-id-u32-max", [_traj(weight_version=version, prompt_ids=[U32])], INT, "vocabulary"),
        ("context+1", [_traj(weight_version=version, prompt_ids=[1] * lim["context"])], INT, "context"),
        ("temperature-nan", [_traj(weight_version=version, temperature=math.nan)], INT, "temperature"),
        ("temperature-inf", [_traj(weight_version=version, temperature=math.inf)], INT, "temperature"),
        ("second-bad", [_traj(weight_version=version), _traj(weight_version=version, prompt_ids=[])], INT,
         "trajectory 1"),
        ("future-version", [_traj(weight_version=2**64 - 1)], grpc.StatusCode.FAILED_PRECONDITION, "weight version"),
        ("too-many", [_traj(weight_version=version)] * 4097, grpc.StatusCode.RESOURCE_EXHAUSTED, "trajectories"),
    ]


def _observed(histogram) -> float:
    return next(x.value for m in histogram.collect() for x in m.samples if x.name.endswith("_count"))


def test_submit_trajectories_refuses(learner, channels, limits):
    rt = learner[0]
    cases = _submit_cases(limits, rt.version)
    observed_before = _observed(rt.metrics.abs_diff)
    failures = _stream_refusals(channels[1], SUBMIT, cases)
    assert not failures, failures
    assert _observed(rt.metrics.abs_diff) == observed_before  # no drift was recorded from a refused batch


@pytest.mark.parametrize("reward", [math.nan, math.inf], ids=["nan", "inf"])
def test_submit_refuses_non_finite_reward(learner, channels, reward):
    _refused(lambda: _client_stream(channels[1], SUBMIT, [_traj(weight_version=learner[0].version, reward=reward)],
                                    metadata=AUTH), INT, "reward")


def test_submit_trajectories_not_a_message(learner, channels):
    msgs = [_traj(weight_version=learner[0].version), NOT_A_MESSAGE]
    _refused(lambda: _client_stream(channels[1], SUBMIT, msgs, metadata=AUTH), INT, "Trajectory")


# -- fuzz: any field values, valid messages --------------------------------------------------------

DELIBERATE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
U32S = st.one_of(st.integers(0, 40), st.integers(0, U32))
FLOATS = st.one_of(st.none(), st.floats(), st.floats(0, 3), st.sampled_from([0.0, 5e-324, 1e-3, 1e3, 1e308]))
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # (protobuf cannot carry lone surrogates)


def token_lists(vocab, ctx):
    """Mostly prompts that fit (ids in the vocabulary, shorter than the context), some that do not."""
    return st.one_of(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=ctx // 2),
                     st.lists(st.integers(0, vocab - 1), max_size=ctx + 2), st.lists(U32S, max_size=ctx + 2))


@st.composite
def generate_requests(draw, vocab, ctx):
    req = rpb.GenerateRequest(model=draw(st.sampled_from(["", "", "minite-tiny", "gpt-4"])))
    prompt = draw(st.one_of(st.none(), token_lists(vocab, ctx), token_lists(vocab, ctx), TEXT, st.just("<bos>1+2=")))
    if isinstance(prompt, list):
        req.prompt_ids.ids.extend(prompt)
    elif isinstance(prompt, str):
        req.text = prompt
    p = req.params
    p.max_tokens = draw(st.one_of(st.integers(0, 8), U32S))
    p.top_k = draw(U32S)
    p.n = draw(st.one_of(st.integers(0, 10), U32S))
    p.stop_token_ids.extend(draw(st.one_of(st.lists(st.integers(0, vocab - 1), max_size=2),
                                           st.lists(U32S, max_size=3))))
    for name in ("temperature", "top_p"):
        value = draw(FLOATS)
        if value is not None:
            setattr(p, name, value)
    seed = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    if seed is not None:
        p.seed = seed
    return req


@pytest.mark.parametrize("streaming", [False, True], ids=["Generate", "GenerateStream"])
def test_generate_fuzz(channels, limits, streaming):
    """Any GenerateRequest ends OK (with sound output) or with a deliberate code and a message."""
    outcomes = {}

    @FUZZ
    @given(req=generate_requests(limits["vocab"], limits["context"]))
    def run(req):
        payload = req.SerializeToString()
        try:
            if streaming:
                msgs = [rpb.GenerateStreamResponse.FromString(m)
                        for m in _server_stream(channels[0], GENERATE_STREAM, payload)]
                tokens = [(m.token_id, m.logprob) for m in msgs if m.HasField("token_id")]
            else:
                resp = rpb.GenerateResponse.FromString(_unary(channels[0], GENERATE, payload))
                assert len(resp.choices) == (req.params.n or 1)
                assert all(len(c.token_ids) <= (req.params.max_tokens or 16) for c in resp.choices)
                tokens = [(t, lp) for c in resp.choices for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
            assert all(0 <= t < limits["vocab"] and math.isfinite(lp) and lp <= 0 for t, lp in tokens), tokens
            outcomes["OK"] = outcomes.get("OK", 0) + 1
        except grpc.RpcError as e:
            assert e.code() in DELIBERATE and e.details(), (e.code(), e.details(), req)
            outcomes[e.code().name] = outcomes.get(e.code().name, 0) + 1

    run()
    assert outcomes.get("OK", 0) >= 5 and outcomes.get("INVALID_ARGUMENT", 0) >= 5, outcomes  # both sides were hit


def test_score_fuzz(channels, limits):
    outcomes = {}

    @FUZZ
    @given(prompt=token_lists(limits["vocab"], limits["context"]),
           completion=token_lists(limits["vocab"], limits["context"]),
           temperature=st.one_of(st.floats(), st.floats(0, 3), st.just(0.0)))
    def run(prompt, completion, temperature):
        payload = lpb.ScoreRequest(prompt_ids=prompt, completion_ids=completion,
                                   temperature=temperature).SerializeToString()
        try:
            resp = lpb.ScoreResponse.FromString(_unary(channels[1], SCORE, payload))
            assert len(resp.logprobs) == len(completion) and all(math.isfinite(x) and x <= 0 for x in resp.logprobs)
            outcomes["OK"] = outcomes.get("OK", 0) + 1
        except grpc.RpcError as e:
            assert e.code() == INT and e.details(), (e.code(), e.details())
            outcomes["INVALID_ARGUMENT"] = outcomes.get("INVALID_ARGUMENT", 0) + 1

    run()
    assert outcomes.get("OK", 0) >= 5 and outcomes.get("INVALID_ARGUMENT", 0) >= 5, outcomes
